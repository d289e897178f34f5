"""Math answers judged with their extraction method: `judge_math` (scores, methods, answers).

`functions.math_answer` is the TRL-signature wrapper (`fn(completions, **columns)` -> scores);
eval calls `judge_math` itself because it also needs, per completion, which extraction produced
the score and the extracted answer that maj@k votes with.

Per completion (extraction rules in `extract.py`):
- `boxed` / `gsm8k_marker`: the answer is extracted here, in the trainer process (linear time).
  Integers on both sides are compared directly; anything else is verified by math-verify as
  `\\boxed{answer}` against `\\boxed{gold}`.
- `math_verify`: no box and no `####` number: the last `TAIL_CHARS` characters of the text go to
  math-verify's `parse(text)` (default `LatexExtractionConfig()` + `ExprExtractionConfig()`) and
  `verify` against the gold, both in a worker process under the per-answer time limit, so
  adversarial text can cost at most `timeout_s`. The answer is math-verify's extracted string.
- `none`: nothing to judge: an empty completion, or math-verify found no answer in the text, or
  it hit the time limit or failed (counted in `verify_pool.stats()`); the score is 0.0.

Scores: 1.0 / 0.0; None when the gold is unparsable (then the method and answer are still
reported). A verification that times out or crashes scores 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ebpo_lite.rewards import verify_pool
from ebpo_lite.rewards.extract import (
    EXTRACTION_METHODS,
    MATH_VERIFY,
    NO_ANSWER,
    TAIL_CHARS,
    canonical_int,
    clean_answer,
    completion_text,
    extract_answer_and_method,
    normalize_gold,
    verify_tail,
)

EXTRACTION = (
    "last balanced \\boxed{} (else the number after GSM8K's ####), else math-verify "
    f"parse(text[-{TAIL_CHARS}:]) (LatexExtractionConfig + ExprExtractionConfig)"
)


@dataclass(frozen=True)
class MathJudgement:
    """One entry per completion: score, extraction method (`EXTRACTION_METHODS`), answer."""

    scores: list[float | None]
    methods: list[str]
    answers: list[str | None]


def golds_for(answer: Any, n: int, fn: str) -> list[Any]:
    """One gold per completion; a single str / number is broadcast."""
    if isinstance(answer, (str, int, float)) or answer is None:
        return [answer] * n
    golds = list(answer)
    if len(golds) != n:
        raise ValueError(f"{fn}: got {n} completions but {len(golds)} answers")
    return golds


def judge_math(completions: Sequence[Any], answer: Any, timeout_s: float = 5.0) -> MathJudgement:
    """Score each completion against its gold and say how its answer was found (module doc)."""
    if timeout_s <= 0:
        raise ValueError(f"math_answer: timeout_s must be > 0, got {timeout_s}")
    n = len(completions)
    golds = golds_for(answer, n, "math_answer")
    scores: list[float | None] = [None] * n
    methods = [NO_ANSWER] * n
    answers: list[str | None] = [None] * n
    queue: dict[tuple[str, str, tuple[str, ...]], list[int]] = {}  # distinct item -> positions
    for i, (c, g) in enumerate(zip(completions, golds)):
        text = completion_text(c)
        gold = normalize_gold(g)
        pred, method = extract_answer_and_method(text)
        if method == MATH_VERIFY:
            if text.strip():
                queue.setdefault(("text", verify_tail(text), tuple(gold or ())), []).append(i)
            elif gold is not None:
                scores[i] = 0.0
            continue
        methods[i] = method
        pred = clean_answer(pred) if pred is not None else ""
        answers[i] = pred or None
        if gold is None:
            continue  # None: nothing to judge against
        if not pred:
            scores[i] = 0.0
            continue
        p_int, g_ints = canonical_int(pred), [canonical_int(x) for x in gold]
        if p_int is not None and all(x is not None for x in g_ints):
            scores[i] = 1.0 if p_int in g_ints else 0.0
            continue
        queue.setdefault(("boxed", pred, tuple(gold)), []).append(i)
    if queue:
        keys = list(queue)
        items = [(pred, list(gold), mode) for mode, pred, gold in keys]
        for key, (v, extracted) in zip(keys, verify_pool.judge_batch(items, timeout_s)):
            mode, _, gold = key
            score = v if v is None or isinstance(v, float) else 0.0  # "timeout" / "error" -> 0
            for i in queue[key]:
                scores[i] = score if gold else None
                if mode == "text":
                    methods[i] = MATH_VERIFY if extracted else NO_ANSWER
                    answers[i] = extracted
    return MathJudgement(scores, methods, answers)


def extraction_shares(methods: Sequence[str | None]) -> dict[str, float]:
    """{method: share of the completions} over `EXTRACTION_METHODS` (None entries skipped)."""
    known = [m for m in methods if m is not None]
    if not known:
        return {}
    return {m: sum(1 for x in known if x == m) / len(known) for m in EXTRACTION_METHODS}
