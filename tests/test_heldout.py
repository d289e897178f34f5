"""Held-out eval on any data (issue 32, part 1): a user's file gets a seeded held-out split
(`data.eval_size`) or a separate file (`data.eval_path`), the in-training eval scores it with the
run's own reward functions (a before -> after line), and `eval RUN --benchmark FILE.jsonl` scores
any file the same way. Data files are built in tmp_path from the tiny task's own problems, asked
as raw text (`data.prompt_format=raw`), the format the built-in model knows."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import textwrap

import pytest

from ebpo_lite import config
from ebpo_lite.data import loader as data
from ebpo_lite.engine import startup
from ebpo_lite.errors import ConfigError, UserError
from ebpo_lite.eval import HELD_OUT, benchmark_examples, main
from ebpo_lite.train import train
from tests.conftest import DATA, TINY_RECIPE, fast_overrides

REWARDS = '''
def exact(completions, answer, **kw):
    """1.0 when the completion is the answer, a user's own rule."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''


def write_rows(path, examples, dup: int = 0):
    """A jsonl of question / answer rows; `dup` rows repeat the first ones at the end."""
    rows = [{"question": e.prompt, "answer": e.answer} for e in examples]
    rows += rows[:dup]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def problems(n: int, seed: int = 7):
    return data.arithmetic_examples(n, seed=seed, split="train")


def load(path, *over):
    cfg = config.load(TINY_RECIPE, [f"data.path={path}", *over])
    train_ex, held = data.load_train_eval(cfg.data)
    return cfg, train_ex, held


def test_split_sizes_seeded_and_disjoint(tmp_path):
    path = write_rows(tmp_path / "mine.jsonl", problems(50), dup=3)  # 53 rows, 50 prompts
    cfg, tr, held = load(path)  # auto: 10% of 53 rows, rounded
    assert len(held) == 5 and len(tr) + len(held) <= 53
    assert not {e.prompt for e in tr} & {e.prompt for e in held}  # disjoint by prompt text too
    assert startup.data_line(cfg.data, tr, held).startswith(
        f"data: {len(tr)} training prompts from {path}, 5 held out for the eval (5 of 53 rows of "
    )
    assert [e.prompt for e in load(path)[2]] == [e.prompt for e in held]  # deterministic
    other = load(path, "data.seed=99")[2]
    assert [e.prompt for e in other] != [e.prompt for e in held]  # data.seed draws them
    for size, n in (("0.2", 11), ("7", 7), ("0", 0)):
        _, tr, held = load(path, f"data.eval_size={size}")
        assert len(held) == n and not {e.prompt for e in tr} & {e.prompt for e in held}
    # auto holds out at most data.num_eval
    assert len(load(path, "data.num_eval=2")[2]) == 2
    # a file under 10 rows: none held out, and the line says why
    small = write_rows(tmp_path / "small.jsonl", problems(6))
    cfg, tr, held = load(small)
    line = startup.data_line(cfg.data, tr, held)
    assert len(tr) == 6 and "0 held out for the eval (6 rows are too few" in line
    assert "data.eval_size=COUNT or data.eval_path" in line


def test_eval_path_is_held_out_and_kept_out_of_training(tmp_path):
    exs = problems(40)
    path = write_rows(tmp_path / "train.jsonl", exs)
    held_file = write_rows(tmp_path / "held.jsonl", exs[:4] + problems(6, seed=8))
    cfg, tr, held = load(path, f"data.eval_path={held_file}")
    assert [e.prompt for e in held] == [e.prompt for e in exs[:4] + problems(6, seed=8)]
    assert len(tr) == 36 and not {e.prompt for e in tr} & {e.prompt for e in held}
    assert startup.data_line(cfg.data, tr, held).endswith(
        f"10 held out for the eval ({held_file}, data.eval_path)"
    )


@pytest.mark.skipif(not (DATA / "gsm8k").is_dir(), reason=f"no GSM8K copy in {DATA}")
def test_a_preset_keeps_its_test_set():
    cfg = config.load(TINY_RECIPE, ["data.name=gsm8k"])
    tr, held = data.load_train_eval(cfg.data)
    assert len(tr) == 7473 and len(held) == 1319
    assert "(the preset's test set, " in startup.data_line(cfg.data, tr, held)
    tr, held = data.load_train_eval(
        config.load(TINY_RECIPE, ["data.name=gsm8k", "data.eval_size=50"]).data
    )
    assert len(tr) == 7423 and len(held) == 50  # asked for: split off the training data
    # a preset without a test set (a benchmark, a paper's training set) holds nothing out unless
    # asked: its training rows stay as they were
    cfg = config.load(TINY_RECIPE, ["data.name=math500"])
    tr, held = data.load_train_eval(cfg.data)
    assert len(tr) == 500 and not held
    assert "(math500 has no test set here; data.eval_size" in startup.data_line(cfg.data, tr, held)


