"""Issue 15: unboxed answers are extracted by math-verify itself, and every score says how.

The oracle is math-verify called directly on the same text: `verify(parse("\\boxed{gold}"),
parse(text))` with its default extraction (LatexExtractionConfig + ExprExtractionConfig).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import pytest

from ebpo_lite import rewards
from ebpo_lite.data.example import Example
from ebpo_lite.eval import eval_examples, majority_vote, summarize
from ebpo_lite.rewards import judge_math, math_answer
from ebpo_lite.rewards.extract import TAIL_CHARS, verify_tail

FILLER = "Let me think about this step by step. " * 200  # ~7.6 k characters, past TAIL_CHARS

# (completion text with no box and no ####, gold answer)
ORACLE_TABLE = [
    ("1/2", r"\frac{1}{2}"),  # the old failure: the last number was 2
    (r"\frac{1}{2}", "1/2"),
    ("√2/2", r"\frac{\sqrt{2}}{2}"),  # math-verify extracts nothing here: 0, as it judges it
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"),  # likewise (no $...$ around the LaTeX)
    (r"so the answer is $\sqrt{2}/2$", r"\frac{\sqrt{2}}{2}"),
    ("The answer is 0.5.", r"\frac{1}{2}"),
    ("x = 3", "3"),
    (r"Hence the value is $\frac{\sqrt{3}}{2}$", r"\frac{\sqrt{3}}{2}"),
    ("The answer is 5. Check: 5+1=6", "5"),  # the old last-number rule took 6
    ("We get 12 apples and 3 pears, in total 15", "15"),
    ("Therefore x = -2/3.", r"-\frac{2}{3}"),
    ("The final answer is $[0, 1)$", "[0,1)"),
    (r"Thus the polynomial is $x^2+2x+1$", "(x+1)^2"),
    ("answer: 7\nWait, let me recheck: 8", "7"),
    ("In total there are 1,250 pears.", "1250"),
    ("The answer is 1/3.", r"\frac{1}{2}"),  # wrong
    ("no answer here", "1"),
    (FILLER + "so the answer is 1/2", "0.5"),  # a long text: only the tail is read
]


def _oracle(text: str, gold: str) -> float:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    parsed_gold = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    return (
        1.0 if verify(parsed_gold, parse(text, parsing_timeout=None), timeout_seconds=None) else 0.0
    )


def test_unboxed_answers_judged_as_math_verify_judges_them():
    texts, golds = [t for t, _ in ORACLE_TABLE], [g for _, g in ORACLE_TABLE]
    j = judge_math(texts, golds, timeout_s=5.0)
    want = [_oracle(t, g) for t, g in ORACLE_TABLE]
    table = list(zip([t[-40:] for t in texts], golds, want, j.scores, j.methods, j.answers))
    assert j.scores == want, table
    assert math_answer(texts, golds) == want  # the TRL-signature wrapper: the same scores
    assert want[0] == 1.0 and want[2] == 0.0 and sum(want) >= 12  # what math-verify says
    for score, method, answer in zip(j.scores, j.methods, j.answers):
        assert method in ("math_verify", "none")
        assert (method == "math_verify") == (answer is not None)
        assert score == 0.0 or method == "math_verify"


def test_the_old_failure_is_fixed():
    """`1/2` unboxed used to score 0 (the last-number fallback took `2`)."""
    assert math_answer(["1/2", "so it is 1/2"], [r"\frac{1}{2}", "0.5"]) == [1.0, 1.0]
    j = judge_math(["The answer is 5. Check: 5+1=6"], ["6"])
    assert j.scores == [0.0] and j.methods == ["math_verify"] and j.answers == ["5"]


def test_boxed_and_marker_paths_are_kept():
    texts = [r"so \boxed{\frac{1}{2}}", "#### 1,234", r"\boxed{7}", "", "####"]
    j = judge_math(texts, ["0.5", "1234", "7", "1", "1"])
    assert j.scores == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert j.methods == ["boxed", "gsm8k_marker", "boxed", "none", "none"]
    assert j.answers == [r"\frac{1}{2}", "1234", "7", None, None]
    # an unparsable gold: no score, but the extraction is still reported
    j = judge_math([r"\boxed{3}", "x = 3"], [None, None])
    assert j.scores == [None, None] and j.methods == ["boxed", "math_verify"]
    assert j.answers == ["3", "3"]


def test_an_empty_box_is_no_answer():
    """SmolLM2-135M-Instruct copies the prompt's "within \\boxed{}." into its answers: an empty
    box was reported as a `boxed` extraction with no answer and hid the answer in the text."""
    texts = [r"35-8=27 \boxed{}", r"\boxed{27} and then \boxed{ $ }", r"Put it in \boxed{}."]
    j = judge_math(texts, ["27", "27", "27"])
    assert j.methods == ["math_verify", "boxed", "none"] and j.scores == [1.0, 1.0, 0.0]
    assert j.answers == ["27", "27", None]


def test_verify_tail_is_bounded_and_starts_at_a_line():
    assert verify_tail("short $x$") == "short $x$"
    text = "x" * 10_000 + "\nline one $a$\n" + "y" * (TAIL_CHARS - 200) + " 1/2"
    tail = verify_tail(text)
    assert len(tail) <= TAIL_CHARS and tail.startswith("line one") and tail.endswith("1/2")
    assert len(verify_tail("z" * 2_000_000)) == TAIL_CHARS  # no newline: a plain cut


@pytest.fixture
def warm_pool():
    assert math_answer(["x = 2"], ["2"]) == [1.0]  # workers up before the clock starts


ADVERSARIAL_UNBOXED = {
    "two_mb_text": "a" * 2_000_000 + " so x = 1/2",
    "two_mb_numbers": "1 " * 1_000_000,
    "two_mb_dollars": "$" * 2_000_000,
    "deep_parens": "(" * 1_000_000 + "1" + ")" * 1_000_000,
    "deep_frac": "$" + r"\frac{1}{" * 100_000 + "2" + "}" * 100_000 + "$",
    "deep_inline_parens": r"(\(" * 700_000,
    "deep_frac_in_tail": "$" + r"\frac{1}{" * 300 + "2" + "}" * 300 + "$",  # times out (1 s)
    "deep_sqrt_in_tail": "$" + r"\sqrt{" * 500 + "2" + "}" * 500 + "$",  # times out (1 s)
    "power_tower": r"so $9^{9^{9^{9}}}$",  # math-verify evaluates it: the time limit applies
}


@pytest.mark.parametrize("name", list(ADVERSARIAL_UNBOXED))
def test_adversarial_unboxed_text_stays_bounded(name, warm_pool):
    from ebpo_lite.rewards import verify_pool

    timeout_s = 1.0
    t0 = time.time()
    j = judge_math([ADVERSARIAL_UNBOXED[name]], ["5"], timeout_s=timeout_s)
    assert time.time() - t0 < timeout_s + verify_pool.GRACE_S + 1.0
    assert j.scores == [0.0] and j.methods[0] in ("math_verify", "none")


def test_power_tower_times_out_and_is_counted(warm_pool):
    before = rewards.stats().get("timeouts", 0)
    j = judge_math([ADVERSARIAL_UNBOXED["power_tower"], "x = 5"], ["5", "5"], timeout_s=1.0)
    assert j.scores == [0.0, 1.0] and j.methods == ["none", "math_verify"]
    assert rewards.stats()["timeouts"] == before + 1


# ----------------------------------------------------------------------------- eval records


@dataclass
class _Roll:
    completion_ids: list[list[int]]
    finished: list[bool]


class _Sampler:
    """Returns fixed completions (their ids index into `texts`)."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def generate(self, prompts, k, **kw):
        assert len(prompts) * k == len(self.texts)
        return _Roll([[i] for i in range(len(self.texts))], [True] * len(self.texts))

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.texts[i[0]] for i in ids]


