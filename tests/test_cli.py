"""The `ebpo-lite` command: dispatch to each module's `main(argv)`, recipes by name or path, the
`recipes` listing against the files, the generated `train --help`, and the built wheel (recipes,
notebooks and the console script inside, run from outside the repository)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import ebpo_lite
from ebpo_lite import catalog, config
from ebpo_lite import train as train_module
from ebpo_lite.__main__ import COMMANDS, LABELS, main
from ebpo_lite.commands import confighelp
from ebpo_lite.errors import ConfigError
from ebpo_lite.model import plan
from tests.conftest import REPO

RECIPE_FILES = sorted((REPO / "recipes").glob("*.yaml"))
BEING_WRITTEN = {
    "ebpo_lite.commands.plot",
    "ebpo_lite.commands.export",
}  # issue 15: another branch adds them


# ----------------------------------------------------------------------------- dispatch


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, desc) in COMMANDS.items():
        assert f"  {name}" in out and desc in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ebpo-lite {ebpo_lite.__version__}"


def test_version_matches_pyproject():
    text = (REPO / "pyproject.toml").read_text()  # (tomllib is 3.11+; the package supports 3.10)
    assert re.search(r'^version = "(.+)"$', text, re.M).group(1) == ebpo_lite.__version__
    assert '\n[project.scripts]\nebpo-lite = "ebpo_lite.__main__:main"\n' in text


def test_every_command_module_has_a_main():
    modules = [m for m, _ in COMMANDS.values() if m] + [m for m, _ in LABELS.values()]
    for module in modules:
        if importlib.util.find_spec(module) is None:
            assert module in BEING_WRITTEN, f"{module}: no such module"
            continue
        assert callable(importlib.import_module(module).main), module


@pytest.mark.parametrize(
    "argv, module",
    [
        (["eval", "--help"], "ebpo_lite.eval"),
        (["plan", "--help"], "ebpo_lite.model.plan"),
        (["label", "difficulty", "--help"], "ebpo_lite.commands.difficulty"),
        (["label", "topics", "--help"], "ebpo_lite.data.topics"),
    ],
)
def test_commands_reach_their_module_and_say_how_they_were_started(argv, module, capsys):
    """Through the front door the usage line names `ebpo-lite ...`; run as a module, `python -m`."""
    from ebpo_lite import cli

    with pytest.raises(SystemExit) as e:  # argparse's --help exits 0
        main(argv)
    assert e.value.code == 0
    front = capsys.readouterr().out
    assert front.startswith(f"usage: ebpo-lite {' '.join(argv[:-1])} ")
    assert cli.prog("x") == "x"  # the front door's name does not outlive the command
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    direct = capsys.readouterr().out
    assert direct.startswith(f"usage: python -m {module} ")
    # the same parser behind both names: the same text after the usage block
    assert front.split("\n\n", 1)[1] == direct.split("\n\n", 1)[1]


def test_plan_runs_through_the_front_door_with_a_recipe_name(capsys):
    assert main(["plan", "qwen3_8b_lora", "--gpu", "24"]) == 0
    direct = capsys.readouterr().out
    assert plan.main([str(REPO / "recipes/qwen3_8b_lora.yaml"), "--gpu", "24"]) == 0
    assert capsys.readouterr().out == direct and "fits" in direct


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trian"], "error: 'trian' is not an ebpo-lite command; did you mean train?"),
        (
            ["label", "topic"],
            "error: 'topic' is not a kind of ebpo-lite label; did you mean topics?",
        ),
        (["recipes", "extra"], "error: ebpo-lite recipes takes no arguments"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_command_whose_module_cannot_load_says_why(tmp_path, monkeypatch, capsys):
    (tmp_path / "needs_missing.py").write_text("import no_such_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(COMMANDS, "ghost", ("ebpo_lite.ghost", "not installed"))
    monkeypatch.setitem(COMMANDS, "needy", ("needs_missing", "a missing dependency"))
    assert main(["ghost"]) == 2
    assert capsys.readouterr().err == (
        "error: ebpo-lite ghost: ebpo_lite.ghost is not part of this installation of ebpo_lite\n"
    )
    assert main(["needy", "x"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: ebpo-lite needy: needs the Python package 'no_such_package_xyz', "
        "which is not installed\n"
    )


def test_unknown_recipe_name_is_one_line_and_exit_2(capsys):
    assert train_module.main(["tiny_cpux"]) == 2
    r = subprocess.run(
        [sys.executable, "-m", "ebpo_lite", "train", "tiny_cpux"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    for rc, out, err in ((2, "", capsys.readouterr().err), (r.returncode, r.stdout, r.stderr)):
        assert rc == 2 and out == "", err
        assert err.startswith("error: tiny_cpux: no such recipe file or packaged recipe; ")
        assert "did you mean tiny_cpu?" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- recipes


def test_the_packaged_recipes_are_the_repository_recipes():
    assert catalog.recipes_dir().resolve() == (REPO / "recipes").resolve()
    assert catalog.notebooks_dir().resolve() == (REPO / "notebooks").resolve()
    assert catalog.recipe_names() == [p.stem for p in RECIPE_FILES]
    assert catalog.notebooks() and all(p.suffix == ".ipynb" for p in catalog.notebooks())


def test_recipe_by_name_or_path_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ here
    packaged = catalog.recipes_dir() / "tiny_cpu.yaml"
    for arg in ("tiny_cpu", "tiny_cpu.yaml", "recipes/tiny_cpu.yaml"):
        assert catalog.recipe_path(arg) == packaged, arg
    assert config.load("tiny_cpu") == config.load(REPO / "recipes/tiny_cpu.yaml")
    # a path that exists always wins over the packaged recipe of that name
    (tmp_path / "tiny_cpu.yaml").write_text("train:\n  steps: 7\n")
    assert config.load("tiny_cpu.yaml").train.steps == 7
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes/tiny_cpu.yaml").write_text("train:\n  steps: 9\n")
    assert config.load("recipes/tiny_cpu.yaml").train.steps == 9
    assert config.load("tiny_cpu").train.steps == 300  # a bare name: no such file here


def test_unknown_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        config.load("qwen3_8b_lor")
    msg = str(e.value)
    assert msg.startswith("qwen3_8b_lor: no such recipe file or packaged recipe; did you mean ")
    assert all(p.stem in msg for p in RECIPE_FILES) and "\n" not in msg
    with pytest.raises(
        ConfigError, match="zzz: no such recipe file or packaged recipe \\(packaged"
    ):
        config.load("zzz")
    for missing in ("recipes/nope.yaml", "nope.yaml", "elsewhere/tiny_cpu.yaml"):
        with pytest.raises(ConfigError, match=f"^{missing}: recipe file not found"):
            config.load(missing)


def _header(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [
        ln[1:].strip() for ln in lines[: next(i for i, ln in enumerate(lines) if ln[:1] != "#")]
    ]


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_every_recipe_header_names_its_gpu_and_memory(path):
    header = _header(path)
    assert any(h.startswith("GPU: ") for h in header), f"{path.name}: no '# GPU:' line"
    planned = [h for h in header if h.startswith("Memory (ebpo-lite plan ")]
    noted = [h for h in header if h.startswith("Memory: ")]
    assert len(planned) + len(noted) == 1, f"{path.name}: needs one '# Memory' line"


def test_recipes_listing_matches_the_files(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[1 : 1 + len(RECIPE_FILES)]}
    assert sorted(rows) == [p.stem for p in RECIPE_FILES]
    for path in RECIPE_FILES:
        row, raw, header = rows[path.stem], yaml.safe_load(path.read_text()), _header(path)
        model = raw["model"]["name"]
        assert (model if model != "tiny" else "tiny (built in)") in row
        assert (", NF4" in row) == bool(raw["model"].get("load_in_4bit")), row
        gpu = next(h[5:] for h in header if h.startswith("GPU: "))
        assert gpu.split(" (")[0].split("; ")[0].split(". ")[0] in row, (gpu, row)
        info = catalog.recipe_info(path)
        if info.plan_gpu:
            name, gib = plan.parse_gpu(info.plan_gpu)
            peak = max(plan.plan(config.load(path), gib, name)["per_device_gb"].values())
            assert f"{peak:.1f}" in row and f"GiB of {gib:g}" in row, row
        else:
            memory = next(h[8:] for h in header if h.startswith("Memory: "))  # "0.59 GiB RAM (...)"
            assert memory.split(" (")[0] in row and "GiB" in row, (memory, row)
    assert f"notebooks: {catalog.notebooks_dir()}" in out


# ----------------------------------------------------------------------------- train --help


def _yaml_text(value) -> str:
    """A default as a recipe writes it (the test's own rendering, not confighelp's)."""
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_text(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _all_fields():
    for f in dataclasses.fields(config.Config):
        if dataclasses.is_dataclass(f.default_factory):
            for g in dataclasses.fields(f.default_factory):
                yield f"{f.name}.{g.name}", g
        else:
            yield f.name, f


def _help_lines(text: str) -> dict[str, str]:
    keyed = [ln for ln in text.splitlines() if ln.startswith("  ") and ln.split()[0] != "#"]
    return {ln.split()[0]: ln for ln in keyed if " = " in ln}


def test_train_help_lists_every_key_with_type_and_default(capsys):
    assert train_module.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert main(["train", "--help"]) == 0 and capsys.readouterr().out == text
    assert train_module.main(["tiny_cpu", "train.steps=3", "-h"]) == 0  # anywhere in the line
    assert capsys.readouterr().out == text
    lines = _help_lines(text)
    keys = list(_all_fields())
    assert len(keys) > 100 and len(lines) == len(keys)
    for key, f in keys:
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert key in lines, f"{key} missing from train --help"
        assert f" {f.type} " in lines[key] and f"= {_yaml_text(default)}" in lines[key], lines[key]


def test_train_help_carries_the_source_comments_grouped_by_section(capsys):
    train_module.main(["--help"])
    text = capsys.readouterr().out
    lines = _help_lines(text)
    assert lines["model.load_in_4bit"].endswith("# NF4 base via bitsandbytes (QLoRA)")
    assert lines["algo.kl_coef"].endswith("# k3 KL to the adapter-disabled base")
    assert lines["train.threads"].endswith("# torch threads on CPU; 0: leave torch's default")
    assert lines["rollout.enforce_eager"].endswith("= true")  # no comment, none invented
    rows = text.splitlines()
    at = rows.index(lines["reward.timeout_s"])
    assert rows[at - 3].strip().startswith("# seconds: the limit per answer")  # standing above
    assert "  # loss" in rows[rows.index(lines["algo.clip_eps_low"]) - 1]
    order = [rows.index(f"{s.name}:") for s in dataclasses.fields(config.Config)[1:]]
    assert order == sorted(order)  # sections in the order of Config
    for s in dataclasses.fields(config.Config)[1:]:
        first = rows.index(f"{s.name}:") + 1
        assert rows[first].strip().startswith((f"{s.name}.", "#")), rows[first]


@dataclass(frozen=True)
class _Probe:
    alpha: int = 3  # the alpha note
    # standing alone
    # on two lines
    beta: list[str] = field(default_factory=lambda: ["x", "y"])  # after a field that spans lines
    gamma: str | None = None


def test_field_docs_parses_comments_from_source():
    assert confighelp.field_docs(_Probe, section="p.") == [
        confighelp.FieldDoc("p.alpha", "int", "3", "the alpha note", ()),
        confighelp.FieldDoc(
            "p.beta", "list[str]", "[x, y]", "after a field that spans lines",
            ("standing alone", "on two lines"),
        ),
        confighelp.FieldDoc("p.gamma", "str | None", "null", "", ()),
    ]  # fmt: skip


def test_train_without_a_recipe_prints_usage_and_fails(capsys):
    assert train_module.main([]) == 2
    assert "usage: python -m ebpo_lite.train RECIPE" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the wheel


def _copy_project(dst: Path) -> Path:
    """What a wheel is built from, without the repository's caches and build leftovers."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    for name in ("ebpo_lite", "recipes", "notebooks"):
        shutil.copytree(REPO / name, dst / name, symlinks=True, ignore=skip)
    return dst


