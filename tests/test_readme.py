"""The README names only config keys that exist: every `section.key` it mentions is a field."""

from __future__ import annotations

import dataclasses
import re

from ebpo_lite.config import Config
from tests.conftest import REPO

SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "output_dir"]
CODE = re.compile(r"`[^`\n]+`")
# section.key not inside a dotted name or a path (ebpo_lite.train, ebpo_lite/train.py)
KEY = re.compile(r"(?<![\w./-])(" + "|".join(SECTIONS) + r")\.([a-z_0-9]+)")
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "md", "png", "partial"}


def _fields(section: str) -> set[str]:
    cls = type(getattr(Config(), section))
    return {f.name for f in dataclasses.fields(cls)}


def keys_named(text: str) -> list[tuple[str, str]]:
    """(section, key) of every `section.key` inside inline code, file names left out."""
    return [
        (s, k)
        for span in CODE.findall(text)
        for s, k in KEY.findall(span)
        if k not in FILE_SUFFIXES
    ]


def test_readme_config_keys_exist():
    found = keys_named((REPO / "README.md").read_text())
    assert len(found) > 50, "the README names config keys in backticks"
    missing = sorted({f"{s}.{k}" for s, k in found if k not in _fields(s)})
    assert not missing, f"README names config keys that do not exist: {missing}"


def test_the_check_catches_a_wrong_key():
    text = "set `rollout.gpu_mem_util=0.5` and `python -m ebpo_lite.train x.yaml train.lr=1`"
    assert keys_named(text) == [("rollout", "gpu_mem_util"), ("train", "lr")]
    assert "gpu_mem_util" not in _fields("rollout") and "lr" in _fields("train")


def test_the_recipe_tables_memory_is_what_ebpo_lite_recipes_shows():
    """README's recipe table quotes the planner's peak per GPU (and the tiny recipe's measured
    RAM) as `ebpo-lite recipes` computes them from each recipe, so a change to either shows."""
    from ebpo_lite import catalog, config
    from ebpo_lite.__main__ import _memory

    text = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)\.yaml` \|(?:[^|]*\|){2} ([^|]*?) \|", text, re.M)
    assert len(rows) == len(list((REPO / "recipes").glob("*.yaml"))), rows

    def gib(cell: str) -> list[str]:
        return re.findall(r"\d+\.\d+", cell.split("GiB")[0])

    for name, cell in rows:
        path = REPO / "recipes" / f"{name}.yaml"
        listed = _memory(catalog.recipe_info(path), config.load(path))
        assert gib(cell) and gib(cell) == gib(listed), (
            f"{name}: README {cell!r}, listing {listed!r}"
        )
