"""Reward functions in TRL's convention, their registry, and the weighted combination.

A reward function is called as `fn(completions=[...], **columns)` and returns one float (or None)
per completion. `completions` are strings or chat messages (lists of {"role", "content"} dicts);
dataset columns (`answer`, ...) arrive as keyword arguments and unknown ones are ignored, so our
functions work in TRL's GRPOTrainer and TRL-style user functions work here.

None means "cannot judge" (e.g. an unparsable gold answer). `combine_rewards` turns a None from
any reward with a nonzero weight into a None total, which the trainer masks out of the loss.

Decisions (documented departures / choices):
- `math_answer`: a verification that hits `timeout_s` or crashes the verifier scores 0.0 (the
  model produced something pathological; masking it would let it escape the penalty); counted in
  `verify_pool.stats()`. A completion with no extractable answer scores 0.0. Unboxed text is
  extracted by math-verify itself, in the worker (`judge.py`); `judge.judge_math` is the same
  scoring with the extraction method and the extracted answer per completion.
- `format_reward`: exactly one `\\boxed{` / `\\fbox{` opening, and it is balanced (a nested box
  counts twice, so scores 0.0).
- `length_penalty`: DAPO's overlong soft punishment, where `coef` is the penalty at the limit.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ebpo_lite.errors import ConfigError
from ebpo_lite.rewards.contained import ContainedReward
from ebpo_lite.rewards.extract import canonical_int, completion_text, count_boxes, last_boxed
from ebpo_lite.rewards.judge import golds_for, judge_math

RewardFn = Callable[..., list]
# what every call passes besides the data's columns (`run.Run.score`, `train_eval`);
# `environments` (TRL's): each episode's environment instance, with tool use (docs/tools.md)
CALL_KEYWORDS = ("completions", "prompts", "answer", "timeout_s", "environments")
_PLAIN_INT = re.compile(r"[+-]?\d+")


def math_answer(
    completions: Sequence[Any], answer: Any, timeout_s: float = 5.0, **kwargs: Any
) -> list[float | None]:
    """1.0 if the completion's final answer equals the gold answer (math-verify), else 0.0.

    The answer is the last `\\boxed{}`, else the number after GSM8K's `####`, else what
    math-verify's own `parse` extracts from the end of the text (see `judge.py`, which also says
    per completion which of these produced the score: `judge.judge_math`). Integers on both
    sides are compared directly; everything else goes through math-verify (symbolic equivalence:
    fractions, radicals, LaTeX, intervals, sets) in a worker process with a hard limit of
    `timeout_s` seconds per distinct (answer, gold) pair. None: gold unparsable.
    """
    return judge_math(completions, answer, timeout_s).scores


def arithmetic_answer(completions: Sequence[Any], answer: Any, **kwargs: Any) -> list[float | None]:
    """1.0 if the stripped completion is exactly the gold integer ("19" for "12+7="), else 0.0.

    No extraction: the tiny task's completion is the number and nothing else. A gold that is not
    an integer gives None.
    """
    n = len(completions)
    out: list[float | None] = []
    for c, g in zip(completions, golds_for(answer, n, "arithmetic_answer")):
        ok_type = isinstance(g, (str, int)) and not isinstance(g, bool)
        gold = canonical_int(str(g)) if ok_type and _PLAIN_INT.fullmatch(str(g).strip()) else None
        if gold is None:
            out.append(None)
            continue
        text = completion_text(c).strip()
        out.append(1.0 if _PLAIN_INT.fullmatch(text) and canonical_int(text) == gold else 0.0)
    return out


def format_reward(completions: Sequence[Any], think: bool = False, **kwargs: Any) -> list[float]:
    """1.0 if the completion holds exactly one balanced, non-empty `\\boxed{}` answer, else 0.0
    (an empty `\\boxed{}` is the prompt's instruction copied, as SmolLM2-135M does: no answer).

    With `think=True` the completion must also close its reasoning with exactly one `</think>`,
    and the box must come after it.
    """
    out = []
    for c in completions:
        text = completion_text(c)
        if think:
            if text.count("</think>") != 1:
                out.append(0.0)
                continue
            text = text.split("</think>", 1)[1]
        ok = count_boxes(text) == 1 and last_boxed(text) is not None
        out.append(1.0 if ok else 0.0)
    return out


def format_think_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """`format_reward` with `think=True` (registered as "format_think")."""
    kwargs.pop("think", None)
    return format_reward(completions, think=True, **kwargs)


def length_penalty(
    completion_lengths: Sequence[int] | Any, max_new_tokens: int, coef: float, start_frac: float
) -> list[float] | Any:
    """DAPO's soft overlong punishment, a non-positive amount to add to each reward.

    Notation: L_i completion length in tokens, L_max = max_new_tokens, L_0 = start_frac * L_max.
        p_i = -coef * clip((L_i - L_0) / (L_max - L_0), 0, 1)
    so p_i = 0 up to L_0, falls linearly, and is -coef at (and past) L_max, where a completion was
    truncated. DAPO uses coef = 1 and L_max - L_0 = 4096 of 20480 tokens (start_frac = 0.8).
    start_frac = 1 gives a step: -coef only for completions that reach L_max.
    A torch tensor in gives a tensor out (`# [N]`), anything else a list of floats.
    """
    if max_new_tokens < 1:
        raise ValueError(f"length_penalty: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0.0 <= start_frac <= 1.0:
        raise ValueError(f"length_penalty: start_frac must be in [0, 1], got {start_frac}")
    if coef < 0:
        raise ValueError(f"length_penalty: coef must be >= 0, got {coef}")
    l0 = start_frac * max_new_tokens
    span = max_new_tokens - l0

    def one(length: float) -> float:
        if span <= 0:
            return -coef if length >= max_new_tokens else 0.0
        return -coef * min(max((length - l0) / span, 0.0), 1.0)

    if hasattr(completion_lengths, "detach"):  # torch tensor
        lengths = completion_lengths.detach().float()  # [N]
        if span <= 0:
            return -coef * (lengths >= max_new_tokens).float()  # [N]
        return -coef * ((lengths - l0) / span).clamp(0.0, 1.0)  # [N]
    return [one(float(x)) for x in completion_lengths]


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "math_answer": math_answer,
    "arithmetic_answer": arithmetic_answer,
    "format": format_reward,
    "format_think": format_think_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name, or a user function given as "package.module:function".

    A user function is imported here (so a bad path fails at once) and returned as a
    `ContainedReward`: it runs in its own worker process, and its exceptions, hangs and bad
    results mask the affected completions instead of ending the run (see `contained.py`).
    """
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    known = ", ".join(REWARD_FUNCTIONS)
    if ":" not in name:
        raise ValueError(
            f"reward function {name!r}: unknown (expected one of {known}, or 'module:function')"
        )
    module_name, _, attr = name.partition(":")
    if module_name == "__main__":
        raise ValueError(
            f"reward function {name!r}: __main__ cannot be imported by its worker process; "
            "put the function in a module"
        )
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as e:
        raise ValueError(
            f"reward function {name!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); "
            "check the module is installed or on PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(
            f"reward function {name!r}: {module_name} has no callable {attr!r}; name a function "
            "defined in that module"
        )
    try:  # how the trainer calls it; a function that cannot take that would mask every score
        # (partial: a parameter it requires is a column it reads, checked against the data
        # once that has loaded: `check_columns`)
        inspect.signature(fn).bind_partial(**{k: [] for k in CALL_KEYWORDS})
    except TypeError as e:
        raise ValueError(
            f"reward function {name!r}: cannot be called as fn(completions, **columns) ({e}); "
            "define it with TRL's signature: def score(completions, **columns)"
        ) from None
    except ValueError:  # no signature to read (some builtins): its first call will tell
        pass
    return ContainedReward(name)


def columns_read(fn: RewardFn) -> list[str]:
    """The data columns `fn` reads by name: its parameters without a default, besides
    CALL_KEYWORDS (a `module:function` is read in its module; no signature: none known)."""
    if isinstance(fn, ContainedReward):
        module, _, attr = fn.target.partition(":")
        fn = getattr(importlib.import_module(module), attr)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in params
        if p.kind in named and p.default is p.empty and p.name not in CALL_KEYWORDS
    ]


