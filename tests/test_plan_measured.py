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
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark imports its siblings _machine, _memory
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
        ("ebpo_lite.model.memory", "nf4_bytes"),
        ("ebpo_lite.model.plan", "base_weight_bytes"),
        ("ebpo_lite.model.plan", "lora_param_count"),
        ("ebpo_lite.model.memory", "layer_bytes_per_token"),
        ("ebpo_lite.model.memory", "logits_bytes"),
    ],
)
def test_a_planner_term_off_by_2x_is_caught(measured, monkeypatch, module, name):
    folder, m = measured
    mod = importlib.import_module(module)
    original = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **k: 2 * original(*a, **k))
    rows = pvm.compare(m, pvm.planned(SHAPE, folder))
    assert not pvm.within_tolerance(rows)


def test_cpu_completion_logits_never_copy_the_lm_head_weight():
    """N = 4 sequences at V = 32,000, h = 256: a copy of the lm_head weight per sequence would
    be 4 x 16 MiB (measured 63 MiB with the integer `logits_to_keep`); the logits themselves
    are 4 x 17 x V x 2 B = 4.2 MiB."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ebpo_lite.model.policy import completion_logits, make_batch

    spec = dict(vocab_size=32_000, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**spec, attn_implementation="sdpa")).to(torch.bfloat16)
    # LoRA, as in training (the bare model's last hidden states happen to be laid out
    # position-major, where the slice is one contiguous block; peft's are not)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, 32_000, (n,), generator=gen).tolist() for n in (8, 6, 16, 12)]
    batch = make_batch([ids[0], ids[1], ids[0], ids[1]], [ids[2], ids[3], ids[3], ids[2]], 0)
    with torch.no_grad():
        logits, _, peak = pvm.allocator_bytes(lambda: completion_logits(model, batch))
        sliced = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=17,
        ).logits  # [4, 17, V]: the integer form
    assert logits.shape == (4, 17, 32_000)
    torch.testing.assert_close(logits, sliced, rtol=0, atol=0.05)
    assert peak < 12 * 2**20, peak / 2**20  # one weight copy per sequence: > 64 MiB
