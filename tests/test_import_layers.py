"""Imports flow down the package's layers (issue 34): docs/layout.md draws the layers, this test
keeps them.

Every module gets a layer from its folder (`algo/` ... `commands/`), or, for the few modules at the
package root, from its own name (`errors` and `cli` at the ground, `train` at the top). A module
may import a module of a lower layer, or one in its own folder; anything else is an upward import
and fails, naming the two files. A circle between modules fails too.

What counts as an import: every `import ebpo_lite...` / `from ebpo_lite... import ...` that runs,
at module level or inside a function. A lazy in-function import is how a module keeps torch or
vLLM off its import path, not a licence to reach up: it is still a dependency, and the layer
rule holds for it. Not counted: imports under `if TYPE_CHECKING:` (annotations only; nothing runs),
and `import ebpo_lite` / `from ebpo_lite import __version__` (the package root, which imports
nothing of its own until a name is asked for; see its `__getattr__`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "ebpo_lite"

# A folder's layer, or a root module's. An import must point to a lower number, or stay inside
# its own folder (root modules: those of the same number).
LAYERS = {
    "errors": 0,  # one-line user errors
    "cli": 0,  # what every command shares: quiet libraries, those errors
    "algo": 1,  # pure math on tensors: no model, no file, no config object
    "catalog": 1,  # the packaged recipes and notebooks, recipe names
    "presets": 1,  # data presets, benchmarks and the held-out rules config checks at load
    "renamed": 1,  # config keys renamed since older recipes and run folders were written
    "config": 2,  # typed config (it checks the loss menu's names with algo.loss_keys)
    "rewards": 3,
    "env": 3.5,  # tool use's contract, containment and formats (the loop is engine/episodes)
    "data": 4,
    "model": 5,
    "rollout": 6,
    "engine": 7,
    "eval": 8,  # the eval shared by `python -m ebpo_lite.eval` and the in-training eval
    "train_eval": 8,
    "commands": 9,
    "integrations": 9,
    "train": 10,  # the loop
    "api": 10,
    "__main__": 10,
    "__init__": 10,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def place(module: str) -> tuple[str, int]:
    """(folder, layer) of a module of the package: `ebpo_lite.algo.loss` -> ("algo", 1)."""
    parts = module.split(".")[1:] or ["__init__"]
    if len(parts) == 1 and not (PACKAGE / parts[0]).is_dir():
        return "", LAYERS[parts[0]]
    return parts[0], LAYERS[parts[0]]


def imports(path: Path, modules: set[str]) -> dict[str, int]:
    """Package modules `path` imports (outside `if TYPE_CHECKING:`) -> the first line doing so."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from ebpo_lite.data import mathdata` imports a module; `... import Example`, a name
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "ebpo_lite":
                found.setdefault(name, node.lineno)
    return found


def graph() -> dict[str, dict[str, int]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    out = {}
    for p in files:
        me = module_name(p)
        # a package may import its own submodules (re-exports, lazy backends)
        out[me] = {
            m: line
            for m, line in imports(p, modules).items()
            if m != me and not m.startswith(me + ".")
        }
    return out


def _file(module: str) -> str:
    path = PACKAGE.parent / Path(*module.split("."))
    return str(
        (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(REPO)
    )


def upward(g: dict[str, dict[str, int]]) -> list[str]:
    """One line per import that points up a layer or across to a folder of the same layer."""
    bad = []
    for me, targets in sorted(g.items()):
        folder, layer = place(me)
        for other, line in sorted(targets.items()):
            o_folder, o_layer = place(other)
            if o_layer < layer or (o_folder == folder and o_layer == layer):
                continue
            bad.append(
                f"{_file(me)}:{line} (layer {layer}, {folder or 'root'}) imports {_file(other)} "
                f"(layer {o_layer}, {o_folder or 'root'})"
            )
    return bad


def cycle(g: dict[str, set[str]] | dict[str, dict[str, int]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_every_module_has_a_layer():
    """A new folder or root module gets a line in LAYERS (and in docs/layout.md)."""
    unplaced = []
    for m in graph():
        try:
            place(m)
        except KeyError:
            unplaced.append(_file(m))
    assert not unplaced, f"no layer in LAYERS for: {unplaced}"


def test_imports_only_go_down():
    bad = upward(graph())
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_circle():
    found = cycle(graph())
    assert found is None, " -> ".join(_file(m) for m in found)


def test_a_planted_upward_import_fails(tmp_path):
    """The check can fail: algo/groups.py importing engine/run.py (pure math reaching up into a
    run's mechanics), read from a copy of the file, is named with both files."""
    g = graph()
    planted = PACKAGE / "algo" / "groups.py"
    copy = tmp_path / "groups.py"
    copy.write_text(planted.read_text() + "\n\ndef _f():\n    from ebpo_lite.engine import run\n")
    found = imports(copy, set(g))
    assert found == {
        **imports(planted, set(g)),
        "ebpo_lite.engine.run": found["ebpo_lite.engine.run"],
    }
    g["ebpo_lite.algo.groups"] = found
    bad = upward(g)
    assert len(bad) == 1
    assert bad[0].startswith("ebpo_lite/algo/groups.py:") and "ebpo_lite/engine/run.py" in bad[0]


def test_a_planted_circle_fails():
    g = graph()
    g["ebpo_lite.errors"] = {**g["ebpo_lite.errors"], "ebpo_lite.cli": 1}  # cli imports errors
    found = cycle(g)
    assert found is not None and {"ebpo_lite.errors", "ebpo_lite.cli"} <= set(found)


def test_imports_under_type_checking_do_not_count(tmp_path):
    copy = tmp_path / "m.py"
    copy.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ebpo_lite.engine.run import Run\n"
        "def f():\n    from ebpo_lite.algo import loss\n"
    )
    assert imports(copy, set(graph())) == {"ebpo_lite.algo.loss": 5}