def check_columns(fns: Sequence[tuple[str, RewardFn]], examples: Sequence[Any], what: str) -> None:
    """Every column a reward function reads (`columns_read`) is one `reward_columns` gives for
    `examples` (`what`: "the training data", ...), else one ConfigError before the model loads
    (TRL passes a dataset's columns the same way; a missing one was a TypeError per call)."""
    if not examples:  # no held-out data: nothing is scored
        return
    have = {"prompts", "answer"} | {k for ex in examples for k in ex.meta}
    for name, fn in fns:
        missing = [c for c in columns_read(fn) if c not in have]
        if missing:
            raise ConfigError(
                f"reward.functions: {name} reads {', '.join(map(repr, missing))}, which {what} "
                f"does not have (its columns: {', '.join(sorted(have))}; fields a preset reads "
                "and texts over 200 characters are not passed); add the field to every row, or "
                "give the parameter a default"
            )


def default_reward_names(data_name: str) -> list[str]:
    """What `reward.functions: [auto]` means: arithmetic_answer for the tiny task, else math."""
    return ["arithmetic_answer"] if data_name == "arithmetic" else ["math_answer"]


def _named(fns: Sequence[str | RewardFn] | Mapping[str, RewardFn]) -> list[tuple[str, RewardFn]]:
    if isinstance(fns, Mapping):
        return list(fns.items())
    out: list[tuple[str, RewardFn]] = []
    for f in fns:
        name = f if isinstance(f, str) else getattr(f, "__name__", type(f).__name__)
        fn = get_reward_fn(f) if isinstance(f, str) else f
        while name in dict(out):
            name += "_"
        out.append((name, fn))
    return out


