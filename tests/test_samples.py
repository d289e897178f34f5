"""What the model writes, seen while it trains (issue 32, part 2; ebpo_lite/engine/samples.py).

The warning logic, the file's resume and size rules and the warm-up's progress are checked on
their own, fast; then short tiny-model runs check what a user sees: the printed samples, the rows
of completions.jsonl, and one warning for a reward that always returns 0 (a user module written
into tmp_path, as a user's is) and for completions cut at a tiny rollout.max_new_tokens.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.engine import samples
from ebpo_lite.engine.samples import FLAT_STEPS, Context, Signals, Streak
from ebpo_lite.errors import ConfigError
from ebpo_lite.train import train
from tests.conftest import REPO, TINY_RECIPE, fast_overrides

B, G = 8, 4  # fast_overrides' prompts per step and group size


# ----------------------------------------------------------------------------- pure parts


def test_streak_fires_once_then_only_after_a_recovery():
    s = Streak(3)
    fired = [s.update(c) for c in [True] * 2 + [False] + [True] * 6]
    assert fired == [False] * 5 + [True] + [False] * 3  # 3 in a row, once; no repeat
    fired = [s.update(c) for c in [False] * 2 + [True] * 3]  # a short recovery: still quiet
    assert not any(fired)
    fired = [s.update(c) for c in [False] * 3 + [True] * 3]  # recovered 3 steps: armed again
    assert fired == [False] * 5 + [True]


def test_signals_tell_equal_masked_and_cut_steps():
    r = torch.tensor([[0.0, 0.0], [0.0, 1.0]])  # [B, G]
    all_on = torch.ones(2, 2, dtype=torch.bool)
    assert samples.signals(r, all_on, [True] * 4) == Signals(False, None, 0.0)
    masked = torch.tensor([[True, True], [True, False]])  # the only 1 is masked
    assert samples.signals(r, masked, [True, False, False, False]) == Signals(True, 0.0, 0.75)
    none = torch.zeros(2, 2, dtype=torch.bool)
    assert samples.signals(r, none, [True] * 4) == Signals(True, None, 0.0)


def _row(completion, truncated=False, reward=0.0):
    return {
        "step": 5,
        "prompt": "Question: 2+2\nAnswer:",
        "answer": "4",
        "completion": completion,
        "reward": reward,
        "advantage": 0.0,
        "truncated": truncated,
    }


def _ctx(**kw):
    base = dict(
        model="tiny",
        raw_prompts=True,
        chat_template=False,
        reward_names=("arithmetic_answer",),
        max_new_tokens=8,
    )
    return Context(**{**base, **kw})


def test_warning_names_the_likely_causes_with_an_example():
    rows = [_row("4 is the answer"), _row("12345678", truncated=True)]
    # all zero, most cut: truncation first, the extraction after, the cut example shown
    text = samples.warning(7, Signals(True, 0.0, 0.9), True, True, _ctx(), rows)
    assert text.startswith("warning: every reward was 0 for 5 steps in a row (steps 3-7)")
    assert "raise rollout.max_new_tokens" in text.splitlines()[1]
    assert "arithmetic_answer wants the completion to be the number" in text
    assert "'12345678'" in text and "cut at max_new_tokens" in text
    assert "prompt format" not in text  # the tiny task's own prompts
    # the tiny model on a file's prompts: the format it never saw
    text = samples.warning(5, Signals(True, 0.0, 0.0), True, False, _ctx(raw_prompts=False), rows)
    assert "a prompt format the model does not know" in text and "truncation" not in text
    # math_answer: how many completions have no box
    ctx = _ctx(
        model="org/instruct", raw_prompts=False, chat_template=True, reward_names=("math_answer",)
    )
    text = samples.warning(5, Signals(True, 0.0, 0.0), True, False, ctx, rows)
    assert "2 of 2 completions shown have no \\boxed{}" in text and "format" not in text
    # every completion masked: the reward function is the suspect
    text = samples.warning(5, Signals(True, None, 0.0), True, False, _ctx(reward_errors=3), rows)
    assert "every completion was masked" in text and "3 this step" in text
    # cut only: a truncation warning, no "no learning signal"
    text = samples.warning(5, Signals(False, None, 0.8), False, True, _ctx(), rows)
    assert text.startswith("warning: 80% of completions stopped at rollout.max_new_tokens=8")
    assert "learning signal" not in text


def test_completions_file_resumes_to_the_checkpoint_and_stops_at_its_cap(tmp_path):
    path = tmp_path / samples.FILE
    for step in (1, 2, 3):
        assert samples.append_rows(path, [{"step": step, "n": i} for i in range(2)])
    with path.open("a") as f:
        f.write('{"step": 3, "n": 2')  # a crash mid-write
    samples.truncate_after(path, 2)  # resumed from the step-2 checkpoint
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 1, 2, 2]
    size = path.stat().st_size
    assert not samples.append_rows(path, [{"step": 3, "n": 0}], max_bytes=size + 10)
    assert path.stat().st_size == size  # nothing written past the cap, not even part of a line
    samples.truncate_after(path, 0)  # a fresh run starts a new file
    assert not path.exists()


def test_cut_text_keeps_the_end_of_a_prompt():
    assert samples.cut_text("x" * 10 + "12+7=", 8, keep_end=True) == "...12+7="
    assert samples.cut_text("abcdefghij", 8) == "abcde..."
    assert samples.cut_text("short", 8) == "short"


@pytest.mark.parametrize("key", ["log.show_completions", "log.completions_every"])
def test_negative_counts_are_refused_by_name(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config.load(TINY_RECIPE, [f"{key}=-1"])


def test_tiny_warmup_shows_progress_lines(tmp_path, monkeypatch):
    """A cache miss logs a line every tenth of the steps (`lines`); `none` shows no step."""
    from ebpo_lite.model.tiny import warm_tiny_model, warmup_progress

    monkeypatch.setenv("EBPO_LITE_CACHE", str(tmp_path))
    lines: list[str] = []
    warm_tiny_model(10, 0, 1, log=lines.append, progress="lines")
    steps = [x for x in lines if "warm-up step" in x]
    assert len(steps) == 9 and steps[0].startswith("tiny model: warm-up step 1/10")
    assert lines[0].startswith("tiny model: supervised warm-up, 10 steps")  # before the wait
    lines.clear()
    with warmup_progress(10, "none", lines.append) as tick:
        for n in range(1, 11):
            tick(n)
    assert lines == []


def test_monitoring_doc_states_the_code_s_numbers():
    doc = (REPO / "docs" / "monitoring.md").read_text()
    stated = [
        f"at most {samples.ROWS_PER_WRITE} rows",
        f"cut to {samples.ROW_CHARS} characters",
        f"pass {samples.MAX_FILE_BYTES >> 20} MiB",
        f"over {FLAT_STEPS} steps in a row",
        f"absent {FLAT_STEPS} steps in a row",
        f"cut to {samples.SHOW_CHARS} characters",
        "more than half" if samples.TRUNCATED_SHARE == 0.5 else "unknown share",
    ]
    log = config.LogConfig()
    stated += [
        f"| `log.show_completions` | {log.show_completions} |",
        f"| `log.completions_every` | {log.completions_every} |",
    ]
    assert [s for s in stated if s not in " ".join(doc.split())] == []


# ----------------------------------------------------------------------------- tiny-model runs


def _train(tmp_path, capsys, **extra):
    cfg = config.load(TINY_RECIPE, fast_overrides(tmp_path / "run", **extra))
    summary = train(cfg)
    return summary, capsys.readouterr().out


def _rows(tmp_path):
    return [json.loads(x) for x in (tmp_path / "run" / samples.FILE).read_text().splitlines()]


def test_zero_reward_run_shows_samples_writes_rows_and_warns_once(tmp_path, capsys, monkeypatch):
    (tmp_path / "zero_reward_h2.py").write_text(
        "def score(completions, **columns):\n    return [0.0 for _ in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the contained worker takes the trainer's path
    steps = FLAT_STEPS + 2
    _, out = _train(
        tmp_path,
        capsys,
        **{
            "train.steps": steps,
            "reward.functions": "[zero_reward_h2:score]",
            "log.completions_every": 2,
        },
    )
    # the first step and the final (eval) step print 2 samples each
    assert out.count("samples at step 1 (2 of 32 completions):") == 1
    assert f"samples at step {steps} (2 of 32 completions):" in out
    assert "samples at step 2 " not in out
    assert out.count("      completion: ") == 4
    # one warning, at step K, naming the reward and showing an example
    assert out.count("warning:") == 1
    assert f"every reward was 0 for {FLAT_STEPS} steps in a row (steps 1-{FLAT_STEPS})" in out
    assert "zero_reward_h2:score gave 0 to every completion" in out
    assert "example completion: " in out
    assert "prompt format" not in out  # the tiny task's own prompts
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [2] * 16 + [4] * 16 + [6] * 16  # whole groups, capped
    first = rows[0]
    assert set(first) == {
        "step",
        "group",
        "sample",
        "example",
        "prompt",
        "answer",
        "completion",
        "reward",
        "advantage",
        "truncated",
        "completion_tokens",
    }
    assert all(r["reward"] == 0.0 and r["advantage"] == 0.0 for r in rows)
    assert [(r["group"], r["sample"]) for r in rows[:16]] == [
        (b, g) for b in range(4) for g in range(G)
    ]
    assert first["prompt"].endswith("=") and first["answer"].lstrip("-").isdigit()


def test_cut_completions_warn_to_raise_max_new_tokens(tmp_path, capsys):
    # log.progress=bar: the lines go above the bar (tqdm.write), whole
    _, out = _train(
        tmp_path,
        capsys,
        **{"train.steps": FLAT_STEPS, "rollout.max_new_tokens": 1, "log.progress": "bar"},
    )
    assert out.count("warning:") == 1
    assert "of completions stopped at rollout.max_new_tokens=1 for 5 steps in a row" in out
    assert "raise rollout.max_new_tokens (e.g. to 4)" in out
    assert "cut at max_new_tokens" in out
    assert f"samples at step {FLAT_STEPS} (2 of 32 completions):" in out  # under the bar
    assert not (tmp_path / "run" / samples.FILE).exists()  # every 10 steps by default


def test_resume_keeps_one_row_set_per_step(tmp_path, capsys):
    """A run that crashed after writing rows of steps 3-4 but before their checkpoint resumes
    from step 2: the file then holds each step's rows once."""
    extra = {
        "train.steps": 4,
        "train.checkpoint_every": 2,
        "train.keep_checkpoints": 3,
        "log.completions_every": 1,
    }
    _train(tmp_path, capsys, **extra)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_4")  # as if it died before saving
    _, out = _train(tmp_path, capsys, **extra, **{"train.resume": "true"})
    assert "samples at step 3 " in out  # the resumed invocation's first step
    steps = [r["step"] for r in _rows(tmp_path)]
    assert steps == sorted(steps) and all(steps.count(s) == 16 for s in (1, 2, 3, 4))
