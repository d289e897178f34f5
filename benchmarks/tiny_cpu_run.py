"""Time the README's main command on this machine and record what it learned.

    python benchmarks/tiny_cpu_run.py [--cold]      # --cold: empty warm-up cache first

Writes benchmarks/results/tiny_cpu_run.json: wall time, peak RSS, the run's summary
(expected and greedy accuracy before -> after), the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import command, machine

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cold", action="store_true", help="start from an empty warm-up cache")
    args = p.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if args.cold:
            env["EBPO_LITE_CACHE"] = str(Path(tmp) / "cache")
        out = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "ebpo_lite.train",
            "recipes/tiny_cpu.yaml",
            f"output_dir={out}",
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(proc.stderr[-2000:])
        summary = json.loads((out / "summary.json").read_text())
    warmup = re.search(r"supervised warm-up \d+ steps in (\d+)s", proc.stdout)
    result = {
        "command": command(),
        "runs": "python -m ebpo_lite.train recipes/tiny_cpu.yaml",
        "cold_cache": args.cold,
        "wall_s": round(wall, 1),
        "warmup_s": int(warmup.group(1)) if warmup else None,  # None: the cache was warm
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
        "summary": {k: v for k, v in summary.items() if k not in ("output_dir", "checkpoint")},
        "last_lines": proc.stdout.strip().splitlines()[-4:],
        "machine": machine(),
    }
    dest = REPO / "benchmarks" / "results" / "tiny_cpu_run.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
