"""scripts/gpu_smoke.py on a machine without CUDA: it refuses, and its pieces are sound."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ebpo_lite import config

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "scripts" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_smoke)


def test_refuses_without_cuda(capsys):
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        pytest.skip("a GPU is visible")
    assert gpu_smoke.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_smoke: no CUDA device visible")


@pytest.mark.parametrize("variant", gpu_smoke.VARIANTS)
def test_variant_overrides_are_valid_config(variant, tmp_path):
    ov = gpu_smoke.variant_overrides(variant, tmp_path / "run", 3, "bfloat16", "tiny")
    cfg = config.load(gpu_smoke.RECIPE, ov)
    assert cfg.model.device == "cuda" and cfg.model.dtype == "bfloat16"
    assert cfg.train.steps == 3 and cfg.output_dir == str(tmp_path / "run")
    assert cfg.rollout.backend == variant.split("_")[0]
    assert cfg.model.load_in_4bit == variant.endswith("nf4")
    assert cfg.model.trainable_extra == []


def test_missing_requirements_name_the_package(monkeypatch):
    assert gpu_smoke.missing_requirements("hf_16bit") is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert gpu_smoke.missing_requirements("vllm_nf4") == "vllm is not installed"
    assert gpu_smoke.missing_requirements("hf_nf4") == "bitsandbytes is not installed"


def test_read_metrics(tmp_path):
    lines = [
        {"step": 0, "eval/accuracy": 0.1},
        {
            "step": 1,
            "time/rollout_s": 0.5,
            "time/train_s": 0.25,
            "rollout/logp_diff_max": 0.02,
            "train/reward_mean": 0.25,
        },
        {
            "step": 2,
            "time/rollout_s": 0.4,
            "time/train_s": 0.2,
            "rollout/logp_diff_max": 0.01,
            "train/reward_mean": 0.75,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    m = gpu_smoke.read_metrics(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in m["step_times"]] == [1, 2]
    assert m["step_times"][0] == {"step": 1, "rollout_s": 0.5, "train_s": 0.25}
    assert m["logp_diff_max"] == 0.02 and m["logp_diff_max_last"] == 0.01
    assert m["reward_mean"] == 0.5
    assert gpu_smoke.read_metrics(tmp_path / "absent.jsonl")["logp_diff_max"] is None


@pytest.mark.slow
def test_a_variant_trains_through_train_main_on_cpu(tmp_path):
    """The smoke's overrides with the device set to CPU: two real steps, metrics readable."""
    from ebpo_lite import train

    ov = gpu_smoke.variant_overrides("hf_16bit", tmp_path / "run", 2, "float32", "tiny")
    ov = [o.replace("model.device=cuda", "model.device=cpu") for o in ov]
    ov += ["model.sft_warmup_steps=50", "train.prompts_per_step=8", "rollout.group_size=4"]
    assert train.main([str(gpu_smoke.RECIPE), *ov]) == 0
    m = gpu_smoke.read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(m["step_times"]) == 2
    assert m["logp_diff_max"] is None  # the transformers sampler is the trainer: no gap to log