def reward_columns(examples: Sequence[Any], repeat: int = 1) -> dict[str, list[Any]]:
    """The columns a reward function gets for completions of `examples`, `repeat` each in order:
    `prompts` (TRL's name), `answer`, and every field of the examples' `meta`."""
    columns: dict[str, list[Any]] = {
        "prompts": [ex.prompt for ex in examples for _ in range(repeat)],
        "answer": [ex.answer for ex in examples for _ in range(repeat)],
    }
    for key in sorted({k for ex in examples for k in ex.meta}):
        columns[key] = [ex.meta.get(key) for ex in examples for _ in range(repeat)]
    return columns


def combine_rewards(
    fns: Sequence[str | RewardFn] | Mapping[str, RewardFn],
    weights: Sequence[float] | None,
    completions: Sequence[Any],
    **columns: Any,
) -> tuple[list[float | None], dict[str, list[float | None]]]:
    """Weighted sum of several rewards: (total per completion, {reward name: its values}).

    `fns`: names (see `get_reward_fn`), callables, or a {name: callable} mapping. `weights`:
    one per function, None / empty = all 1.0. Each function gets `completions=` and `**columns`.
    A None from a function whose weight is nonzero makes that completion's total None.
    """
    named = _named(fns)
    w = list(weights) if weights else [1.0] * len(named)
    if len(w) != len(named):
        raise ValueError(f"combine_rewards: {len(named)} reward functions but {len(w)} weights")
    n = len(completions)
    per_fn: dict[str, list[float | None]] = {}
    for name, fn in named:
        values = fn(completions=completions, **columns)
        if values is None or len(values) != n:
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"reward function {name!r}: returned {got} for {n} completions")
        per_fn[name] = [None if v is None else float(v) for v in values]
    total: list[float | None] = []
    for i in range(n):
        parts = [(wj, per_fn[name][i]) for (name, _), wj in zip(named, w) if wj != 0]
        total.append(
            None if any(v is None for _, v in parts) else float(sum(wj * v for wj, v in parts))
        )
    return total, per_fn
