"""Monte Carlo check of EBPO's claim: the shrunk baseline estimates a prompt's success rate with
lower mean squared error than the group mean (GRPO's baseline).

Model: each prompt has a success rate theta ~ Beta(a, b); its G completions get 0/1 rewards
~ Bernoulli(theta). A stream of `steps` batches of B prompts runs through `EBPrior` with the real
`ebpo_advantages` (online plug-in statistics, current batch included: docs/algorithm.md
section 3, step 1).
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

Part 2 (issue 12): the baselines as control variates of a policy gradient, with prompts that
come back. After `warmup` steps of fresh prompts (the global prior settles), a pool of K * B
prompts is visited cyclically, `visits` times each, so every prompt's k-th visit has k earlier
ones. Each prompt is a Bernoulli policy with logit l and pass rate theta: the score of y is
y - theta, the true gradient of theta w.r.t. l is theta (1 - theta), and a baseline V_i gives
    g_hat = (1 / G) sum_i (R_i - V_i) (R_i - theta)            (one prompt, G completions)
For each baseline - group mean (GRPO / Dr. GRPO), leave-one-out mean (RLOO), paper EB, EB
leave-one-out, EB prompt prior, EB leave-one-out + prompt prior (the real `ebpo_advantages`, its
V read back with center=False) - and each visit count k: the baseline's MSE against theta, the
bias ratio E[g_hat] / E[theta (1 - theta)] (1 = unbiased) and the gradient's MSE
E[(g_hat - theta (1 - theta))^2], relative to the group mean's.

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

from ebpo_lite.algo.advantages import EBPO_EPS, EBPrior, ebpo_advantages

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


GRAD_PRIORS = {
    "eb_paper": {},
    "eb_loo": {"leave_one_out": True},
    "eb_prompt": {"prompt_prior": True},
    "eb_loo_prompt": {"leave_one_out": True, "prompt_prior": True},
}
GRAD_COLUMNS = ["group_mean", "loo_mean", *GRAD_PRIORS]
VISITS_SHOWN = (0, 1, 2, 4, 8)


def gradient_cell(a: float, b: float, G: int, args: argparse.Namespace, seed: int) -> dict:
    """Per baseline and visit count k: sums of baseline and gradient errors over the pool."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    torch.manual_seed(10_000 + seed)
    beta = torch.distributions.Beta(torch.tensor(float(a)), torch.tensor(float(b)))
    B, K = args.B, args.pool_steps
    fresh = beta.sample((args.warmup, B)).to(torch.float64).clamp(0.0, 1.0)  # [W, B]
    pool = beta.sample((K * B,)).to(torch.float64).clamp(0.0, 1.0)  # [K B]
    priors = {v: EBPrior(center=False, **o) for v, o in GRAD_PRIORS.items()}
    # per baseline and k: sums of [(V - theta)^2, g, g_hat, (g_hat - g)^2, n, g_hat^2, g_hat g, g^2]
    acc: dict[str, dict[int, list[float]]] = {c: {} for c in GRAD_COLUMNS}
    steps = args.warmup + K * args.visits
    for t in range(steps):
        if t < args.warmup:
            theta, ids, k = fresh[t], list(range(-(t + 1) * B, -t * B)), None
        else:
            j = (t - args.warmup) % K
            theta, ids, k = (
                pool[j * B : (j + 1) * B],
                list(range(j * B, (j + 1) * B)),
                (t - args.warmup) // K,
            )
        R = torch.bernoulli(theta[:, None].expand(-1, G), generator=gen)  # [B, G]
        mean_g = R.mean(dim=1, keepdim=True)  # [B, 1]
        Vs = {
            "group_mean": mean_g.expand(-1, G),
            "loo_mean": (R.sum(1, keepdim=True) - R) / (G - 1),
        }
        for v, prior in priors.items():
            A, st = ebpo_advantages(R, prior, prompts=ids)
            Vs[v] = R - A * (st["raw_std"] + EBPO_EPS)  # [B, G]
        if k is None:
            continue
        g_true = theta * (1 - theta)  # [B]
        for c, V in Vs.items():
            g_hat = ((R - V) * (R - theta[:, None])).mean(dim=1)  # [B]
            row = acc[c].setdefault(k, [0.0] * 8)
            row[0] += (V - theta[:, None]).pow(2).mean(dim=1).sum().item()
            row[1] += g_true.sum().item()
            row[2] += g_hat.sum().item()
            row[3] += (g_hat - g_true).pow(2).sum().item()
            row[4] += B
            row[5] += g_hat.pow(2).sum().item()
            row[6] += (g_hat * g_true).sum().item()
            row[7] += g_true.pow(2).sum().item()
    return acc


def summarise_gradient(a: float, b: float, G: int, runs: list[dict]) -> dict:
    """Pool the seeds: per visit k and baseline, MSE of V, bias ratio, gradient MSE (relative)."""
    by_k = {}
    for k in sorted(runs[0]["group_mean"]):
        tot = {c: [sum(r[c][k][i] for r in runs) for i in range(8)] for c in GRAD_COLUMNS}

        def scaled(x: list[float]) -> float:
            """MSE of g_hat / bias_ratio: the noise left once the overall scale is undone."""
            c = x[2] / x[1]
            return (x[5] / c**2 - 2 * x[6] / c + x[7]) / x[4]

        base = tot["group_mean"]
        by_k[k] = {
            c: {
                "mse_baseline": x[0] / x[4],
                "bias_ratio": x[2] / x[1],
                "grad_mse": x[3] / x[4],
                "rel_grad_mse": x[3] / base[3],
                "rel_scaled_grad_mse": scaled(x) / scaled(base),
            }
            for c, x in tot.items()
        }
    return {"a": a, "b": b, "G": G, "by_visit": by_k}


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
    if out.get("gradient"):
        lines += gradient_markdown(out["gradient"], (0, 2, 8))
        lines += ["", "Summary of part 2 (computed by the script):", ""]
        lines += [f"- {s}" for s in out["gradient_summary"]]
    return "\n".join(lines) + "\n"


