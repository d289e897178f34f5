"""Every recipe loads and validates, names its own command, and its data resolves to a preset."""

from __future__ import annotations

import pytest

from ebpo_lite import config, presets
from ebpo_lite.data import mathdata
from tests.conftest import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"tiny_cpu.yaml", "gsm8k_qwen3_0.6b.yaml", "math_qwen3_1.7b.yaml"} <= names
    assert "math_qwen3_4b.yaml" in names


def _preset(d: config.DataConfig) -> str | None:
    """The schema preset `mathdata` would use, decided from the config alone (no data read)."""
    if d.name in ("arithmetic", "arithmetic_chat") and d.path is None:
        return "arithmetic"  # the built-in generator (raw text, or asked through the template)
    if d.preset != "auto":
        return d.preset if d.preset in presets.PRESETS else None
    if d.prompt_field or d.answer_field:
        return "generic"
    return d.name if d.name in presets.PRESETS else mathdata.guess_preset(d.path or d.name)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_validates_and_resolves(path):
    cfg = config.load(path)
    text = path.read_text()
    assert f"python -m ebpo_lite.train recipes/{path.name}" in text  # documented command
    assert text.lstrip().startswith(f"# {path.stem}:")  # header names the recipe
    assert _preset(cfg.data) is not None, f"{path.name}: data.name {cfg.data.name!r} has no preset"
    known = {"arithmetic", *presets.BENCHMARKS}
    assert set(cfg.eval.benchmarks) <= known, cfg.eval.benchmarks
    if cfg.curriculum.sampler == "topic" and cfg.data.labels_path is None:
        # topics must come from the preset's field: math / math500 / olympiadbench / arithmetic
        assert _preset(cfg.data) in ("math", "math500", "olympiadbench", "arithmetic"), path.name
