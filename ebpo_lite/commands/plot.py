"""`ebpo-lite plot RUN_DIR [RUN_DIR ...] [--out DIR]`: PNG figures of runs' metrics.

Reads each run's `metrics.jsonl` (one record per step, eval records separate; `metrics.py`) and
draws one figure per concern, every run overlaid with a legend:
- `reward.png`: `train/reward_mean`, `eval/accuracy`, `eval/expected_accuracy`;
- `eval_by_type.png`: the eval accuracies per topic / difficulty (`eval/accuracy/topic=add`, ...);
- `eval_benchmarks.png`: `eval/<benchmark>/pass@1`, `maj@k`, `pass@k` (`eval.benchmarks`);
- `eb_prior.png`: the EB prior over time: shrinkage S, mu_glob, tau2, sigma2 (`adv/*`);
- `zero_variance.png`: the share of groups whose rewards are all equal;
- `optimization.png`: KL, entropy, gradient norm, clip fraction;
- `logprob_gap.png`: the sampler / trainer log-prob gap (`rollout/logp_diff_*`,
  `rollout/is_ratio_*`; logged by the vLLM sampler, not by transformers').
A panel whose key no run recorded is left out, and a figure with no panel is not written, so
GRPO runs (no `adv/*`), runs without eval records and hf-sampler runs all plot.
Labels: each run's folder name, plus its `algo.estimator` when the runs' estimators differ and
the name does not already say it.

matplotlib is imported only here, inside the functions, and draws on its Agg canvas directly
(no pyplot, so a notebook's own backend is left alone). Python API: `plot_runs`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ebpo_lite import cli
from ebpo_lite.errors import UserError


@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem
    title: str
    keys: tuple[str, ...] = ()  # one panel per key, in this order
    pattern: str = ""  # or: one panel per recorded key matching this regex, sorted


FIGURES = (
    FigureSpec(
        "reward",
        "Reward and eval accuracy",
        ("train/reward_mean", "eval/accuracy", "eval/expected_accuracy"),
    ),
    FigureSpec(
        "eval_by_type",
        "Eval accuracy by type",
        pattern=r"eval/(accuracy|expected_accuracy)/.+=.+",
    ),
    FigureSpec(
        "eval_benchmarks",
        "Benchmarks",
        pattern=r"eval/[^/]+/(pass@\d+|maj@\d+)",
    ),
    FigureSpec(
        "eb_prior",
        "EB prior (EBPO)",
        ("adv/shrinkage", "adv/mu_glob", "adv/tau2", "adv/sigma2", "adv/frac_key_prior"),
    ),
    FigureSpec(
        "zero_variance",
        "Groups with zero reward variance",
        ("train/frac_zero_std_groups",),
    ),
    FigureSpec(
        "optimization",
        "Optimization",
        ("train/kl", "train/entropy", "train/grad_norm", "train/clip_frac"),
    ),
    FigureSpec(
        "logprob_gap",
        "Sampler / trainer log-prob gap",
        (
            "rollout/logp_diff_max",
            "rollout/logp_diff_mean",
            "rollout/is_ratio_max",
            "rollout/is_ratio_min",
        ),
    ),
)

TITLES = {
    "train/reward_mean": "train reward (mean)",
    "eval/accuracy": "eval accuracy",
    "eval/expected_accuracy": "eval expected accuracy",
    "adv/shrinkage": "shrinkage S",
    "adv/mu_glob": "prior mean mu_glob",
    "adv/tau2": "between-prompt variance tau2",
    "adv/sigma2": "within-group variance sigma2",
    "adv/frac_key_prior": "share on a keyed prior",
    "train/frac_zero_std_groups": "share of zero-variance groups",
    "train/kl": "KL to reference",
    "train/entropy": "entropy",
    "train/grad_norm": "grad norm",
    "train/clip_frac": "clip fraction",
}


@dataclass
class RunSeries:
    """One run's metrics as series: key -> (steps, values), numbers only."""

    label: str
    path: Path
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)


