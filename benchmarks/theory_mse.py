"""Monte Carlo check of EBPO's claim: the shrunk baseline estimates a prompt's success rate with
lower mean squared error than the group mean (GRPO's baseline).

Model: each prompt has a success rate theta ~ Beta(a, b); its G completions get 0/1 rewards
~ Bernoulli(theta). A stream of `steps` batches of B prompts runs through `EBPrior` with the real
`ebpo_advantages` (online plug-in statistics, current batch included, as ALGORITHM.md step 1).
After `warmup` steps we measure, against the true theta of every prompt:
    group mean         V = mean_g                                     (GRPO, Dr. GRPO)
    EB paper           V = (1 - S) mean_g + S mu_glob                 EBPrior() (tau2 raw, sigma2 total)
    EB paper (batch)   V = (1 - S) mean_g + S mean(R_batch)           what step 6 (centring) implements
    EB moments         same V, EBPrior(tau2="moments")
    EB moments+within  same V, EBPrior(tau2="moments", sigma2="within")
    oracle             V = (1 - S*) mean_g + S* E[theta], S* = (Ew / G) / (Ew / G + Var theta),
                       Ew = E[theta (1 - theta)]: the best linear shrinkage with the true Beta
                       moments, measured on the same prompts (its expected value 1 - S* is in
                       the JSON as rel_mse_oracle_theory)
Reported: MSE of the group mean and each estimator's MSE relative to it (< 1 = better).

Usage: .venv/bin/python benchmarks/theory_mse.py [--steps 150 --warmup 30 --B 64 --seeds 3]
Writes benchmarks/results/theory_mse.json and theory_mse.md (the command and machine included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _machine import command, machine

from ebpo_lite.advantages import EBPrior, ebpo_advantages

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "paper": {},
    "moments": {"tau2": "moments"},
    "moments_within": {"tau2": "moments", "sigma2": "within"},
}
COLUMNS = ["paper", "paper_batch", "moments", "moments_within", "oracle"]


def beta_moments(a: float, b: float) -> tuple[float, float, float]:
    """(E theta, Var theta, E[theta (1 - theta)]) for theta ~ Beta(a, b)."""
    mu = a / (a + b)
    tau = a * b / ((a + b) ** 2 * (a + b + 1))
    return mu, tau, mu * (1 - mu) - tau


def run_cell(a: float, b: float, G: int, args: argparse.Namespace, seed: int) -> dict:
    """Squared errors of every estimator for one (shape, G, seed) stream."""
    gen = torch.Generator().manual_seed(seed)
    beta = torch.distributions.Beta(torch.tensor(float(a)), torch.tensor(float(b)))
    torch.manual_seed(seed)  # Beta.sample uses the global generator
    theta = beta.sample((args.steps, args.B)).to(torch.float64).clamp(0.0, 1.0)  # [T, B]
    R = torch.bernoulli(theta[:, :, None].expand(-1, -1, G), generator=gen)  # [T, B, G]
    priors = {v: EBPrior(**opts) for v, opts in VARIANTS.items()}
    mu, tau, ew = beta_moments(a, b)
    s_star = (ew / G) / (ew / G + tau)
    sq = {c: 0.0 for c in ["group_mean", *COLUMNS]}
    S_sum = {v: 0.0 for v in VARIANTS}
    n = 0
    for t in range(args.steps):
        mean_g = R[t].mean(dim=1)  # [B]
        for v, prior in priors.items():
            _, s = ebpo_advantages(R[t], prior)
            if t < args.warmup:
                continue
            S = s["shrinkage"]
            S_sum[v] += S
            sq[v] += ((1 - S) * mean_g + S * s["mu_glob"] - theta[t]).pow(2).sum().item()
            if v == "paper":
                V = (1 - S) * mean_g + S * R[t].mean()  # [B]
                sq["paper_batch"] += (V - theta[t]).pow(2).sum().item()
        if t >= args.warmup:
            sq["group_mean"] += (mean_g - theta[t]).pow(2).sum().item()
            sq["oracle"] += ((1 - s_star) * mean_g + s_star * mu - theta[t]).pow(2).sum().item()
            n += args.B
    T = args.steps - args.warmup
    return {"mse": {c: x / n for c, x in sq.items()}, "S": {v: x / T for v, x in S_sum.items()}}


def summarise(a: float, b: float, G: int, runs: list[dict]) -> dict:
    mu, tau, ew = beta_moments(a, b)
    s_oracle = (ew / G) / (ew / G + tau)
    s_paper_limit = (ew + tau) / (2 * ew + (G + 1) * tau)
    mse_g = [r["mse"]["group_mean"] for r in runs]
    rel = {c: [r["mse"][c] / r["mse"]["group_mean"] for r in runs] for c in COLUMNS}

    def se(xs: list[float]) -> float:
        return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")

    return {
        "a": a,
        "b": b,
        "G": G,
        "mse_group_mean": statistics.mean(mse_g),
        "mse_group_mean_theory": ew / G,
        "rel_mse": {c: statistics.mean(x) for c, x in rel.items()},
        "rel_mse_se": {c: se(x) for c, x in rel.items()},
        "rel_mse_oracle_theory": 1 - s_oracle,
        "shrinkage": {v: statistics.mean(r["S"][v] for r in runs) for v in VARIANTS},
        "shrinkage_oracle": s_oracle,
        "shrinkage_paper_limit": s_paper_limit,
    }


HOW_TO_READ = """\
**How to read.** Each row is one prior over prompt difficulty, theta ~ Beta(a, b), and one group
size G; rewards are 0/1. `MSE mean` is the mean squared error of the group mean against the true
theta (its theory value is E[theta(1-theta)]/G). The other columns are each estimator's MSE divided
by that of the group mean over the same prompts: below 1 the shrunk baseline is closer to the
truth, above 1 it is worse. `paper` uses the paper's online plug-in statistics (raw tau2, total
sigma2) and shrinks toward the running mean mu_glob; `paper (batch)` shrinks toward the current
batch mean instead, which is what EBPO's advantage actually uses after its batch re-centring
(mu_glob cancels there); `moments` subtracts the within-group noise from tau2; `+within` also uses
the within-group variance for sigma2 (the classical James-Stein choice); `oracle` is the best
linear shrinkage with the true Beta moments, on the same prompts. `S` columns: measured mean
shrinkage of the paper variant, its large-sample limit (Ew+tau)/(2Ew+(G+1)tau), and the oracle's
S*. A baseline with lower MSE is a better control variate; it does not by itself say that training
improves, and this model has one stationary difficulty distribution (no policy drift, no topics).
"""


def to_markdown(out: dict) -> str:
    p = out["params"]
    lines = [
        "# EBPO theory check: MSE of the baseline against the true success rate",
        "",
        f"Command: `{out['command']}`  ",
        f"Machine: {out['machine']['cpu']}, {out['machine']['cores']} cores, torch "
        f"{out['machine']['torch']}, python {out['machine']['python']}; ran in "
        f"{out['seconds']:.0f} s.  ",
        f"Stream: {p['steps']} steps of B = {p['B']} prompts, first {p['warmup']} steps are "
        f"warm-up, {p['seeds']} seeds per cell (relative MSE: mean over seeds; its standard "
        f"error is at most {out['max_se']:.3f}).",
        "",
        HOW_TO_READ,
        "| Beta(a, b) | G | MSE mean | paper | paper (batch) | moments | moments+within | oracle "
        "| S paper | S paper limit | S oracle |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in out["cells"]:
        r = c["rel_mse"]
        lines.append(
            f"| ({c['a']:g}, {c['b']:g}) | {c['G']} | {c['mse_group_mean']:.4f} | {r['paper']:.3f} "
            f"| {r['paper_batch']:.3f} | {r['moments']:.3f} | {r['moments_within']:.3f} "
            f"| {r['oracle']:.3f} | {c['shrinkage']['paper']:.3f} "
            f"| {c['shrinkage_paper_limit']:.3f} | {c['shrinkage_oracle']:.3f} |"
        )
    lines += ["", "Summary (computed by the script):", ""]
    lines += [f"- {s}" for s in out["summary"]]
    return "\n".join(lines) + "\n"


def summary_lines(cells: list[dict]) -> list[str]:
    out = []
    names = {"paper": "paper", "paper_batch": "paper (batch)", "moments": "moments",
             "moments_within": "moments+within", "oracle": "oracle"}  # fmt: skip
    for c, label in names.items():
        rel = [x["rel_mse"][c] for x in cells]
        wins = sum(r < 1 for r in rel)
        out.append(
            f"{label}: lower MSE than the group mean in {wins} of {len(rel)} cells; relative MSE "
            f"{min(rel):.3f} to {max(rel):.3f} (median {statistics.median(rel):.3f})"
        )
    gap = [x["rel_mse"]["paper"] - x["rel_mse"]["oracle"] for x in cells]
    out.append(f"paper minus oracle relative MSE: {min(gap):+.3f} to {max(gap):+.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1,1;0.5,0.5;2,5;5,2;0.3,3", help="a,b;a,b;...")
    ap.add_argument("--G", default="4,8,16,32")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/theory_mse"), help="no suffix")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        ap.error("--warmup must be in [0, steps)")
    torch.set_num_threads(1)
    shapes = [tuple(float(x) for x in s.split(",")) for s in args.shapes.split(";")]
    Gs = [int(g) for g in args.G.split(",")]
    t0 = time.perf_counter()
    cells = []
    for a, b in shapes:
        for G in Gs:
            runs = [run_cell(a, b, G, args, seed) for seed in range(args.seeds)]
            cells.append(summarise(a, b, G, runs))
            c = cells[-1]
            print(f"Beta({a:g},{b:g}) G={G:2d}: mse_mean {c['mse_group_mean']:.4f} "
                  + " ".join(f"{k} {v:.3f}" for k, v in c["rel_mse"].items())
                  + f" (oracle theory {c['rel_mse_oracle_theory']:.3f})", flush=True)  # fmt: skip
    ses = [v for c in cells for v in c["rel_mse_se"].values() if v == v]
    out = {
        "command": command(),
        "machine": machine(),
        "params": {k: getattr(args, k) for k in ("shapes", "G", "B", "steps", "warmup", "seeds")},
        "seconds": round(time.perf_counter() - t0, 1),
        "max_se": max(ses) if ses else float("nan"),
        "cells": cells,
        "summary": summary_lines(cells),
    }
    Path(args.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    Path(args.out + ".md").write_text(to_markdown(out))
    print("\n".join(out["summary"]))
    print(f"wrote {args.out}.json and .md in {out['seconds']} s")


if __name__ == "__main__":
    main()