GRAD_HOW_TO_READ = """\
**How to read (part 2).** Each cell is `scaled / raw relative gradient MSE (bias ratio)` for one
baseline. Raw: the MSE of the per-prompt policy-gradient estimate divided by that with the
group-mean baseline (below 1 = a better control variate). Bias ratio: E[g_hat] / E[true gradient]
(1 = unbiased; the group mean gives (G - 1) / G). A baseline that shrinks every gradient by the
same factor lowers the raw MSE without helping an optimiser that normalises the scale (Adam, the
advantage whitening), so `scaled` is the MSE of g_hat / (bias ratio), relative to the group
mean's scaled MSE: the noise and the per-prompt distortion that remain. `k` is the number of earlier visits of the prompt (the prompt prior
has k * G of its completions). `MSE V` is the baseline's own MSE against theta for EB prompt
prior + leave-one-out. The policy does not change between visits here, so the prompt's history
never goes stale; in training it does (the `decay` option down-weights it).
"""


def gradient_markdown(grads: list[dict], shown: tuple[int, ...]) -> list[str]:
    names = ["group mean", "LOO mean (RLOO)", "EB paper", "EB LOO", "EB prompt", "EB LOO+prompt"]
    lines = [
        "",
        "## Part 2: the baselines as policy-gradient control variates, prompts revisited",
        "",
        GRAD_HOW_TO_READ,
        "| Beta(a, b) | G | k | " + " | ".join(names) + " | MSE V (LOO+prompt) |",
        "|---" * (4 + len(names)) + "|",
    ]
    for c in grads:
        for k in shown:
            if k not in c["by_visit"]:
                continue
            r = c["by_visit"][k]
            cells = [
                f"{r[n]['rel_scaled_grad_mse']:.3f} / {r[n]['rel_grad_mse']:.3f} "
                f"({r[n]['bias_ratio']:.3f})"
                for n in GRAD_COLUMNS
            ]
            lines.append(
                f"| ({c['a']:g}, {c['b']:g}) | {c['G']} | {k} | "
                + " | ".join(cells)
                + f" | {r['eb_loo_prompt']['mse_baseline']:.4f} |"
            )
    return lines


def gradient_summary(grads: list[dict]) -> list[str]:
    out = []
    for k in (0, max(grads[0]["by_visit"])):
        best = {}
        for c in grads:
            r = c["by_visit"][k]
            low = min(r[n]["rel_scaled_grad_mse"] for n in GRAD_COLUMNS)
            # ties (equal up to round-off, e.g. eb_paper and eb_loo with equal groups) share a win
            w = " = ".join(
                n for n in GRAD_COLUMNS if r[n]["rel_scaled_grad_mse"] <= low * (1 + 1e-9)
            )
            best[w] = best.get(w, 0) + 1
        out.append(
            f"lowest scaled gradient MSE at k = {k} earlier visits, over {len(grads)} (shape, G) cells: "
            + ", ".join(f"{n} {m}" for n, m in sorted(best.items(), key=lambda x: -x[1]))
        )
    for n in GRAD_COLUMNS:
        ratios = [c["by_visit"][0][n]["bias_ratio"] for c in grads]
        out.append(f"bias ratio of {n} at k = 0: {min(ratios):.3f} to {max(ratios):.3f}")
    return out


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
    ap.add_argument("--grad-G", default="2,4,8,16", help="G of part 2")
    ap.add_argument("--grad-seeds", type=int, default=6, help="seeds of part 2")
    ap.add_argument("--pool-steps", type=int, default=8, help="part 2: steps between visits")
    ap.add_argument("--visits", type=int, default=9, help="part 2: visits of each pool prompt")
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
    grads = []
    for a, b in shapes:
        for G in (int(g) for g in args.grad_G.split(",")):
            runs = [gradient_cell(a, b, G, args, seed) for seed in range(args.grad_seeds)]
            grads.append(summarise_gradient(a, b, G, runs))
            r0 = grads[-1]["by_visit"][0]
            print(f"part 2 Beta({a:g},{b:g}) G={G:2d} k=0: "
                  + " ".join(f"{n} {r0[n]['rel_scaled_grad_mse']:.3f}" for n in GRAD_COLUMNS),
                  flush=True)  # fmt: skip
    ses = [v for c in cells for v in c["rel_mse_se"].values() if v == v]
    out = {
        "command": command(),
        "machine": machine(),
        "params": {
            k: getattr(args, k)
            for k in (
                "shapes",
                "G",
                "B",
                "steps",
                "warmup",
                "seeds",
                "grad_G",
                "grad_seeds",
                "pool_steps",
                "visits",
            )
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "max_se": max(ses) if ses else float("nan"),
        "cells": cells,
        "summary": summary_lines(cells),
        "gradient": grads,
        "gradient_summary": gradient_summary(grads),
    }
    Path(args.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    Path(args.out + ".md").write_text(to_markdown(out))
    print("\n".join(out["summary"]))
    print(f"wrote {args.out}.json and .md in {out['seconds']} s")


if __name__ == "__main__":
    main()
