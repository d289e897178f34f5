"""Evaluation metrics (hand-computed) and the eval CLI end to end on a tiny trained run."""

from __future__ import annotations

import json
import subprocess
import sys
from math import comb

import pytest

from ebpo_lite import config
from ebpo_lite.eval import (
    answer_key,
    main,
    majority_vote,
    mean_over_benchmarks,
    pass_at_k,
    pass_ks,
    summarize,
)
from ebpo_lite.train import train
from tests.conftest import REPO, SHARED_DATA, TINY_RECIPE, fast_overrides


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # C(7,4)=35, C(10,4)=210
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong samples: always a hit
    assert pass_at_k(8, 0, 8) == 0.0
    for n, c, k in [(32, 5, 1), (32, 5, 8), (32, 31, 16), (100, 7, 10)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert pass_ks(32) == [1, 2, 4, 8, 16, 32] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]


def test_answer_key_normalises_strings_not_math():
    assert answer_key(" $\\dfrac{1}{2}$ ") == answer_key("\\frac{1}{2}") == "\\frac{1}{2}"
    assert answer_key("\\left( 1, 2 \\right)") == "(1,2)"
    assert answer_key("025") == "25" and answer_key("1,000") == "1000"
    assert answer_key("3.50") == "3.5" and answer_key("27.0") == "27"
    assert answer_key("90^\\circ") == "90" and answer_key("\\text{Evelyn}.") == "Evelyn"
    assert answer_key("0.5") != answer_key("\\frac{1}{2}")  # grouped by string, not value
    assert answer_key(None) is None and answer_key("  $ $ ") is None


def test_majority_vote_on_constructed_answers():
    # "2" x3 (wrong) beats "\frac12"-equivalents x2 (right); None answers do not vote
    answers = ["\\frac{1}{2}", "2", None, "2.0", "\\dfrac{1}{2}", "02", None]
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert majority_vote(answers, scores) == ("2", 0.0)
    # a tie goes to the answer seen first
    assert majority_vote(["7", "5", "5", "7"], [1.0, 0.0, 0.0, 1.0]) == ("7", 1.0)
    assert majority_vote(["5", "7", "7", "5"], [0.0, 1.0, 1.0, 0.0]) == ("5", 0.0)
    assert majority_vote([None, None], [0.0, 0.0]) == (None, 0.0)


