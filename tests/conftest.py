"""Shared fixtures: a small, fast variant of the tiny CPU recipe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "tiny_cpu.yaml"
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _cache_and_threads(tmp_path_factory):
    """One tiny-model warm-up cache per session (CI points it at a folder shared by tiers)."""
    if not os.environ.get("EBPO_LITE_CACHE"):
        os.environ["EBPO_LITE_CACHE"] = str(tmp_path_factory.mktemp("ebpo_cache"))
    torch.set_num_threads(1)


def fast_overrides(out: Path, **extra) -> list[str]:
    """The tiny recipe shrunk to seconds: short warm-up, few prompts, small groups."""
    base = {
        "output_dir": str(out),
        "model.sft_warmup_steps": 100,
        "data.num_train": 400,
        "data.num_eval": 16,
        "eval.num_examples": 16,
        "eval.every": 0,
        "rollout.group_size": 4,
        "train.prompts_per_step": 8,
        "train.steps": 3,
        "train.checkpoint_every": 0,
        "log.progress": "none",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]
