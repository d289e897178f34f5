"""`ebpo_lite.commands.plot`: figures from real tiny runs, EBPO (with evals) against GRPO (without)."""

from __future__ import annotations

import json
import shutil

import pytest

from ebpo_lite import config
from ebpo_lite.commands.plot import FIGURES, build_figures, load_runs, main, plot_runs
from ebpo_lite.engine.metrics import read_metrics
from ebpo_lite.train import train
from tests.conftest import TINY_RECIPE, fast_overrides

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run_a: EBPO, 4 steps, an eval every 2; run_b: GRPO, 3 steps, no eval problems at all."""
    root = tmp_path_factory.mktemp("plot")
    a, b = root / "run_a", root / "run_b"
    train(config.load(TINY_RECIPE, fast_overrides(a, **{"train.steps": 4, "eval.every": 2})))
    extra = {"algo.estimator": "grpo", "eval.num_examples": 0}
    train(config.load(TINY_RECIPE, fast_overrides(b, **extra)))
    return a, b


def _lines(fig) -> dict[str, dict[str, tuple[list, list]]]:
    """{panel key: {legend label: (x, y)}} of a figure (a panel's title ends with its key)."""
    out = {}
    for ax in fig.axes:
        key = ax.get_title().splitlines()[-1]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}
        assert sorted(legend) == sorted(lines), key  # every line is in the legend
        out[key] = lines
    return out


def test_figures_hold_each_runs_series(runs):
    a, b = runs
    figs = build_figures(load_runs([a, b]))
    la, lb = "run_a (ebpo)", "run_b (grpo)"  # folder names, estimators differ
    # hf sampler: no sampler log-probs, so no gap figure; no benchmarks configured
    assert set(figs) == {"reward", "eval_by_type", "eb_prior", "zero_variance", "optimization"}
    recs = read_metrics(a / "metrics.jsonl")
    train_a = [r for r in recs if "train/loss" in r]
    evals_a = [r for r in recs if "eval/accuracy" in r]
    reward = _lines(figs["reward"])
    assert set(reward["train/reward_mean"]) == {la, lb}
    assert reward["train/reward_mean"][la] == (
        [r["step"] for r in train_a],
        [r["train/reward_mean"] for r in train_a],
    )
    assert set(reward["eval/accuracy"]) == {la}  # run_b has no eval records
    assert reward["eval/expected_accuracy"][la][0] == [0, 2, 4]
    by_type = _lines(figs["eval_by_type"])
    want = {k for k in evals_a[-1] if "=" in k and k.startswith("eval/")}
    assert set(by_type) == want and len(want) == 12  # 3 topics + 3 difficulties, x 2 metrics
    assert by_type["eval/accuracy/topic=add"][la][1] == [
        r["eval/accuracy/topic=add"] for r in evals_a
    ]
    prior = _lines(figs["eb_prior"])
    assert {"adv/shrinkage", "adv/mu_glob", "adv/tau2", "adv/sigma2"} <= set(prior)
    assert all(set(lines) == {la} for lines in prior.values())  # GRPO logs no EB prior
    assert prior["adv/shrinkage"][la][1] == [r["adv/shrinkage"] for r in train_a]
    assert set(_lines(figs["zero_variance"])["train/frac_zero_std_groups"]) == {la, lb}
    opt = _lines(figs["optimization"])
    assert {"train/kl", "train/entropy", "train/grad_norm"} <= set(opt)
    assert all(set(lines) == {la, lb} for lines in opt.values())


def test_plot_runs_writes_pngs_and_the_gap_figure(runs, tmp_path):
    from matplotlib.image import imread

    a, b = runs
    paths = plot_runs([a, b], tmp_path / "plots", labels=["EBPO", "GRPO"])
    assert [p.name for p in paths] == [
        f"{s.name}.png" for s in FIGURES if s.name not in ("eval_benchmarks", "logprob_gap")
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC
        h, w, _ = imread(p).shape
        assert h > 200 and w > 200
    # a run that logged the sampler gap (as the vLLM sampler does) gets that figure too
    c = tmp_path / "with_gap"
    c.mkdir()
    shutil.copy(a / "config.yaml", c / "config.yaml")
    recs = read_metrics(a / "metrics.jsonl")
    for r in recs:
        if "train/loss" in r:
            r["rollout/logp_diff_max"] = 1e-5 * r["step"]
    (c / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    gap = _lines(build_figures(load_runs([c, b]))["logprob_gap"])
    assert set(gap) == {"rollout/logp_diff_max"}
    assert gap["rollout/logp_diff_max"]["with_gap (ebpo)"][1] == [1e-5 * s for s in (1, 2, 3, 4)]


def test_cli_default_folder_and_mistakes(runs, tmp_path, capsys):
    a, b = runs
    assert main([str(a)]) == 0
    assert (a / "plots" / "reward.png").is_file()
    assert "figures in" in capsys.readouterr().out
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    for argv, message in [
        ([str(empty)], f"{empty}: no metrics.jsonl"),
        ([str(tmp_path / "nowhere")], "no such run folder"),
        ([str(tmp_path / "blank")], "no metrics recorded yet"),
        ([str(tmp_path / "bad")], "metrics.jsonl:2: not a metrics record"),
        (
            [str(a), str(b), "--label", "one"],
            "--label: 1 given for 2 runs; give one --label per run",
        ),
        ([str(a), "--out", str(tmp_path / "bad" / "metrics.jsonl")], "is a file; give a folder"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
