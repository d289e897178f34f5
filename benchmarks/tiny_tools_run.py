"""The built-in tool task (recipes/tiny_tools_cpu.yaml): what RL with a calculator tool learns,
EBPO and GRPO from the same start, on 3 seeds.

    python benchmarks/tiny_tools_run.py [--seeds 0,1,2] [--estimators ebpo,grpo]

Each run is the recipe's command with `train.seed=N algo.estimator=E` (the recipe's own is seed
0, ebpo). All runs share the one warm-up (cached; the first run pays it, its seconds are
recorded apart), so all start from the same model: the held-out "before" numbers are the same.
Per run: wall time, RL seconds (`summary.json` `seconds`: the steps and evals, not the
warm-up), held-out greedy accuracy before -> after (overall and per difficulty), tool calls per
episode and the share of episodes that call, before -> after. Writes
benchmarks/results/tiny_tools_run.json and .md (a table), each with the command and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _machine import command, machine

REPO = Path(__file__).resolve().parents[1]
MAIN = ["-m", "ebpo_lite.train", "recipes/tiny_tools_cpu.yaml"]
RESULTS = REPO / "benchmarks" / "results"


def one_run(seed: int, estimator: str, out: Path, env: dict) -> dict:
    extra = [f"train.seed={seed}", f"algo.estimator={estimator}"]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *MAIN, f"output_dir={out}", "train.overwrite=true", *extra],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    s = json.loads((out / "summary.json").read_text())
    warmup = re.search(r"supervised warm-up \d+ steps in (\d+)s", proc.stdout)

    def pair(key: str) -> list[float]:
        return [round(s[f"before/{key}"], 4), round(s[f"after/{key}"], 4)]

    levels = sorted(k.split("=")[1] for k in s if k.startswith("after/accuracy/difficulty="))
    return {
        "seed": seed,
        "estimator": estimator,
        "runs": " ".join(["python", *MAIN, *extra]),
        "wall_s": round(wall, 1),
        "rl_s": s["seconds"],
        "warmup_s": int(warmup.group(1)) if warmup else None,  # None: the cache was warm
        "greedy_accuracy": pair("accuracy"),
        "greedy_gain": round(s["after/accuracy"] - s["before/accuracy"], 4),
        "by_difficulty": {lv: pair(f"accuracy/difficulty={lv}") for lv in levels},
        "tool_calls_per_episode": pair("env/tool_calls"),
        "called_frac": pair("env/called_frac"),
        "turns": pair("env/turns"),
        **curve(out / "metrics.jsonl"),
        "last_lines": proc.stdout.strip().splitlines()[-5:],
    }


def curve(metrics: Path) -> dict:
    """How fast the run got there: its training reward (the mean over the step's samples)
    over the first 10 and 25 steps and all steps, and the first step at which 95% of the
    step's episodes called the tool. The held-out eval (every 50 steps) is at its ceiling by
    its first point, so these are what can tell the estimators apart."""
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    steps = [r for r in steps if "train/loss" in r]
    reward = [r["train/reward_mean"] for r in steps]
    called = next((r["step"] for r in steps if r["env/called_frac"] >= 0.95), None)
    return {
        "train_reward_mean_first_10": round(statistics.mean(reward[:10]), 4),
        "train_reward_mean_first_25": round(statistics.mean(reward[:25]), 4),
        "train_reward_mean_all": round(statistics.mean(reward), 4),
        "first_step_95pct_calling": called,
    }


def table(result: dict) -> str:
    lines = [
        "# The built-in tool task: recipes/tiny_tools_cpu.yaml",
        "",
        f"Command: `{result['command']}`; machine: {result['machine'].get('cpu', '?')}, "
        f"{result['machine'].get('cores', '?')} cores. One warm-up for all runs ("
        + (f"{result['warmup_s']} s, " if result["warmup_s"] else "cached before this run, ")
        + "not in the RL seconds, which are the steps and evals).",
        "",
        "| estimator | seed | greedy acc before -> after | gain | tool calls / episode | "
        "episodes calling | train reward, steps 1-25 | 95% calling at step | RL s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        a, c, f = r["greedy_accuracy"], r["tool_calls_per_episode"], r["called_frac"]
        lines.append(
            f"| {r['estimator']} | {r['seed']} | {a[0]:.3f} -> {a[1]:.3f} | {r['greedy_gain']:+.3f}"
            f" | {c[0]:.2f} -> {c[1]:.2f} | {f[0]:.2f} -> {f[1]:.2f}"
            f" | {r['train_reward_mean_first_25']:.3f} | {r['first_step_95pct_calling']}"
            f" | {r['rl_s']:.0f} |"
        )
    lines.append("")
    for pair_key, d in result.get("paired", {}).items():
        lines.append(f"- {pair_key}, paired by seed: {d}")
    for est, agg in result["by_estimator"].items():
        lines.append(
            f"- {est}: greedy gain mean {agg['mean_gain']:+.3f} (min {agg['min_gain']:+.3f}), "
            f"RL seconds median {agg['median_rl_s']:.0f}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--estimators", default="ebpo,grpo")
    p.add_argument("--out", default="/tmp/tiny_tools_runs")
    args = p.parse_args()
    env = dict(os.environ)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for est in args.estimators.split(","):
            runs.append(one_run(seed, est, Path(args.out) / f"{est}{seed}", env))
            print(json.dumps({k: runs[-1][k] for k in ("estimator", "seed", "greedy_accuracy",
                                                        "tool_calls_per_episode", "rl_s")}),
                  flush=True)  # fmt: skip
    by = {}
    for est in args.estimators.split(","):
        mine = [r for r in runs if r["estimator"] == est]
        by[est] = {
            "mean_gain": round(statistics.mean(r["greedy_gain"] for r in mine), 4),
            "min_gain": min(r["greedy_gain"] for r in mine),
            "median_rl_s": statistics.median(r["rl_s"] for r in mine),
        }
    ests = args.estimators.split(",")
    paired = {}
    if len(ests) == 2:
        a, b = ({r["seed"]: r for r in runs if r["estimator"] == e} for e in ests)
        for key in ("greedy_gain", "train_reward_mean_first_25", "train_reward_mean_all"):
            diffs = [round(a[k][key] - b[k][key], 4) for k in sorted(a) if k in b]
            paired[f"{ests[0]} - {ests[1]} {key}"] = diffs
    result = {
        "command": command(),
        "paired": paired,
        "warmup_s": next((r["warmup_s"] for r in runs if r["warmup_s"]), None),
        "runs": runs,
        "by_estimator": by,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
        "machine": machine(),
    }
    (RESULTS / "tiny_tools_run.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "tiny_tools_run.md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
