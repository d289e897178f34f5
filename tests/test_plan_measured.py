"""The memory planner against torch's allocator on one very small shape (issue 14, part 3).

Runs benchmarks/plan_vs_measured.py's measurement (allocator events of the real loading, LoRA,
RL loss micro-batch and AdamW step; see its docstring) on a 4-layer Qwen3 and checks every
planned component within the benchmark's 20 %. The shape is chosen so that each planner term is
a large enough share of the component it feeds that doubling it leaves the 20 % band: the NF4
linear layers are 45 % of the NF4 base (vocabulary 2,048), the logits the larger term of the
checkpointed micro-batch, the layer activations most of the unchekpointed one.
`test_a_planner_term_off_by_2x_is_caught` doubles each term in turn and checks that it would fail.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark imports its sibling _machine
_spec = importlib.util.spec_from_file_location("pvm", REPO / "benchmarks" / "plan_vs_measured.py")
pvm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pvm)

SHAPE = dict(
    layers=4, hidden=256, inter=768, heads=4, kv_heads=2, head_dim=64, vocab=2048, n=2, p=32, c=96
)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = pvm.build_model_dir(SHAPE, tmp_path_factory.mktemp("plan_measured") / "m")
    return folder, pvm.measure_shape(SHAPE, folder)


def test_every_planned_component_within_20_percent_of_the_allocator(measured):
    folder, m = measured
    rows = pvm.compare(m, pvm.planned(SHAPE, folder))
    assert set(rows) == set(pvm.LABELS)
    bad = {k: round(r["ratio"], 3) for k, r in rows.items() if abs(r["ratio"] - 1) > 0.2}
    assert not bad, bad
    assert pvm.within_tolerance(rows)


@pytest.mark.parametrize(
    "module,name",
    [
        ("ebpo_lite.memory", "nf4_bytes"),
        ("ebpo_lite.plan", "base_weight_bytes"),
        ("ebpo_lite.plan", "lora_param_count"),
        ("ebpo_lite.memory", "layer_bytes_per_token"),
        ("ebpo_lite.memory", "logits_bytes"),
    ],
)
def test_a_planner_term_off_by_2x_is_caught(measured, monkeypatch, module, name):
    folder, m = measured
    mod = importlib.import_module(module)
    original = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **k: 2 * original(*a, **k))
    rows = pvm.compare(m, pvm.planned(SHAPE, folder))
    assert not pvm.within_tolerance(rows)
