"""A new user's first run: what it prints, where its data and labels come from, and the one-line
errors on the way (issue 15).

- start-up says what happens before step 1 (data, memory plan, model, sampler), and the last
  progress line and the summary show the final eval, not an older one;
- the hub's download bars stay on while the rest of transformers stays quiet;
- `data.labels_path`: a missing file names the exact command that writes it (and that command
  works); `auto` makes the labels in the run with `ebpo_lite.commands.difficulty`'s code, reuses them, and
  gives what the command gives;
- presets and benchmarks come from a local data folder when one holds them, else from the hub;
  offline without a cached copy is one line naming the hub id and the setting to use instead.
No test touches the network: the hub paths run with downloads off and an empty cache.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ebpo_lite import config
from ebpo_lite.data import loader as data
from ebpo_lite.data import mathdata
from ebpo_lite.engine import labels
from ebpo_lite.errors import ConfigError
from tests.conftest import REPO, SHARED_DATA, TINY_RECIPE, fast_overrides

# the shared data folder beside the repo, or beside the worktree folder that holds it
LOCAL_DATA = next(
    (p for p in (SHARED_DATA, REPO.parents[1] / "shared" / "data") if (p / "gsm8k").is_dir()),
    None,
)
needs_local_data = pytest.mark.skipif(
    LOCAL_DATA is None, reason=f"no shared data folder ({SHARED_DATA} or beside the worktrees)"
)


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ----------------------------------------------------------------------------- start-up and summary


def test_startup_lines_then_steps_and_the_final_eval(tmp_path, capsys):
    """Before step 1: data, memory, model, sampler, the first eval; the last step line and the
    summary carry the final eval (here it differs from the first, so a stale one would show)."""
    from ebpo_lite.train import train

    over = fast_overrides(
        tmp_path, **{"train.steps": 2, "rollout.group_size": 8, "train.prompts_per_step": 16,
                     "train.lr": 1e-2, "log.progress": "lines",
                     "log.show_completions": 0}  # its blocks: tests/test_samples.py
    )  # fmt: skip
    summary = train(config.load(TINY_RECIPE, over))
    # the tiny warm-up's own lines ("tiny model: ...") come only on a cache miss: left out
    out = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("tiny model:")]
    heads = [line.split(":")[0].split(" ")[0] for line in out]
    order = ["data", "memory", "model", "sampler", "eval", "training", "step", "step", "done"]
    assert heads[: len(order)] == order, out
    assert (
        out[0]
        == "data: 400 training prompts from the built-in arithmetic task, 16 held out for the eval"
    )
    assert out[2] == "model: tiny (built in), float32, on cpu, LoRA r 16"
    assert (
        out[3].startswith("sampler: transformers (generate")
        and "16 prompts x 8 completions" in out[3]
    )
    records = _rows(tmp_path / "metrics.jsonl")
    first, final = (r for r in records if "eval/accuracy" in r)
    assert final["step"] == 2 and first["step"] == 0
    assert first["eval/accuracy"] != final["eval/accuracy"]  # else this test could not fail
    last_step = next(line for line in reversed(out) if line.startswith("step 2/2"))
    assert f"eval_acc={final['eval/accuracy']:.3f}" in last_step
    assert f"eval_exp_acc={final['eval/expected_accuracy']:.3f}" in last_step
    assert summary["after/accuracy"] == final["eval/accuracy"] and summary["after_step"] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["after_step"] == 2
    assert f"-> {final['eval/accuracy']:.3f}" in next(
        x for x in out if x.startswith("eval/accuracy")
    )


def test_hub_download_bars_stay_on_and_transformers_bars_off():
    code = (
        "from ebpo_lite import cli; cli.quiet_libraries()\n"
        "from huggingface_hub.utils import are_progress_bars_disabled\n"
        "from transformers.utils import logging\n"
        "print(are_progress_bars_disabled(), logging.is_progress_bar_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=120)  # fmt: skip
    assert r.stdout.split() == ["False", "False"], r.stderr


# ----------------------------------------------------------------------------- labels


def test_missing_labels_file_names_the_command_that_writes_it(tmp_path, capsys):
    from ebpo_lite.commands.difficulty import main as difficulty_main

    out = tmp_path / "my labels.jsonl"
    over = [f"output_dir={tmp_path / 'run'}", "model.sft_warmup_steps=100", "data.num_train=6",
            "curriculum.sampler=difficulty", f"data.labels_path={out}"]  # fmt: skip
    cfg = config.load(TINY_RECIPE, over)
    with pytest.raises(ConfigError) as e:
        labels.check_path(cfg)
    msg = str(e.value)
    want = (
        f"ebpo-lite label difficulty {TINY_RECIPE} model.sft_warmup_steps=100 "
        f"data.num_train=6 curriculum.sampler=difficulty --out '{out}'"
    )
    assert msg.startswith(f"data.labels_path: {out} not found; write it first with: {want} (")
    assert "data.labels_path=auto" in msg and "\n" not in msg
    topic = config.load(TINY_RECIPE, [*over, "curriculum.sampler=topic"])
    assert f"ebpo-lite label topics {TINY_RECIPE} " in labels.command(topic, str(out))
    # the command works as printed: then the run's check passes and the labels apply
    argv = shlex.split(want)[3:]
    assert difficulty_main(argv) == 0 and len(_rows(out)) == 6
    labels.check_path(cfg)
    train, _ = data.load_train_eval(cfg.data)
    assert [ex.difficulty for ex in train] == [1 - r["pass_rate"] for r in _rows(out)]


def test_labels_auto_makes_reuses_and_equals_the_command(tmp_path, capsys):
    """`data.labels_path=auto` on the tiny task: pass rates sampled by the run's own sampler into
    the cache, reused by the next run, the same as `ebpo-lite label difficulty` writes."""
    from ebpo_lite.commands.difficulty import main as difficulty_main
    from ebpo_lite.engine.run import build_run

    over = fast_overrides(
        tmp_path / "run", **{"data.num_train": 12, "data.labels_path": "auto",
                             "curriculum.sampler": "difficulty", "train.seed": 11,
                             "train.prompts_per_step": 32}
    )  # fmt: skip
    cfg = config.load(TINY_RECIPE, over)
    path = labels.auto_path(cfg, "difficulty")
    path.unlink(missing_ok=True)
    other = config.load(TINY_RECIPE, [*over, "model.sft_warmup_steps=101"])
    assert labels.auto_path(other, "difficulty") != path  # another model: another file
    try:
        lines: list[str] = []
        run = build_run(cfg, log=lines.append)
        run.backend.close()
        assert any("labelling 12 prompts" in x and str(path) in x for x in lines), lines
        rows = _rows(path)
        assert [r["index"] for r in rows] == list(range(12)) and all(r["k"] == 16 for r in rows)
        assert [ex.difficulty for ex in run.train_examples] == [1 - r["pass_rate"] for r in rows]
        assert len({r["pass_rate"] for r in rows}) > 1  # real pass rates, not one constant
        stamp = path.stat().st_mtime_ns
        again: list[str] = []
        run = build_run(cfg, log=again.append)  # reuses the file: no sampling
        run.backend.close()
        assert any("reused from" in x for x in again) and path.stat().st_mtime_ns == stamp
        cli_out = tmp_path / "cli.jsonl"
        cli = [a for a in over if not a.startswith("data.labels_path=")]
        # 32 prompts x 4 samples a step: 8 prompts
        batch = str(labels.auto_batch_size(cfg.train, cfg.rollout))
        assert (
            difficulty_main([str(TINY_RECIPE), *cli, "--out", str(cli_out), "--batch-size", batch])
            == 0
        )
        assert [r["pass_rate"] for r in _rows(cli_out)] == [r["pass_rate"] for r in rows]
    finally:
        path.unlink(missing_ok=True)


def test_labels_auto_without_a_use_makes_none(tmp_path):
    cfg = config.load(TINY_RECIPE, fast_overrides(tmp_path, **{"data.labels_path": "auto"}))
    said: list[str] = []
    exs = data.arithmetic_examples(6, 1, "train")
    assert labels.maybe_topic_labels(cfg, exs, said.append) is exs
    assert labels.needed(cfg.curriculum, cfg.algo) == [] and "nothing here uses labels" in said[0]


# ----------------------------------------------------------------------------- data: local or hub


@needs_local_data
def test_local_data_folder_by_setting_or_env(monkeypatch):
    monkeypatch.setenv("EBPO_LITE_DATA", str(LOCAL_DATA))
    train, held = data.load_train_eval(config.DataConfig(name="gsm8k"))
    assert (len(train), len(held)) == (7473, 1319)
    assert data.describe_source(config.DataConfig(name="gsm8k"), train) == str(
        LOCAL_DATA / "gsm8k" / "train.jsonl"
    )
    monkeypatch.setenv("EBPO_LITE_DATA", "/nonexistent/ebpo_data")  # data.data_dir wins
    math = mathdata.load_examples(config.DataConfig(name="math", data_dir=str(LOCAL_DATA)))
    assert len(math) == 7470 and math.source == str(LOCAL_DATA / "math_train" / "math.json")
    aime = mathdata.load_benchmark("aime24", data_dir=str(LOCAL_DATA))
    assert len(aime) == 30 and aime[0].answer.isdigit()


def test_hub_rows_of_math_take_the_solutions_box():
    """The hub's MATH (MATH-lighteval) has no answer field, and a few `Level ?` rows."""
    row = {"problem": "Half of 1?", "level": "Level ?", "type": "Algebra",
           "solution": "It is $\\boxed{\\frac{1}{2}}$."}  # fmt: skip
    prompt, answer, topic, diff, _ = mathdata._math(row)
    assert (prompt, answer, topic, diff) == ("Half of 1?", "\\frac{1}{2}", "Algebra", None)


