"""Time per call of each advantage estimator at B = 512 prompts, G = 8 completions, on CPU.

Usage: .venv/bin/python benchmarks/estimator_overhead.py [--reps 300] [--out PATH]
Writes benchmarks/results/estimator_overhead.json: median and p90 microseconds per call (one
thread, float32 0/1 rewards, a fresh batch each call), with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _machine import command, machine

from ebpo_lite.algo.advantages import EBPrior, compute_advantages

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["algebra", "calculus", "geometry", "discrete", "probability", "linalg", "applied",
          "physics", "advanced"]  # fmt: skip


def cases(B: int) -> dict:
    keys = [TOPICS[i % len(TOPICS)] for i in range(B)]
    return {
        "grpo (scale=group)": dict(name="grpo"),
        "grpo (scale=batch)": dict(name="grpo", grpo_scale="batch"),
        "dr_grpo": dict(name="dr_grpo"),
        "rloo": dict(name="rloo"),
        "ebpo (paper)": dict(name="ebpo", prior=EBPrior()),
        "ebpo (paper, with mask)": dict(name="ebpo", prior=EBPrior(), use_mask=True),
        "ebpo (moments, within, decay 0.99)": dict(
            name="ebpo", prior=EBPrior(tau2="moments", sigma2="within", decay=0.99)
        ),
        "ebpo (paper, 9 topic keys)": dict(name="ebpo", prior=EBPrior(), keys=keys),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=512)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/estimator_overhead.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    n = args.reps + args.warmup
    batches = [torch.bernoulli(torch.full((args.B, args.G), 0.4), generator=gen) for _ in range(n)]
    masks = [torch.rand(args.B, args.G, generator=gen) > 0.02 for _ in range(n)]
    specs = {}
    for label, spec in cases(args.B).items():
        spec = dict(spec)
        specs[label] = (spec.pop("use_mask", False), spec)
    times: dict[str, list[float]] = {label: [] for label in specs}
    for i, R in enumerate(batches):  # round robin: every estimator sees the same machine load
        for label, (use_mask, spec) in specs.items():
            t0 = time.perf_counter()
            compute_advantages(rewards=R, mask=masks[i] if use_mask else None, **spec)
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[label].append(dt * 1e6)
    results = {}
    for label, ts in times.items():
        ts.sort()
        results[label] = {
            "median_us": round(statistics.median(ts), 1),
            "p90_us": round(ts[int(0.9 * (len(ts) - 1))], 1),
            "min_us": round(ts[0], 1),
        }
        print(f"{label:38s} median {results[label]['median_us']:8.1f} us   "
              f"p90 {results[label]['p90_us']:8.1f} us")  # fmt: skip
    out = {
        "command": command(),
        "machine": machine(),
        "params": {
            "B": args.B,
            "G": args.G,
            "reps": args.reps,
            "warmup": args.warmup,
            "dtype": "float32",
            "rewards": "Bernoulli(0.4)",
        },  # fmt: skip
        "note": "Wall time per call on a 2-core machine shared with other jobs; one torch thread.",
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
