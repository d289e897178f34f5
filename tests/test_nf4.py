"""Gradients through the NF4 (bitsandbytes 4-bit) base are right, on CPU (issue 14, part 1).

The check itself is `ebpo_lite.commands.qlora_check` (its docstring gives the reference, the shapes and
the bounds); scripts/gpu_smoke.py runs the same check on CUDA. Here it runs on CPU, where the
trap it was written for lives: bitsandbytes 0.50.2 on AVX512-BF16 CPUs repacks a `Linear4bit`
at its first eval-mode no-grad forward, after which the layer passes no gradient to its input
(`policy.keep_nf4_differentiable`; docs/qlora.md). The negative controls run the same check with
that fix switched off and see it fail.

Measured on CPU (2-layer random Qwen3, hidden 128): fp32 LoRA gradients bit-identical (bound
1e-5); bf16 worst 0.024 against a noise floor of 0.019 (bf16 vs fp32 of the dequantized policy
alone; bound 3x that);
checkpointing on vs off identical (bound 1e-6); one layer identical at 1, 4, 64 and 2048 rows.
With the repacking on, layer 0's LoRA gradients are off by about 0.9 and a layer's input
gradient is missing.
"""

from __future__ import annotations

import json

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from ebpo_lite.commands import qlora_check  # noqa: E402
from ebpo_lite.model import policy as policy_module  # noqa: E402
from ebpo_lite.model.tiny import save_random_qwen3  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random-init 2-layer Qwen3 (GQA, q/k norms, untied embeddings) and the tiny tokenizer."""
    return save_random_qwen3(tmp_path_factory.mktemp("nf4") / "model")


@pytest.fixture
def repacking_on(monkeypatch):
    """Switch `keep_nf4_differentiable` off: bitsandbytes' CPU repacking happens again."""
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    monkeypatch.setattr(policy_module, "keep_nf4_differentiable", lambda model: 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_gradients_through_nf4_equal_the_dequantized_base(model_dir, dtype):
    r = qlora_check.policy_errors(model_dir, "cpu", dtype)
    print(f"{dtype}: worst {r['worst']:.2e} ({r['worst_tensor']}), floor {r['noise_floor']:.2e}")
    assert r["four_bit_layers"] == 14  # q, k, v, o, gate, up, down in each of the 2 layers
    if dtype == "float32":
        assert r["noise_floor"] == 0 and r["bound"] == qlora_check.TOL_FP32
    else:  # bf16 rounding alone moves these gradients by about 0.02 (module docstring)
        assert 0.005 < r["noise_floor"] < 0.05
        assert r["bound"] == qlora_check.FLOOR_FACTOR * r["noise_floor"]
    assert r["tensors"] == 28 and r["worst"] <= r["bound"], r["worst_tensor"]
    # layer 0's LoRA A gets its gradient through every 4-bit layer above it: nonzero, and right
    assert r["bottom_min_norm"] > 0.1 and r["bottom_worst"] <= r["bound"]
    assert r["checkpointing"]["worst"] <= qlora_check.TOL_CKPT  # on vs off: the same gradients
    # the CPU's kernels are deterministic: the same backward twice is bit-identical, so the
    # checkpointing bound stays at fp32 round-off (it widens only for a non-reproducible device)
    assert r["checkpointing"]["run_to_run"] == 0
    assert r["checkpointing"]["bound"] == qlora_check.TOL_CKPT
    assert r["repacked_for_cpu_gemv"] == 0 and r["ok"]
    if dtype == "float32":  # the sampling path too: same logits, so the same seeded samples
        assert r["same_samples"]


def test_the_check_fails_when_the_base_drops_its_input_gradient(model_dir, repacking_on):
    with pytest.warns(UserWarning, match="gemv_4bit: an autograd kernel was not registered"):
        r = qlora_check.policy_errors(model_dir, "cpu", "bfloat16")
    assert r["repacked_for_cpu_gemv"] == 14 and not r["ok"]
    assert r["bottom_worst"] > 5 * r["bound"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_4bit_layer_matches_its_dequantized_weight_at_every_row_count(dtype):
    """1, 4, 64 and 2048 rows: output without and with grad, d out / d x in train and eval mode,
    all after the eval-mode no-grad forward that would repack the weight."""
    rows = qlora_check.layer_errors("cpu", dtype, in_features=256, out_features=128)
    assert [r["rows"] for r in rows] == [1, 4, 64, 2048]
    for r in rows:
        worst = max(r["output"], r["output_grad"], r["input_grad"])
        assert worst <= qlora_check.TOL_LAYER[dtype], r


def test_one_layer_check_sees_a_missing_input_gradient(repacking_on):
    with pytest.warns(UserWarning, match="gemv_4bit"):
        rows = qlora_check.layer_errors("cpu", "bfloat16", 256, 128, shapes=((2, 32),))
    assert rows[0]["input_grad"] == float("inf")  # no gradient reached the input at all


def test_the_command_writes_its_result_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert qlora_check.main(["--dtypes", "float32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and list(result["dtypes"]) == ["float32"]
    assert result["dtypes"]["float32"]["policy"]["four_bit_layers"] == 14
    assert capsys.readouterr().out.strip().endswith("ok")
    assert qlora_check.main(["--dtypes", "bf16"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --dtypes: expected some of float32, bfloat16, float16, got 'bf16'"
    )
    for bad, says in [
        (["--layers", "0"], "--layers: must be >= 1"),
        (["--hidden", "100"], "--hidden: must be a positive multiple of 32"),
        (["--json", str(tmp_path)], f"--json: {tmp_path} is a folder"),
    ]:
        assert qlora_check.main(bad) == 2, bad  # before any model is built
        assert capsys.readouterr().err.strip().startswith(f"error: {says}")
    if not torch.cuda.is_available():
        assert qlora_check.main(["--device", "cuda"]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err
