"""Difficulty labels: pass rates of the base policy, resumable, readable by apply_labels."""

from __future__ import annotations

import json

import pytest

from ebpo_lite import config
from ebpo_lite.commands.difficulty import main, pass_rates
from ebpo_lite.data import loader as data
from tests.conftest import TINY_RECIPE


def test_pass_rates_hand_computed():
    totals = [1.0, 0.0, None, 1.0, None, None, None, None, 1.2, -0.5, 0.5, 0.0]
    got = pass_rates(totals, 4)
    assert got[0] == (pytest.approx(2 / 3), 3, pytest.approx(2 / 3))
    assert got[1] == (None, 0, None)  # nothing judged
    assert got[2][0] == pytest.approx((1.0 + 0.0 + 0.5 + 0.0) / 4)  # clipped to [0, 1]
    assert got[2][2] == pytest.approx(1.2 / 4)


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_difficulty_cli_on_tiny_recipe_resumes(tmp_path, capsys):
    out = tmp_path / "diff.jsonl"
    over = [f"output_dir={tmp_path}", "model.sft_warmup_steps=100", "data.num_train=6",
            "data.num_eval=0", "train.threads=1"]  # fmt: skip
    argv = [str(TINY_RECIPE), *over, "--k", "4", "--out", str(out), "--batch-size", "4"]
    assert main(argv) == 0
    rows = _rows(out)
    assert [r["index"] for r in rows] == list(range(6))
    assert all(r["k"] == 4 and r["num_scored"] == 4 and 0 <= r["pass_rate"] <= 1 for r in rows)
    assert all(r["pass_rate"] * 4 == round(r["pass_rate"] * 4) for r in rows)  # c / 4
    # the labels file is what apply_labels reads: difficulty = 1 - pass_rate
    cfg = config.load(TINY_RECIPE, [*over, f"data.labels_path={out}"])
    train, _ = data.load_train_eval(cfg.data)
    assert [ex.difficulty for ex in train] == [1.0 - r["pass_rate"] for r in rows]
    # resume: cut the file mid-line; only the missing examples are sampled again
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:3]) + text[3][:10])
    assert main(argv) == 0
    rows2 = _rows(out)
    assert rows2[:3] == rows[:3] and [r["index"] for r in rows2] == list(range(6))
    capsys.readouterr()
    assert main([*argv[:-4], "--k", "8", "--out", str(out)]) == 2  # other settings
    assert "k=4" in capsys.readouterr().err