@pytest.mark.parametrize(
    "over, says",
    [
        (["data.eval_size=1.0"], "data.eval_size: a fraction must be in (0, 1)"),
        (["data.eval_size=-3"], "data.eval_size: expected auto, a fraction"),
        (["data.eval_size=some"], "data.eval_size: expected auto, a fraction"),
        (["data.eval_size=5", "data.eval_path=x.jsonl"], "data.eval_size: 5 together with data.eval_path"),
        (["data.path=null", "data.eval_size=5"], "data.eval_size: the built-in arithmetic task"),
        (["data.eval_path="], "data.eval_path: must not be empty"),
        (["data.prompt_format=plain"], "data.prompt_format: expected one of auto, chat, raw"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_errors(tmp_path, over, says):
    path = write_rows(tmp_path / "mine.jsonl", problems(20))
    with pytest.raises(ConfigError) as e:
        config.load(TINY_RECIPE, [f"data.path={path}", *over])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_bad_files_are_one_line_errors(tmp_path):
    path = write_rows(tmp_path / "mine.jsonl", problems(20))
    with pytest.raises(ConfigError, match=r"^data.eval_path: .*nope.jsonl not found"):
        load(path, f"data.eval_path={tmp_path / 'nope.jsonl'}")
    with pytest.raises(ConfigError, match=r"^data.eval_size: 20 holds out 20 of the 20 examples"):
        load(path, "data.eval_size=20")


def test_held_out_benchmark_of_a_tiny_run_is_its_own_task():
    """`eval RUN` of a tiny run scores the run's own held-out problems, not MATH-500."""
    cfg = config.load(TINY_RECIPE, ["data.num_eval=16"])
    held = benchmark_examples(HELD_OUT, cfg.data)
    assert [e.prompt for e in held] == [
        e.prompt for e in data.arithmetic_examples(16, seed=cfg.data.seed, split="eval")
    ]
    with pytest.raises(UserError, match=r"holds no examples out \(data.num_eval=0\)"):
        benchmark_examples(HELD_OUT, config.load(TINY_RECIPE, ["data.num_eval=0"]).data)


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """A tiny run on a 50-row file of one's own, with one's own reward functions: (run folder,
    data file, what it printed)."""
    folder = tmp_path_factory.mktemp("user_data")
    (folder / "h1_user_rewards.py").write_text(textwrap.dedent(REWARDS))
    sys.path.insert(0, str(folder))
    path = write_rows(folder / "arith50.jsonl", problems(50))
    run = folder / "run"
    extra = {
        "data.path": path,
        "data.prompt_format": "raw",
        "reward.functions": "[h1_user_rewards:exact, arithmetic_answer]",  # one worker, not two
        "train.steps": 2,
    }
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            train(config.load(TINY_RECIPE, fast_overrides(run, **extra)))
        yield run, path, printed.getvalue()
    finally:
        sys.path.remove(str(folder))


def test_user_file_run_has_a_held_out_before_after(user_run):
    run, path, printed = user_run
    assert f"45 training prompts from {path}, 5 held out for the eval (5 of 50 rows" in printed
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    evals = [r for r in evals if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2] and all("eval/reward" in r for r in evals)
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    assert f"eval/accuracy (greedy): {before:.3f} -> {after:.3f}" in printed
    assert "eval/reward (all reward functions): " in printed
    # the raw format is one the model knows: it answers held-out problems right
    assert before > 0


def test_eval_cli_scores_a_file_and_the_runs_own_held_out(user_run, tmp_path, capsys):
    run, path, _ = user_run
    out = tmp_path / "f.json"
    assert main([str(run), "--benchmark", str(path), "--limit", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    m = res["benchmarks"][str(path)]
    assert m["num_problems"] == 8 and 0.0 <= m["mean_reward"] <= 1.0
    assert res["settings"]["reward"] == ["h1_user_rewards:exact", "arithmetic_answer"]
    out = tmp_path / "h.json"
    assert main([str(run), "--out", str(out)]) == 0  # no --benchmark: the run's held-out rows
    assert json.loads(out.read_text())["benchmarks"][HELD_OUT]["num_problems"] == 5
    capsys.readouterr()
    assert main([str(run), "--benchmark", "nope", "--out", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err
    assert "unknown 'nope' (expected some of arithmetic, " in err and "or a .json" in err
    assert main([str(run), "--benchmark", str(tmp_path / "no.jsonl")]) == 2
    assert "no.jsonl: file not found" in capsys.readouterr().err