def test_wheel_ships_recipes_notebooks_and_the_console_script(tmp_path):
    (tmp_path / "src").mkdir()
    src = _copy_project(tmp_path / "src")
    out = tmp_path / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(out), str(src)], check=True, capture_output=True)
    (wheel,) = out.glob("ebpo_lite-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        shipped = {f"ebpo_lite/recipes/{p.name}": p for p in (REPO / "recipes").iterdir()}
        shipped |= {f"ebpo_lite/notebooks/{p.name}": p for p in catalog.notebooks()}
        shipped |= {
            f"ebpo_lite/{p.relative_to(REPO / 'ebpo_lite')}": p
            for p in (REPO / "ebpo_lite").rglob("*.py")
            if "__pycache__" not in p.parts
        }
        for arcname, path in shipped.items():
            assert arcname in names, f"{arcname} not in the wheel"
            assert z.read(arcname) == path.read_bytes(), arcname
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(entry_points).decode()
    assert "[console_scripts]\nebpo-lite = ebpo_lite.__main__:main" in text

    # installed (not the checkout) and run from a folder with no recipes/: names resolve
    site, away = tmp_path / "site", tmp_path / "away"
    away.mkdir()
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run(
        [str(site / "bin" / "ebpo-lite"), "recipes"],
        cwd=away,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert f"{site / 'ebpo_lite' / 'recipes'}/NAME.yaml" in r.stdout
    assert all(p.stem in r.stdout for p in RECIPE_FILES)
    r = subprocess.run(
        [sys.executable, "-m", "ebpo_lite.model.plan", "recipes/qwen3_8b_lora.yaml", "--gpu", "24"],
        cwd=away, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0 and "fits" in r.stdout, r.stderr
