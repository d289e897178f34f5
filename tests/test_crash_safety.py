"""Crash safety (issue 13, part 1): a tiny run SIGKILLed at random moments, at least 10 times,
some of them inside a checkpoint write, resumed each time, ends exactly where an uninterrupted
run ends: the same adapter, optimizer state and EB prior; `metrics.jsonl` has each step once.

Kills alternate between two kinds: the moment a `.tmp_step_<N>` folder appears (a checkpoint
being written: polled every millisecond, so the kill lands inside the write) and a random delay
after a new step's metrics record. After each kill the harness notes the newest complete
checkpoint and any partial one; the next process must resume from the former and never from
the latter.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from ebpo_lite.engine import checkpoint
from ebpo_lite.engine.metrics import read_metrics
from ebpo_lite.train import train
from tests.conftest import REPO, TINY_RECIPE, fast_overrides

STEPS = 20
KILLS = 12
COMMON = {
    "train.steps": STEPS,
    "train.checkpoint_every": 1,
    "train.keep_checkpoints": 2,
    "algo.prompt_prior": "true",
    "curriculum.sampler": "adaptive",
    "train.mini_batches": 2,
}


def _final_state(out):
    d = out / "checkpoints" / f"step_{STEPS}"
    state = torch.load(d / "trainer_state.pt", weights_only=True)
    return load_file(d / "trainable.safetensors"), state, (d / "prior.json").read_text()


def _launch(out):
    args = fast_overrides(out, **COMMON, **{"train.resume": "true", "log.progress": "lines"})
    return subprocess.Popen(
        [sys.executable, "-m", "ebpo_lite.train", str(TINY_RECIPE), *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _steps_logged(metrics):
    if not metrics.exists():
        return 0
    steps = [int(m) for m in re.findall(r'"step": (\d+), "train/', metrics.read_text())]
    return max(steps, default=0)


def _kill_when(proc, ready, timeout=300.0):
    """SIGKILL `proc` as soon as `ready()` is true (polled every ms); False if it exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if ready():
            proc.kill()
            proc.wait()
            return True
        time.sleep(0.001)
    proc.kill()
    raise AssertionError("the run made no progress")


def _partials(ckpts):
    if not ckpts.is_dir():
        return set()
    found = set()
    for p in ckpts.iterdir():
        if p.name.startswith(".tmp_step_"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            found.add((p.name, st.st_ino, st.st_mtime_ns))
    return found


def _new_partial(ckpts):
    """True once a `.tmp_step_*` folder exists that was not there at launch."""
    stale = _partials(ckpts)
    return lambda: bool(_partials(ckpts) - stale)


def _after_new_step(metrics, start, delay):
    """True `delay` seconds after a step past `start` is logged."""
    seen = [0.0]

    def ready():
        if not seen[0] and _steps_logged(metrics) > start:
            seen[0] = time.monotonic()
        return bool(seen[0]) and time.monotonic() - seen[0] >= delay

    return ready


@pytest.mark.slow
def test_random_sigkills_resume_to_the_uninterrupted_result(tmp_path, capsys):
    ref, out = tmp_path / "ref", tmp_path / "run"
    train_cfg = fast_overrides(ref, **COMMON)
    from ebpo_lite import config

    train(config.load(TINY_RECIPE, train_cfg))
    rng = random.Random(0)
    ckpts, metrics = out / "checkpoints", out / "metrics.jsonl"
    kills = partial_seen = partial_refused = resumes = 0
    expected_resume = None  # newest complete checkpoint at the last kill
    partial_steps: list[int] = []
    while True:
        proc = _launch(out)
        if kills >= KILLS:
            log, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, log
        else:
            start = _steps_logged(metrics)
            if kills % 2 == 0:  # inside a checkpoint write (a new one, not a stale partial)
                ready = _new_partial(ckpts)
            else:  # a random moment after a new step
                ready = _after_new_step(metrics, start, rng.uniform(0.0, 0.4))
            killed = _kill_when(proc, ready)
            log = proc.stdout.read()
            if not killed:  # it finished first: the run is complete
                assert proc.returncode == 0, log
        if kills and expected_resume is None:  # killed before the first checkpoint
            assert "no checkpoint in" in log, log[-2000:]
            partial_refused += len(partial_steps)  # started fresh, ignoring them
        elif kills:
            resumes += 1
            assert f"resumed from {expected_resume} " in log, (expected_resume, log[-2000:])
            resumed = int(re.search(r"resumed from \S+step_(\d+) ", log).group(1))
            partial_refused += sum(1 for s in partial_steps if s > resumed)
        if kills >= KILLS or not killed:
            break
        kills += 1
        newest = checkpoint.latest(out)
        partial = [p for p in ckpts.iterdir() if p.name.startswith(".tmp_step_")]
        partial_seen += len(partial)
        partial_steps = [int(p.name.rsplit("_", 1)[1]) for p in partial]
        expected_resume = newest
        assert newest is None or all(s > int(newest.name.split("_")[1]) for s in partial_steps)
    with capsys.disabled():  # the counts show in CI's log, not only on failure
        print(
            f"\ncrash harness: {kills} SIGKILLs, {resumes} resumes, "
            f"{partial_seen} partial checkpoints seen, {partial_refused} refused"
        )
    assert kills >= 10 and resumes >= 9  # the first kill may come before any checkpoint
    assert partial_seen >= 3 and partial_refused == partial_seen
    wa, sa, pa = _final_state(ref)
    wb, sb, pb = _final_state(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert pa == pb
    for i, st in sa["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["optimizer"]["state"][i][k]), (i, k)
    steps = [r["step"] for r in read_metrics(metrics) if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1))
    ra = [r["train/reward_mean"] for r in read_metrics(ref / "metrics.jsonl") if "train/loss" in r]
    rb = [r["train/reward_mean"] for r in read_metrics(metrics) if "train/loss" in r]
    assert ra == rb
