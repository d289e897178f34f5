"""The same recipe and seed on the same machine and thread count give the same run, bit for bit,
from two separate processes: every logged number but the timings. (With train.threads=2 the
shared-prompt backward used to add rows from both threads concurrently and two such runs parted
at round-off within a few steps; see tests/test_policy.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_RECIPE, fast_overrides


def _run(out) -> list[dict]:
    args = fast_overrides(
        out,
        **{"train.steps": 10, "train.threads": 2, "train.share_prompts": "true"},
        **{"train.prompts_per_step": 32, "rollout.group_size": 8},  # the recipe's 256 rows
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ebpo_lite.train", str(TINY_RECIPE), *args],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


@pytest.mark.slow
def test_two_processes_with_the_same_seed_log_the_same_numbers(tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores for train.threads=2")
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    assert len(a) == len(b) >= 10
    steps = [r for r in a if "train/entropy" in r]
    assert len(steps) == 10 and len({r["train/grad_norm"] for r in steps}) > 1  # it trained
    for ra, rb in zip(a, b):
        assert ra == rb, {k: (ra.get(k), rb.get(k)) for k in ra if ra.get(k) != rb.get(k)}
