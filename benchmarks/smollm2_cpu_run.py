"""Run recipes/smollm2_cpu.yaml with EBPO and with GRPO from the same start, and record what each
learned (issue 31): held-out greedy accuracy and boxed-answer rate before -> after, wall time
and peak RSS per run.

    python benchmarks/smollm2_cpu_run.py [--steps 80] [--parallel] [--seed 0]

Both runs load the same converted SmolLM2 folder, the same LoRA initialisation and the same
prompt stream (`train.seed`); only `algo.estimator` differs. `--parallel` runs the two side by
side with `train.threads=1` each (2 cores); otherwise one after the other with the recipe's 2
threads. The conversion from the GGUF happens once, before either run (`base_model.resolve`).
Writes benchmarks/results/smollm2_cpu_run.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import command, machine

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/smollm2_cpu.yaml"
KEYS = ("accuracy", "extraction/boxed", "extraction/math_verify", "extraction/none")


def start(estimator: str, out: Path, extra: list[str]) -> tuple[subprocess.Popen, float, list]:
    argv = [sys.executable, "-m", "ebpo_lite.train", RECIPE, f"algo.estimator={estimator}"]
    argv += [f"output_dir={out}", "log.progress=lines", *extra]
    log = (out.parent / f"{estimator}.log").open("w")
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return proc, time.perf_counter(), argv


def finish(estimator: str, proc, t0: float, argv: list, out: Path) -> dict:
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    text = (out.parent / f"{estimator}.log").read_text()
    if status != 0:
        sys.exit(f"{estimator} failed:\n{text[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {
        "estimator": estimator,
        "runs": " ".join(["python", *argv[1:]]).replace(str(out), "runs/smollm2_cpu"),
        "wall_s": round(wall, 1),
        "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),  # ru_maxrss: KiB on Linux
        "before": {k: s.get(f"before/{k}") for k in KEYS},
        "after": {k: s.get(f"after/{k}") for k in KEYS},
        "greedy_gain": round(s["after/accuracy"] - s["before/accuracy"], 4),
        "summary": {k: v for k, v in s.items() if k not in ("output_dir", "checkpoint")},
        "last_lines": text.strip().splitlines()[-8:],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: the recipe's)")
    p.add_argument("--parallel", action="store_true", help="both runs at once, 1 thread each")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    extra = [f"train.seed={args.seed}"]
    extra += [f"train.steps={args.steps}", f"eval.every={args.steps}"] if args.steps else []
    extra += ["train.threads=1"] if args.parallel else []
    sys.path.insert(0, str(REPO))
    from ebpo_lite import config
    from ebpo_lite.model import base_model

    t0 = time.perf_counter()
    base_model.resolve(config.load(REPO / RECIPE))  # the one-off conversion, outside the timings
    convert_s = time.perf_counter() - t0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        outs = {e: Path(tmp) / e / "run" for e in ("ebpo", "grpo")}
        for out in outs.values():
            out.parent.mkdir(parents=True)
        if args.parallel:
            started = {e: start(e, outs[e], extra) for e in outs}
            runs = [finish(e, *started[e], outs[e]) for e in outs]
        else:
            runs = [finish(e, *start(e, outs[e], extra), outs[e]) for e in outs]
    result = {
        "command": command(),
        "recipe": RECIPE,
        "overrides": extra,
        "parallel": args.parallel,
        "convert_s": round(convert_s, 1),
        "runs": runs,
        "machine": machine(),
    }
    dest = REPO / "benchmarks" / "results" / "smollm2_cpu_run.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        b, a = r["before"], r["after"]
        print(
            f"{r['estimator']}: greedy {b['accuracy']:.3f} -> {a['accuracy']:.3f}, boxed "
            f"{b['extraction/boxed']} -> {a['extraction/boxed']}, {r['wall_s']:.0f} s, "
            f"{r['peak_rss_gb']} GiB"
        )
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
