"""The house rules of STYLE.md and issue 16 that a machine can check: no module over 600 lines,
and no import circle between the package's modules (imports inside functions count; only
`if TYPE_CHECKING:` blocks do not)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from tests.conftest import REPO

PACKAGE = REPO / "ebpo_lite"
MAX_LINES = 600


def _module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path, modules: set[str]) -> set[str]:
    """Package modules that `path` imports anywhere but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in files}
    graph = {}
    for p in files:
        me = _module_name(p)
        # a package may import its own submodules (re-exports, lazy backends): not a circle
        graph[me] = {m for m in _imports(p, modules) if m != me and not m.startswith(me + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_over_600_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_no_import_circle_between_modules():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_circle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_front_door_and_the_package_import_without_torch():
    """`ebpo-lite --help`, `recipes` and the package itself start in a tenth of a second: no torch
    (about 1 s to import) until a module or name that needs it; the estimators still import."""
    code = (
        "import sys, ebpo_lite, ebpo_lite.__main__\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from ebpo_lite import EBPrior, ebpo_advantages\n"
        "assert ebpo_advantages.__module__ == 'ebpo_lite.algo.advantages' and 'torch' in sys.modules\n"
        "try:\n"
        "    ebpo_lite.no_such_name\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "module 'ebpo_lite' has no attribute 'no_such_name'"


def test_the_layout_page_names_every_module():
    """docs/layout.md (the README's Layout until issue 32) lists every module and subpackage of
    ebpo_lite (a new one is documented)."""
    text = (REPO / "docs" / "layout.md").read_text()
    block = text.split("# Layout", 1)[1].split("```")[1]
    listing = block.split("recipes/", 1)[0]
    named = set(re.findall(r"[A-Za-z_]\w*", listing))
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    missing = sorted((modules | packages) - named)
    assert not missing, f"docs/layout.md does not name: {missing}"