def test_summarize_and_mean():
    recs = [
        {"k": 4, "num_correct": 1, "maj_correct": 0.0, "lengths": [2, 2, 2, 2], "truncated": 0,
         "unscored": 0},
        {"k": 4, "num_correct": 4, "maj_correct": 1.0, "lengths": [4, 4, 4, 4], "truncated": 2,
         "unscored": 1},
    ]  # fmt: skip
    s = summarize(recs, 4)
    assert s["pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert s["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert s["pass@4"] == pytest.approx(1.0) and s["maj@4"] == pytest.approx(0.5)
    assert s["mean_length"] == pytest.approx(3.0) and s["truncated_frac"] == pytest.approx(0.25)
    m = mean_over_benchmarks({"a": s, "b": {**s, "pass@1": 0.125}})
    assert m["pass@1"] == pytest.approx((0.625 + 0.125) / 2) and "mean_length" not in m


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evalrun") / "run"
    train(config.load(TINY_RECIPE, fast_overrides(out, **{"train.steps": 2})))
    return out


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_eval_cli_end_to_end_and_resume(tiny_run, tmp_path, capsys):
    out = tmp_path / "x.json"
    args = [str(tiny_run), "--benchmark", "arithmetic", "--k", "2", "--limit", "8"]
    r = subprocess.run(
        [sys.executable, "-m", "ebpo_lite.eval", *args, "--out", str(out), "train.threads=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pass@1" in r.stdout and "maj@2" in r.stdout  # the printed table
    res = json.loads(out.read_text())
    assert res["settings"]["checkpoint"] == "step_2" and res["settings"]["temperature"] == 0.6
    bench = res["benchmarks"]["arithmetic"]
    assert {"num_problems", "pass@1", "pass@2", "maj@2"} <= bench.keys()
    assert bench["num_problems"] == 8 and set(res["mean"]) == {"pass@1", "pass@2", "maj@2"}
    partial = tmp_path / "x.json.partial.jsonl"
    rows = _lines(partial)
    assert "settings" in rows[0] and [x["index"] for x in rows[1:]] == list(range(8))
    assert all(len(x["answers"]) == 2 and x["k"] == 2 for x in rows[1:])
    assert bench["pass@1"] == pytest.approx(sum(x["num_correct"] for x in rows[1:]) / 16)
    # resume: drop two records (one cut mid-write); only those two are generated again
    text = partial.read_text().splitlines(keepends=True)
    partial.write_text("".join(text[:-2]) + text[-2][:20])
    out.unlink()
    assert main([*args, "--out", str(out), "train.threads=1"]) == 0
    rows2 = _lines(partial)
    assert rows2[: len(rows) - 2] == rows[:-2]  # done work untouched
    assert sorted(x["index"] for x in rows2[1:]) == list(range(8)) and len(rows2) == len(rows)
    assert json.loads(out.read_text())["benchmarks"]["arithmetic"]["num_problems"] == 8
    # other settings with the same partial file: one-line error, exit 2
    assert main([*args, "--k", "3", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err


def test_eval_cli_math500_tiny_model(tiny_run, tmp_path):
    if not (SHARED_DATA / "math500" / "test.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    out = tmp_path / "m.json"
    argv = [str(tiny_run), "--benchmark", "math500", "--k", "1", "--limit", "2", "--out", str(out)]
    assert main([*argv, "train.threads=1"]) == 0
    res = json.loads(out.read_text())
    m = res["benchmarks"]["math500"]
    assert m["num_problems"] == 2 and 0.0 <= m["pass@1"] <= 1.0 and res["settings"]["k"] == 1
    assert res["settings"]["temperature"] == 0.0  # k = 1: greedy
    # issue 15: the rule is named, and the shares of each extraction method add up to 1
    from ebpo_lite.rewards import EXTRACTION, EXTRACTION_METHODS

    assert res["settings"]["extraction"] == EXTRACTION and "math-verify" in EXTRACTION
    shares = [m[f"extraction/{x}"] for x in EXTRACTION_METHODS]
    assert sum(shares) == pytest.approx(1.0) and all(0 <= v <= 1 for v in shares)
    rows = _lines(tmp_path / "m.json.partial.jsonl")
    assert all(set(r["extraction"]) <= set(EXTRACTION_METHODS) for r in rows[1:])


def test_eval_cli_user_errors(tmp_path, capsys):
    assert main([str(tmp_path), "--benchmark", "nope", "--out", str(tmp_path / "e.json")]) == 2
    assert "unknown 'nope'" in capsys.readouterr().err
    assert main([str(tmp_path), "--k", "0"]) == 2
    # caught before anything loads or is written (no partial file to block the next call)
    for bad, says in [
        (["--temperature", "-1"], "--temperature: must be >= 0"),
        (["--top-p", "5"], "--top-p: must be in (0, 1]"),
        (["--out", str(tmp_path)], f"--out: {tmp_path} is a folder"),
    ]:
        capsys.readouterr()
        assert main([str(tmp_path), "--benchmark", "arithmetic", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert list(tmp_path.iterdir()) == []
    # a checkpoint that is not there: say which the run has (not "no such model folder")
    from ebpo_lite import config

    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "trainable.safetensors").write_bytes(b"")
    (run / "config.yaml").write_text(config.dump(config.load(None)))
    assert main([str(run / "checkpoints" / "step_7"), "--benchmark", "arithmetic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {run / 'checkpoints' / 'step_7'}: no such checkpoint of that run "
                   "(it has: step_2)"]  # fmt: skip
    # a checkpoint cut short (here: empty): one line naming the file, before any model loads
    assert main([str(run), "--benchmark", "arithmetic", "--out", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    bad = run / "checkpoints" / "step_2" / "trainable.safetensors"
    assert len(err) == 1 and err[0].startswith(f"error: {bad}: unreadable checkpoint file"), err


def test_in_training_benchmark_eval(tmp_path):
    """eval.benchmarks inside training: eval/<bench>/pass@1 etc. are logged."""
    from ebpo_lite.engine.metrics import read_metrics

    out = tmp_path / "run"
    extra = {"train.steps": 1, "eval.benchmarks": "[arithmetic]", "eval.k": 2,
             "eval.num_examples": 8, "eval.temperature": 1.0}  # fmt: skip
    train(config.load(TINY_RECIPE, fast_overrides(out, **extra)))
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/arithmetic/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert all({"eval/arithmetic/maj@2", "eval/arithmetic/pass@2"} <= r.keys() for r in evals)
    assert all(0 <= r["eval/arithmetic/pass@1"] <= r["eval/arithmetic/pass@2"] for r in evals)


def test_in_training_eval_is_chunked_and_greedy_does_not_depend_on_the_chunks(tmp_path):
    """The transformers eval takes the planner's chunk size (fixed on CPU) and greedy decoding
    gives the same completions in chunks of 3 prompts as in one call."""
    from ebpo_lite.data.loader import encode_prompt
    from ebpo_lite.engine.run import build_run
    from ebpo_lite.model import plan
    from ebpo_lite.rollout.hf import HFRollout
    from ebpo_lite.train_eval import eval_sampler, evaluate_policy

    run = build_run(config.load(TINY_RECIPE, fast_overrides(tmp_path / "run")))
    cfg, policy = run.cfg, run.policy
    prompts = [encode_prompt(policy.tokenizer, ex, cfg.data) for ex in run.eval_examples]
    max_new = cfg.rollout.max_new_tokens
    sampler = eval_sampler(run, prompts, 1, max_new)
    assert isinstance(sampler, HFRollout) and sampler.micro_batch == plan.EVAL_CHUNK_CPU
    assert len(prompts) == 16
    one = HFRollout(cfg.rollout, policy, micro_batch=len(prompts))
    chunked = HFRollout(cfg.rollout, policy, micro_batch=3)
    kw = dict(seed=0, temperature=0.0, max_new_tokens=max_new)
    a, b = one.generate(prompts, 1, **kw), chunked.generate(prompts, 1, **kw)
    assert a.completion_ids == b.completion_ids and a.finished == b.finished
    texts = policy.tokenizer.batch_decode(a.completion_ids, skip_special_tokens=True)
    right = [t.strip() == ex.answer for t, ex in zip(texts, run.eval_examples)]
    ev = evaluate_policy(run)
    assert ev["eval/accuracy"] == pytest.approx(sum(right) / len(right))
    assert ev["time/eval_s"] > 0 and 0 < ev["eval/expected_accuracy"] < 1