def test_eval_records_carry_extraction_methods_and_shares():
    texts = [
        r"\boxed{\frac{1}{2}}", "so 1/2", "so 1/2", "nothing",  # problem 0, gold 1/2
        "#### 7", "x = 7", r"\boxed{8}", "",  # problem 1, gold 7
    ]  # fmt: skip
    fake = _Sampler(texts)
    exs = [Example(prompt="p0", answer=r"\frac{1}{2}"), Example(prompt="p1", answer="7")]
    recs = eval_examples(fake, fake, "math500", exs, [0, 1], [[1], [2]], 4, 0, 0.0, 8, 5.0)
    assert recs[0]["extraction"] == ["boxed", "math_verify", "math_verify", "none"]
    assert recs[1]["extraction"] == ["gsm8k_marker", "math_verify", "boxed", "none"]
    assert recs[0]["num_correct"] == 3 and recs[1]["num_correct"] == 2
    # maj@k votes with math-verify's extracted string for unboxed answers: "1/2" x2 wins
    assert recs[0]["answers"] == [r"\frac{1}{2}", "1/2", "1/2", None]
    assert recs[0]["maj_answer"] == "1/2" and recs[0]["maj_correct"] == 1.0
    assert majority_vote(recs[1]["answers"], [1.0, 1.0, 0.0, 0.0]) == ("7", 1.0)
    s = summarize(recs, 4)
    assert s["extraction/boxed"] == pytest.approx(2 / 8)
    assert s["extraction/math_verify"] == pytest.approx(3 / 8)
    assert s["extraction/gsm8k_marker"] == pytest.approx(1 / 8)
    assert s["extraction/none"] == pytest.approx(2 / 8)
    json.dumps(recs)  # the partial file's rows stay JSON