def _offline_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "empty").mkdir(exist_ok=True)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf"), "EBPO_LITE_DATA": str(tmp_path / "empty")}  # fmt: skip


@pytest.mark.parametrize(
    "argv, want",
    [
        (["train", str(TINY_RECIPE), "data.name=math"],
         "error: data.name: math: the hub dataset DigitalLearningGmbH/MATH-lighteval is not in "
         "the local cache and cannot be downloaded (downloads are off: HF_HUB_OFFLINE=1); set "
         "EBPO_LITE_DATA (or data.data_dir) to a folder holding math_train/math.json, or set "
         "data.path to a local json/jsonl/parquet file"),
        (["eval", "tiny", "--benchmark", "aime24"],
         "error: benchmark aime24: the hub dataset HuggingFaceH4/aime_2024 is not in the local "
         "cache and cannot be downloaded (downloads are off: HF_HUB_OFFLINE=1); set "
         "EBPO_LITE_DATA (or data.data_dir) to a folder holding aime24/test.jsonl"),
    ],
    ids=["train_math", "eval_aime24"],
)  # fmt: skip
def test_offline_without_a_local_copy_is_one_line(tmp_path, argv, want):
    cmd = [sys.executable, "-m", f"ebpo_lite.{argv[0]}", *argv[1:]]
    if argv[0] == "train":
        cmd.append(f"output_dir={tmp_path / 'run'}")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_offline_env(tmp_path),
                       timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip() == want, r.stderr
    assert not (tmp_path / "run").exists()


def test_the_logger_extras_the_errors_name_exist():
    """`log.wandb` / `log.tensorboard` errors say `pip install "ebpo-lite[wandb]"`: those extras
    must exist and install the package the check looks for."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["wandb"] == ["wandb"] and extras["tensorboard"] == ["tensorboard"]
