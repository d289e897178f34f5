"""Rewards: extraction, math-verify through the worker pool, time limits, combination."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest
import torch

from ebpo_lite import rewards
from ebpo_lite.rewards import (
    arithmetic_answer,
    combine_rewards,
    extract_answer,
    format_reward,
    get_reward_fn,
    length_penalty,
    math_answer,
    normalize_gold,
)
from tests.conftest import DATA

# MATH-500 problems whose own gold answer, written as \boxed{answer}, does not score 1.
# Measured with math-verify 0.9: none. A change in extraction or math-verify shows up here.
MATH500_SELF_EXCEPTIONS: set[str] = set()


def _jsonl(rel: str) -> list[dict]:
    path = DATA / rel
    if not path.is_file():
        pytest.skip(f"{path} absent: set EBPO_LITE_DATA to the math data folder")
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- extraction


def test_extract_answer_rules():
    assert extract_answer(r"so \boxed{1} no wait \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_answer(r"\fbox{7}") == "7"
    assert extract_answer(r"\boxed{\{1,2\}}") == r"\{1,2\}"  # escaped braces are not counted
    assert extract_answer(r"\boxed{3} then \boxed{unclosed") == "3"  # last balanced box
    assert extract_answer("Natalia sold 48+24 = 72 clips.\n#### 72\nextra 5") == "72"
    assert extract_answer("she pays #### $1,234.") == "1234"
    assert extract_answer("12 apples and 1,250 pears") is None  # math-verify's turn (issue 15)
    assert extract_answer("no digits at all") is None


def test_normalize_gold_forms():
    assert normalize_gold("Step... #### 2,125") == ["2125"]
    assert normalize_gold("025") == ["25"]
    assert normalize_gold(70) == ["70"]
    assert normalize_gold(27.0) == ["27"]
    assert normalize_gold(0.5) == ["0.5"]
    assert normalize_gold(["$(1,8,19), (2,7,13)$"]) == ["(1,8,19), (2,7,13)"]
    assert normalize_gold(r"\boxed{\frac{1}{2}}") == [r"\frac{1}{2}"]
    assert normalize_gold(None) is None
    assert normalize_gold("  ") is None
    assert normalize_gold(float("nan")) is None


# ----------------------------------------------------------------------------- math_answer


def test_math_answer_symbolic_equivalence():
    comps = [
        r"\boxed{\frac{1}{2}}",
        "the answer is 0.5",  # no box: math-verify's own extraction, checked against 1/2
        r"\boxed{[0, 1)}",
        r"\boxed{[0, 1]}",
        r"\boxed{\dfrac{\sqrt{2}}{2}}",
        r"\boxed{x^2+2x+1}",
        r"\boxed{3}",
        "no answer here",
    ]
    gold = [r"\frac12", "1/2", "[0,1)", "[0,1)", r"\frac{1}{\sqrt{2}}", "(x+1)^2", "4", "1"]
    assert math_answer(comps, gold) == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]


def test_math_answer_chat_messages_and_kwargs():
    msgs = [
        [{"role": "assistant", "content": r"thus \boxed{42}"}],
        [
            {"role": "user", "content": r"\boxed{42}"},
            {"role": "assistant", "content": [{"type": "text", "text": r"\boxed{41}"}]},
        ],
    ]
    out = math_answer(msgs, answer=["42", "42"], prompts=["a", "b"], problem=["p", "q"])
    assert out == [1.0, 0.0]


def test_math_answer_unjudgeable_gold_is_none_and_lengths_checked():
    assert math_answer([r"\boxed{1}", r"\boxed{1}"], [None, ""]) == [None, None]
    with pytest.raises(ValueError, match="2 completions but 3 answers"):
        math_answer(["a", "b"], ["1", "2", "3"])


def test_math500_gold_scores_one_against_itself():
    rows = _jsonl("math500/test.jsonl")
    t0 = time.time()
    out = math_answer(
        [f"So the answer is $\\boxed{{{r['answer']}}}$." for r in rows], [r["answer"] for r in rows]
    )
    elapsed = time.time() - t0
    failed = {r["unique_id"] for r, v in zip(rows, out) if v != 1.0}
    assert failed == MATH500_SELF_EXCEPTIONS
    assert len(rows) == 500 and sum(v == 1.0 for v in out) >= 495
    assert elapsed < 60, f"MATH-500 self-check took {elapsed:.1f}s"


def test_math500_other_problems_answers_score_zero():
    rows = _jsonl("math500/test.jsonl")
    rng = random.Random(0)
    pairs = []
    while len(pairs) < 100:
        i, j = rng.randrange(500), rng.randrange(500)
        a, b = rows[i]["answer"].strip(), rows[j]["answer"].strip()
        if a != b and normalize_gold(a) != normalize_gold(b):
            pairs.append((i, j))
    out = math_answer(
        [f"\\boxed{{{rows[j]['answer']}}}" for _, j in pairs], [rows[i]["answer"] for i, _ in pairs]
    )
    wrongly_right = [
        (rows[i]["unique_id"], rows[j]["answer"]) for (i, j), v in zip(pairs, out) if v
    ]
    assert wrongly_right == []
    assert all(v == 0.0 for v in out)


def test_gsm8k_gold_with_commas():
    rows = _jsonl("gsm8k/test.jsonl")
    with_commas = [r for r in rows if "," in r["answer"].split("####")[-1]]
    assert with_commas, "GSM8K test has answers with thousands separators"
    sample = with_commas[:10] + rows[:20]
    finals = [r["answer"].split("####")[-1].strip() for r in sample]
    # the model writes the plain number (no commas) after ####, or boxes the comma form
    comps = [f"... so\n#### {f.replace(',', '')}" for f in finals[:15]]
    comps += [f"\\boxed{{{f}}}" for f in finals[15:]]
    assert math_answer(comps, [r["answer"] for r in sample]) == [1.0] * len(sample)
    wrong = [f"#### {int(f.replace(',', '')) + 1}" for f in finals]
    assert math_answer(wrong, [r["answer"] for r in sample]) == [0.0] * len(sample)


def test_aime_both_files_zero_padded_and_int():
    padded = _jsonl("aime24/test.jsonl")
    ints = _jsonl("aime24/qwq_aime24.jsonl")
    assert any(r["answer"].startswith("0") for r in padded)
    comps = [f"\\boxed{{{int(r['answer'])}}}" for r in padded]
    assert math_answer(comps, [r["answer"] for r in padded]) == [1.0] * 30
    comps = [f"\\boxed{{{r['answer']}}}" for r in ints]
    assert math_answer(comps, [r["answer"] for r in ints]) == [1.0] * 30
    aime25 = _jsonl("aime25/test.jsonl")
    assert (
        math_answer([r"\boxed{070}"] + [r"\boxed{1000}"] * 29, [r["answer"] for r in aime25])
        == [1.0] + [0.0] * 29
    )


def test_amc_floats_and_olympiadbench_lists():
    amc = _jsonl("amc23/test.jsonl")
    assert all(isinstance(r["answer"], float) for r in amc)
    comps = [f"\\boxed{{{int(r['answer'])}}}" for r in amc]
    assert math_answer(comps, [r["answer"] for r in amc]) == [1.0] * len(amc)
    ob = _jsonl("olympiadbench/test.jsonl")[:60]
    comps = [f"\\boxed{{{r['final_answer'][0].replace('$', '')}}}" for r in ob]
    out = math_answer(comps, [r["final_answer"] for r in ob])
    assert sum(v == 1.0 for v in out) >= 58, [
        r["final_answer"] for r, v in zip(ob, out) if v != 1.0
    ]
    assert math_answer(
        [r"\boxed{(1,8,19),(2,7,13),(4,5,7)}", r"\boxed{(1,8,19)}"],
        [["$(1,8,19), (2,7,13), (4,5,7)$"]] * 2,
    ) == [1.0, 0.0]


# ----------------------------------------------------------------------------- time limits

ADVERSARIAL = {
    "power_tower": r"\boxed{9^{9^{9^{9}}}}",
    "huge_power": r"\boxed{10^{10^{10}}-1}",
    "huge_factorial": r"\boxed{(10^{8})!}",
    "nested_parens": r"\boxed{" + "(" * 900 + "1" + ")" * 900 + "}",
    "nested_frac": r"\boxed{" + r"\frac{1}{" * 100 + "2" + "}" * 100 + "}",
    "megabyte_box": r"\boxed{" + "1" * 10**6 + "}",
    "megabyte_opens": r"\boxed{" * 150_000,
    "megabyte_braces": "{" * 10**6,
    "megabyte_number": "9" * 10**6,
}


@pytest.fixture
def warm_pool():
    """Start the workers outside the timed part (a cold start imports sympy: 1-2 s)."""
    assert math_answer([r"\boxed{\frac{4}{2}}"], ["2"]) == [1.0]


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_output_returns_within_limit(name, warm_pool):
    timeout_s = 1.5
    t0 = time.time()
    out = math_answer([ADVERSARIAL[name]], ["5"], timeout_s=timeout_s)
    assert time.time() - t0 < timeout_s + 1.0
    assert out == [0.0]


def test_pool_recovers_after_timeout_and_counts_it(warm_pool):
    before = rewards.stats().get("timeouts", 0)
    t0 = time.time()
    out = math_answer(
        [ADVERSARIAL["power_tower"], r"\boxed{\frac{10}{2}}", r"\boxed{5}"],
        ["5", "5", "5"],
        timeout_s=1.0,
    )
    assert out == [0.0, 1.0, 1.0]
    assert time.time() - t0 < 1.0 + 1.0 + 1.0
    assert rewards.stats()["timeouts"] >= before + 1
    assert math_answer([r"\boxed{\sqrt{4}}"], ["2"]) == [1.0]  # still healthy


def test_stuck_worker_is_killed_and_replaced(warm_pool):
    """The trainer-side deadline: a worker that stops answering (here SIGSTOP) is replaced."""
    from ebpo_lite.rewards import verify_pool

    pool = verify_pool._POOL
    pids = [w.proc.pid for w in pool.workers]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    t0 = time.time()
    out = math_answer([r"\boxed{\frac{1}{3}}"], ["1/3"], timeout_s=0.5)
    assert out == [0.0]  # the trainer-side timeout scores 0
    assert time.time() - t0 < 0.5 + verify_pool.GRACE_S + 1.0
    assert all(w.proc.pid not in pids for w in pool.workers) or len(pool.workers) < len(pids)
    assert math_answer([r"\boxed{\frac{1}{3}}"], ["1/3"]) == [1.0]  # replacement works
    assert all(w.proc.pid not in pids for w in pool.workers)


def test_close_then_restart_and_call_from_thread():
    rewards.close()
    result: dict = {}

    def work():
        try:
            result["out"] = math_answer(
                [r"\boxed{\frac{6}{4}}", r"\boxed{1.5}", r"\boxed{2}"], ["3/2"] * 3
            )
        except Exception as e:  # pragma: no cover - reported by the assert below
            result["err"] = e

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert "err" not in result, result.get("err")
    assert result["out"] == [1.0, 1.0, 0.0]


# ----------------------------------------------------------------------------- other rewards


def test_arithmetic_answer_exact_integer():
    comps = ["19", " 19\n", "19.0", "018", "20", "x19", "", "-3"]
    gold = ["19", "19", "19", "18", "19", "19", "19", -3]
    assert arithmetic_answer(comps, gold) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert arithmetic_answer(["1"], ["1.5"]) == [None]


def test_format_reward():
    comps = [r"x \boxed{1}", r"\boxed{1} \boxed{2}", "no box", r"\boxed{\boxed{1}}", r"\boxed{1"]
    assert format_reward(comps) == [1.0, 0.0, 0.0, 0.0, 0.0]
    empty = [r"within \boxed{}.", r"\boxed{ $ }", r"so \boxed{ 7 }"]  # the prompt copied: no answer
    assert format_reward(empty) == [0.0, 0.0, 1.0]
    think = [
        "<think>try \\boxed{3}</think> so \\boxed{4}",
        "<think>hm</think> \\boxed{4}",
        "<think>hm \\boxed{4}",
        "\\boxed{4}",
    ]
    assert format_reward(think, think=True) == [1.0, 1.0, 0.0, 0.0]
    assert get_reward_fn("format_think")(think, answer=["4"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_length_penalty_dapo_ramp():
    # L_max = 100, L_0 = 80: 0 up to 80, linear to -coef at 100
    out = length_penalty([10, 80, 90, 95, 100], max_new_tokens=100, coef=0.5, start_frac=0.8)
    assert out == pytest.approx([0.0, 0.0, -0.25, -0.375, -0.5])
    t = length_penalty(torch.tensor([10, 90, 100]), 100, 0.5, 0.8)
    assert torch.allclose(t, torch.tensor([0.0, -0.25, -0.5]))
    assert length_penalty([99, 100], 100, 1.0, 1.0) == [0.0, -1.0]
    with pytest.raises(ValueError, match="start_frac"):
        length_penalty([1], 100, 1.0, 1.5)


def test_get_reward_fn_names_and_errors(tmp_path, monkeypatch):
    assert get_reward_fn("math_answer") is math_answer
    (tmp_path / "my_rewards.py").write_text(  # a TRL-style user function
        "def exact(completions, answer, **kwargs):\n"
        "    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_reward_fn("my_rewards:exact")(["1", "2"], answer=["1", "1"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="'nope'"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="no_such_module"):
        get_reward_fn("no_such_module:f")
    with pytest.raises(ValueError, match="has no callable"):
        get_reward_fn("my_rewards:missing")


def test_combine_rewards_weights_and_none():
    comps = ["19", "18", "7"]
    total, per = combine_rewards(
        ["arithmetic_answer", "format"], [1.0, 0.5], comps, answer=["19", "19", "x"]
    )
    assert per == {"arithmetic_answer": [1.0, 0.0, None], "format": [0.0, 0.0, 0.0]}
    assert total == [1.0, 0.0, None]
    total, _ = combine_rewards(
        {"a": arithmetic_answer, "f": format_reward}, [0.0, 1.0], comps, answer=["19", "19", "x"]
    )
    assert total == [0.0, 0.0, 0.0]  # zero weight: its None does not matter
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        combine_rewards(["format", "format"], [1.0], comps)
    with pytest.raises(ValueError, match="'bad'"):
        combine_rewards({"bad": lambda completions, **k: [1.0]}, None, comps)