def read_run(run_dir: str | Path) -> RunSeries:
    """A run's numeric series from its metrics.jsonl (label: the folder name, see `load_runs`).

    A last line cut short (a run still writing, or killed) is skipped; any other bad line is a
    `UserError` naming file:line.
    """
    run = Path(run_dir)
    path = run / "metrics.jsonl"
    if not run.is_dir():
        raise UserError(f"{run}: no such run folder")
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl; not a training output_dir (or not started)")
    lines = path.read_text(errors="replace").splitlines()
    out = RunSeries(run.name, run)
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            if i == len(lines):
                continue
            raise UserError(f"{path}:{i}: not a metrics record (JSON with a step)") from None
        for key, v in rec.items():
            if key != "step" and _number(v):
                steps, values = out.series.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(v))
    if not out.series:
        raise UserError(f"{path}: no metrics recorded yet")
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def load_runs(run_dirs: list[str | Path], labels: list[str] | None = None) -> list[RunSeries]:
    """Read every run; label them (given labels, else folder names made distinct)."""
    if not run_dirs:
        raise UserError("plot: give at least one run folder")
    if labels is not None and len(labels) != len(run_dirs):
        raise UserError(
            f"--label: {len(labels)} given for {len(run_dirs)} runs; give one --label per run, "
            "in the order of the runs"
        )
    runs = [read_run(d) for d in run_dirs]
    if labels is not None:
        for run, label in zip(runs, labels):
            run.label = label
        return runs
    estimators = [_estimator(r.path) for r in runs]
    if len(set(estimators)) > 1:
        for run, est in zip(runs, estimators):
            if est and est not in run.label:
                run.label = f"{run.label} ({est})"
    if len({r.label for r in runs}) < len(runs):  # same folder names: say where they are
        for run in runs:
            run.label = f"{run.path.parent.name}/{run.label}"
    return runs


def _estimator(run: Path) -> str | None:
    import yaml

    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        return str(cfg["algo"]["estimator"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def panel_keys(spec: FigureSpec, runs: list[RunSeries]) -> list[str]:
    """The keys of `spec` that at least one run recorded, in panel order."""
    recorded = set().union(*(r.series for r in runs))
    if spec.pattern:
        rx = re.compile(spec.pattern)
        return sorted(k for k in recorded if rx.fullmatch(k))
    return [k for k in spec.keys if k in recorded]


def build_figures(runs: list[RunSeries]) -> dict[str, Any]:
    """{figure name: matplotlib Figure} for every figure with at least one recorded series.

    Each panel is one key, titled with it, one line per run that recorded it, labelled with the
    run's label (the legend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figures = {}
    for spec in FIGURES:
        keys = panel_keys(spec, runs)
        if not keys:
            continue
        cols = 1 if len(keys) == 1 else 2 if len(keys) <= 4 else 3
        rows = math.ceil(len(keys) / cols)
        fig = Figure(figsize=(4.8 * cols, 3.3 * rows), layout="constrained")
        FigureCanvasAgg(fig)
        fig.suptitle(spec.title)
        axes = fig.subplots(rows, cols, squeeze=False).ravel()
        for ax, key in zip(axes, keys):
            _draw_panel(ax, key, runs)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in axes[len(keys) :]:
            fig.delaxes(ax)
        figures[spec.name] = fig
    return figures


def _draw_panel(ax, key: str, runs: list[RunSeries]) -> None:
    for i, run in enumerate(runs):
        if key not in run.series:
            continue
        steps, values = run.series[key]
        few = len(steps) <= 30  # eval records and short runs: show each point
        ax.plot(steps, values, label=run.label, color=f"C{i}", marker="o" if few else None, ms=3)
    title = TITLES.get(key)
    ax.set_title(f"{title}\n{key}" if title else key, fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def default_out_dir(run_dirs: list[str | Path]) -> Path:
    """One run: RUN_DIR/plots; several: plots/ in the folder that holds them all."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "plots"
    return Path(os.path.commonpath([str(Path(d).resolve()) for d in run_dirs])) / "plots"


def plot_runs(
    run_dirs: list[str | Path],
    out_dir: str | Path | None = None,
    labels: list[str] | None = None,
) -> list[Path]:
    """Write the PNG figures (module docstring) of one or more runs; returns their paths.

    `out_dir` defaults to `default_out_dir(run_dirs)`; `labels` (one per run) replace the
    automatic legend labels.
    """
    runs = load_runs(list(run_dirs), labels)
    out = Path(out_dir) if out_dir is not None else default_out_dir(list(run_dirs))
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} is a file; give a folder for the figures")
    figures = build_figures(runs)
    if not figures:
        return []  # nothing to draw: no empty folder left behind
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out: cannot create {out} ({e.strerror or e})") from None
    written = []
    for name, fig in figures.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=cli.prog("python -m ebpo_lite.commands.plot"),
        description="PNG figures of one or more runs' metrics.jsonl, runs overlaid.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="training output_dir(s)")
    p.add_argument("--out", default=None, help="folder (default RUN_DIR/plots; several: beside)")
    p.add_argument("--label", action="append", default=None, help="legend label, once per run")
    args = p.parse_args(argv)

    def run() -> None:
        paths = plot_runs(args.run_dirs, args.out, args.label)
        if not paths:
            print("no figure: none of the plotted series is in these runs' metrics")
            return
        print(f"{len(paths)} figures in {paths[0].parent}: " + ", ".join(p.name for p in paths))

    return cli.run(run)


if __name__ == "__main__":
    sys.exit(main())
