"""Time the README's main command on this machine and record what it learned, on 3 seeds.

    python benchmarks/tiny_cpu_run.py [--cold] [--seeds 0,1,2]

The first seed is the main command exactly (`train.seed` 0 is the recipe's); the others add
`train.seed=N` (another LoRA initialisation, prompt stream and sampling). `--cold` empties the
warm-up cache before the first run, so its wall time includes the one-off warm-up.
Writes benchmarks/results/tiny_cpu_run.json: per seed the wall time, the summary (greedy and
exact expected accuracy before -> after, overall and per type) and the last lines printed; the
peak RSS of any run, the command and the machine.
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
MAIN = ["-m", "ebpo_lite.train", "recipes/tiny_cpu.yaml"]


def one_seed(seed: int, out: Path, env: dict) -> dict:
    extra = [f"train.seed={seed}"] if seed else []
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *MAIN, f"output_dir={out}", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(proc.stderr[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    warmup = re.search(r"supervised warm-up \d+ steps in (\d+)s", proc.stdout)
    return {
        "seed": seed,
        "runs": " ".join(["python", *MAIN, *extra]),
        "wall_s": round(wall, 1),
        "warmup_s": int(warmup.group(1)) if warmup else None,  # None: the cache was warm
        "greedy_gain": round(summary["after/accuracy"] - summary["before/accuracy"], 4),
        "expected_gain": round(
            summary["after/expected_accuracy"] - summary["before/expected_accuracy"], 4
        ),
        "summary": {k: v for k, v in summary.items() if k not in ("output_dir", "checkpoint")},
        "last_lines": proc.stdout.strip().splitlines()[-6:],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cold", action="store_true", help="start from an empty warm-up cache")
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if args.cold:
            env["EBPO_LITE_CACHE"] = str(Path(tmp) / "cache")
        seeds = [one_seed(int(s), Path(tmp) / f"run{s}", env) for s in args.seeds.split(",")]
    result = {
        "command": command(),
        "cold_cache": args.cold,
        "seeds": seeds,
        "min_greedy_gain": min(s["greedy_gain"] for s in seeds),
        "min_expected_gain": min(s["expected_gain"] for s in seeds),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
        "machine": machine(),
    }
    dest = REPO / "benchmarks" / "results" / "tiny_cpu_run.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
