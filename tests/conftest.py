"""Shared fixtures: a small, fast variant of the tiny CPU recipe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "tiny_cpu.yaml"
# The math data sets are not in the repository, and the package guesses no folder for them: it
# reads the one EBPO_LITE_DATA names. Tests (and CI, .ci/run) point it at the copy beside the
# checkout, or beside the folder of worktrees that holds it, unless it is set already. A test that
# needs a file skips, naming the folder, when the file is not there.
_CANDIDATES = (REPO.parent / "shared" / "data", REPO.parents[1] / "shared" / "data")
DATA = Path(
    os.environ.get("EBPO_LITE_DATA") or next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])
)
if DATA.is_dir():
    os.environ.setdefault("EBPO_LITE_DATA", str(DATA))  # subprocesses inherit it too
SHARED_DATA = DATA  # the name the older tests import


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
