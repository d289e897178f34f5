"""Sample efficiency of the estimators on the built-in tiny task, at equal compute.

    python benchmarks/sample_efficiency.py [--seeds 0,1,2,3,4,5] [--groups 2,4,8] [--steps 150]
                                           [--methods grpo,ebpo,...] [--workers 2]

Every run is `recipes/tiny_cpu.yaml` with 128 completions per step (64 / 32 / 16 prompts at
G = 2 / 4 / 8) for `--steps` steps, so every method generates the same number of completions per
step and in total. Only the method, G and the seed change. Runs are paired: a seed gives every
method the same warmed-up start, the same LoRA initialisation and (for shuffled data) the same
prompt stream. Methods:

- `grpo`, `dr_grpo`, `rloo`: the baselines of docs/algorithm.md section 2;
- `dapo`: GRPO with DAPO's dynamic sampling at equal compute: groups whose rewards are all equal
  are dropped from the loss and NOT refilled (`max_extra_draws=0`; refilling would generate more);
- `ebpo`: the paper variant on shuffled data; `ebpo_topic`, `ebpo_difficulty`: the paper's two
  orders (`curriculum.sampler`);
- `ebpo_nocenter`, `ebpo_moments` (`tau2=moments`, `sigma2=within`), `ebpo_decay` (`decay=0.99`),
  `ebpo_key_topic` (`prior_key=topic`): the beyond-paper options of docs/algorithm.md section 4;
- `ebpo_prompt` (`prompt_prior`), `ebpo_loo_prompt` (with `leave_one_out`): the options of
  `ebpo_lite.algo.advantages` added later (docs/algorithm.md section 4). `leave_one_out` alone is
  not run: with one G and no masked completions it gives the paper's advantages exactly (up to
  the whitening's eps; proved in `ebpo_lite.algo.advantages`, tested in tests/test_ebpo_options.py);
  `grpo_adaptive`, `ebpo_loo_prompt_adaptive` (`curriculum.sampler=adaptive`) and
  `ebpo_loo_prompt_dapo` (dynamic sampling as in `dapo`) tell estimator gains from sampling gains
  (benchmarks/beyond_paper.py tabulates them against `grpo` and `ebpo`).

Per run: held-out exact expected accuracy and greedy accuracy (256 problems) every 25 steps;
`final_accuracy` (expected accuracy after the last step), `auc` (mean gain in expected accuracy
over the evals after step 0), the same two for greedy accuracy, the mean share of zero-variance
groups, the mean EB shrinkage S, wall time. Writes benchmarks/results/sample_efficiency.json
(records + summary), .md (means, paired differences against `grpo` with 95% t-intervals and
wins / seeds) and .png (mean curves). Finished runs are kept in
runs/sample_efficiency.partial.jsonl, so an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

from _machine import command, machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PARTIAL = REPO / "runs" / "sample_efficiency.partial.jsonl"
COMPLETIONS = 128  # per step, for every method and G
EVAL_EVERY = 25
METHODS: dict[str, list[str]] = {
    "grpo": ["algo.estimator=grpo"],
    "dr_grpo": ["algo.estimator=dr_grpo"],
    "rloo": ["algo.estimator=rloo"],
    "dapo": [
        "algo.estimator=grpo",
        "curriculum.dynamic_sampling=true",
        "curriculum.max_extra_draws=0",
    ],
    "ebpo": ["algo.estimator=ebpo"],
    "ebpo_topic": ["algo.estimator=ebpo", "curriculum.sampler=topic"],
    "ebpo_difficulty": ["algo.estimator=ebpo", "curriculum.sampler=difficulty"],
    "ebpo_nocenter": ["algo.estimator=ebpo", "algo.center=false"],
    "ebpo_moments": ["algo.estimator=ebpo", "algo.tau2=moments", "algo.sigma2=within"],
    "ebpo_decay": ["algo.estimator=ebpo", "algo.decay=0.99"],
    "ebpo_key_topic": ["algo.estimator=ebpo", "algo.prior_key=topic"],
    # issue 12: this project's own options (prompt_prior, leave_one_out), then with two samplers
    "ebpo_prompt": ["algo.estimator=ebpo", "algo.prompt_prior=true"],
    "ebpo_loo_prompt": ["algo.estimator=ebpo", "algo.leave_one_out=true", "algo.prompt_prior=true"],
    "grpo_adaptive": ["algo.estimator=grpo", "curriculum.sampler=adaptive"],
    "ebpo_loo_prompt_adaptive": [
        "algo.estimator=ebpo",
        "algo.leave_one_out=true",
        "algo.prompt_prior=true",
        "curriculum.sampler=adaptive",
    ],
    "ebpo_loo_prompt_dapo": [
        "algo.estimator=ebpo",
        "algo.leave_one_out=true",
        "algo.prompt_prior=true",
        "curriculum.dynamic_sampling=true",
        "curriculum.max_extra_draws=0",
    ],
}
# issue 33: EBPO and GRPO under the losses of docs/losses.md, each paired with GRPO under the same
# loss (BASE). Run them off-policy (`--extra train.mini_batches=4`, the paper's 512 / 128): with one
# optimizer step per rollout every ratio is 1, where GSPO's gradient is GRPO's and CISPO's is
# DAPO's. Clip ranges as the losses' papers and TRL's docs recommend them: GSPO 3e-4 / 4e-4 on the
# sequence ratio; CISPO's cap 1 + 4.0 (TRL's epsilon_high=5.0); DAPO's overlong filtering on the
# default token-mean loss.
LOSSES: dict[str, list[str]] = {
    "gspo": [
        "algo.loss_type=grpo",
        "algo.importance_sampling_level=sequence",
        "algo.clip_eps_low=3e-4",
        "algo.clip_eps_high=4e-4",
    ],
    "dapo_overlong": ["algo.loss_type=dapo", "algo.mask_truncated_completions=true"],
    "cispo": ["algo.loss_type=cispo", "algo.clip_eps_high=4.0"],
}
BASE: dict[str, str] = {}
for _loss, _keys in LOSSES.items():
    for _est in ("grpo", "ebpo"):
        METHODS[f"{_est}_{_loss}"] = [f"algo.estimator={_est}", *_keys]
    BASE[f"ebpo_{_loss}"] = f"grpo_{_loss}"
# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


def overrides(
    method: str, G: int, seed: int, steps: int, out: Path, extra: tuple[str, ...] = ()
) -> list[str]:
    return [
        f"output_dir={out}",
        *METHODS[method],
        f"rollout.group_size={G}",
        f"train.prompts_per_step={COMPLETIONS // G}",
        f"train.seed={seed}",
        f"train.steps={steps}",
        "train.threads=1",
        "train.checkpoint_every=0",
        f"eval.every={EVAL_EVERY}",
        "log.progress=none",
        *extra,
    ]


def _key(r: dict) -> tuple:
    return (r["method"], r["group_size"], r["seed"], r["steps"], tuple(r.get("extra", ())))


def one_run(job: tuple[str, int, int, int, tuple[str, ...]]) -> dict:
    """Train one (method, G, seed) and reduce its metrics.jsonl to one record."""
    from ebpo_lite import config
    from ebpo_lite.engine.metrics import read_metrics
    from ebpo_lite.train import train

    method, G, seed, steps, extra = job
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cfg = config.load(
            REPO / "recipes" / "tiny_cpu.yaml", overrides(method, G, seed, steps, out, extra)
        )
        t0 = time.perf_counter()
        train(cfg)
        wall = time.perf_counter() - t0
        recs = read_metrics(out / "metrics.jsonl")
    evals = [r for r in recs if "eval/expected_accuracy" in r]
    steps_rec = [r for r in recs if "train/loss" in r]
    exp = [r["eval/expected_accuracy"] for r in evals]
    greedy = [r["eval/accuracy"] for r in evals]
    shrink = [r["adv/shrinkage"] for r in steps_rec if "adv/shrinkage" in r]
    visits = [r["adv/prompt_visits"] for r in steps_rec if "adv/prompt_visits" in r]
    return {
        "method": method,
        "group_size": G,
        "seed": seed,
        "steps": steps,
        "extra": list(extra),
        "eval_steps": [r["step"] for r in evals],
        "expected_accuracy": exp,
        "greedy_accuracy": greedy,
        "final_accuracy": exp[-1],
        "auc": statistics.mean(e - exp[0] for e in exp[1:]),
        "final_greedy": greedy[-1],
        "auc_greedy": statistics.mean(g - greedy[0] for g in greedy[1:]),
        "per_type_final": {
            k.removeprefix("eval/"): v
            for k, v in evals[-1].items()
            if k.startswith(("eval/accuracy/", "eval/expected_accuracy/"))
        },
        "frac_zero_std_groups": statistics.mean(r["train/frac_zero_std_groups"] for r in steps_rec),
        "mean_shrinkage": statistics.mean(shrink) if shrink else None,
        "mean_prompt_visits": statistics.mean(visits) if visits else None,
        "wall_s": round(wall, 1),
    }


def paired(runs: list[dict], method: str, G: int, field: str, base: str = "grpo") -> dict | None:
    """Mean, 95% t-interval and wins of `method - base` over the seeds both have."""
    a = {r["seed"]: r[field] for r in runs if r["method"] == method and r["group_size"] == G}
    b = {r["seed"]: r[field] for r in runs if r["method"] == base and r["group_size"] == G}
    seeds = sorted(a.keys() & b.keys())
    if len(seeds) < 2:
        return None
    d = [a[s] - b[s] for s in seeds]
    m, sd = statistics.mean(d), statistics.stdev(d)
    half = T975[min(len(d) - 1, 30) - 1] * sd / len(d) ** 0.5
    return {"mean": m, "ci95": [m - half, m + half], "wins": sum(x > 0 for x in d), "n": len(d)}


def summarize(runs: list[dict], groups: list[int]) -> list[dict]:
    rows = []
    for G in groups:
        for method in METHODS:
            rs = [r for r in runs if r["method"] == method and r["group_size"] == G]
            if not rs:
                continue
            row = {"method": method, "group_size": G, "seeds": len(rs)}
            row["base"] = BASE.get(method, "grpo")
            for f in ("final_accuracy", "auc", "final_greedy", "auc_greedy"):
                row[f] = statistics.mean(r[f] for r in rs)
                base = BASE.get(method, "grpo")
                row[f"{f}_vs_grpo"] = paired(runs, method, G, f, base) if method != base else None
            row["start_accuracy"] = statistics.mean(r["expected_accuracy"][0] for r in rs)
            row["frac_zero_std_groups"] = statistics.mean(r["frac_zero_std_groups"] for r in rs)
            s = [r["mean_shrinkage"] for r in rs if r["mean_shrinkage"] is not None]
            row["mean_shrinkage"] = statistics.mean(s) if s else None
            row["wall_s"] = statistics.mean(r["wall_s"] for r in rs)
            rows.append(row)
    return rows


def _diff(d: dict | None) -> str:
    if d is None:
        return "—"
    lo, hi = d["ci95"]
    return f"{d['mean']:+.4f} [{lo:+.4f}, {hi:+.4f}] {d['wins']}/{d['n']}"


def table(rows: list[dict]) -> str:
    lines = [
        "| G | method | seeds | final exp. acc. | AUC | final Δ vs grpo [95% CI] wins "
        "| AUC Δ vs grpo [95% CI] wins | final greedy | greedy AUC Δ vs grpo | zero-var groups "
        "| mean S | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = "—" if r["mean_shrinkage"] is None else f"{r['mean_shrinkage']:.2f}"
        lines.append(
            f"| {r['group_size']} | {r['method']} | {r['seeds']} | {r['final_accuracy']:.4f} "
            f"| {r['auc']:+.4f} | {_diff(r['final_accuracy_vs_grpo'])} "
            f"| {_diff(r['auc_vs_grpo'])} | {r['final_greedy']:.3f} "
            f"| {_diff(r['auc_greedy_vs_grpo'])} | {r['frac_zero_std_groups']:.2f} | {s} "
            f"| {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], groups: list[int], dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), sharey=True)
    for ax, G in zip([axes] if len(groups) == 1 else axes, groups):
        for method in METHODS:
            rs = [r for r in runs if r["method"] == method and r["group_size"] == G]
            if not rs:
                continue
            xs = rs[0]["eval_steps"]
            ys = [statistics.mean(r["expected_accuracy"][i] for r in rs) for i in range(len(xs))]
            style = "-" if method in ("grpo", "ebpo") else "--"
            ax.plot(xs, ys, style, label=method, linewidth=2 if method in ("grpo", "ebpo") else 1)
        ax.set_title(f"G = {G}, {COMPLETIONS} completions / step")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    (axes if len(groups) == 1 else axes[0]).set_ylabel("held-out expected accuracy (mean of seeds)")
    (axes if len(groups) == 1 else axes[-1]).legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2,3,4,5")
    p.add_argument("--groups", default="2,4,8")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--workers", type=int, default=2, help="runs in parallel, one thread each")
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        help="an override for every run (repeatable), e.g. train.mini_batches=4",
    )
    p.add_argument(
        "--name",
        default="sample_efficiency",
        help="results as benchmarks/results/NAME.{json,md,png}; finished runs in runs/NAME.partial.jsonl",
    )
    args = p.parse_args()
    extra = tuple(args.extra)
    partial = PARTIAL.with_name(f"{args.name}.partial.jsonl")
    seeds = [int(s) for s in args.seeds.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - METHODS.keys())
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    jobs = [(m, G, s, args.steps, extra) for s in seeds for G in groups for m in methods]
    partial.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if partial.is_file():
        for line in partial.read_text().splitlines():
            r = json.loads(line)
            done[_key(r)] = r
    todo = [j for j in jobs if j not in done]
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} already done", flush=True)
    if todo:
        from ebpo_lite import config
        from ebpo_lite.model.tiny import warm_tiny_model

        # warm the tiny model once here, so the workers find it cached (no policy built)
        cfg = config.load(REPO / "recipes" / "tiny_cpu.yaml", [])
        warm_tiny_model(cfg.model.sft_warmup_steps, cfg.model.sft_seed, cfg.data.seed)
        with mp.get_context("spawn").Pool(args.workers) as pool, partial.open("a") as f:
            for r in pool.imap_unordered(one_run, todo):
                done[_key(r)] = r
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(
                    f"{r['method']} G={r['group_size']} seed={r['seed']}: "
                    f"final {r['final_accuracy']:.4f} auc {r['auc']:+.4f} ({r['wall_s']:.0f}s)",
                    flush=True,
                )
    runs = [done[j] for j in jobs]
    rows = summarize(runs, groups)
    cmd, mach = command(), machine(workers=args.workers)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({"command": cmd, "machine": mach, "summary": rows, "runs": runs}, indent=2)
        + "\n"
    )
    plot(runs, groups, RESULTS / f"{args.name}.png")
    md = (
        "# Sample efficiency on the tiny CPU task, at equal compute\n\n"
        f"Command: `{cmd}`  \nMachine: {mach['cores']} cores ({mach['cpu']}), "
        f"torch {mach['torch']}, {args.workers} runs in parallel, one thread each.\n\n"
        f"Each run: recipes/tiny_cpu.yaml, {args.steps} steps of {COMPLETIONS} completions "
        f"(prompts = {COMPLETIONS} / G), seeds {args.seeds}, paired across methods"
        + (f", every run with {', '.join(f'`{e}`' for e in extra)}" if extra else "")
        + ". Accuracy: "
        "the exact expected accuracy on 256 held-out problems (no sampling noise); AUC = mean "
        f"gain over the evals every {EVAL_EVERY} steps after step 0. Differences are paired "
        "(same seed) against `grpo` (an `ebpo_LOSS` row: against `grpo_LOSS`, the same loss): "
        f"mean [95% t-interval] wins/seeds. Figure: [{args.name}.png]({args.name}.png).\n\n"
        + table(rows)
        + "\n"
    )
    (RESULTS / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
