"""Verifiable rewards: math answers (math-verify in a worker pool), the tiny arithmetic task,
format, the overlong length penalty, and the weighted combination of several reward functions.

All reward functions follow TRL's convention: `fn(completions, **columns) -> list[float | None]`;
`judge_math` is `math_answer` with, per completion, the extraction method (`boxed`,
`gsm8k_marker`, `math_verify`, `none`) and the extracted answer (`judge.py`, `extract.py`).
See `functions.py` for the choices made, `verify_pool.py` for the time limit design, and
`contained.py` for how user functions (`module:function`) run: in a worker process, where an
exception, a hang or a bad result masks the affected completions and is counted.
"""

from ebpo_lite.rewards.contained import ContainedReward, take_error_counts
from ebpo_lite.rewards.contained import close as close_contained
from ebpo_lite.rewards.extract import (
    EXTRACTION_METHODS,
    completion_text,
    extract_answer,
    normalize_gold,
)
from ebpo_lite.rewards.functions import (
    REWARD_FUNCTIONS,
    arithmetic_answer,
    check_columns,
    combine_rewards,
    default_reward_names,
    format_reward,
    format_think_reward,
    get_reward_fn,
    length_penalty,
    math_answer,
    reward_columns,
)
from ebpo_lite.rewards.judge import EXTRACTION, MathJudgement, extraction_shares, judge_math
from ebpo_lite.rewards.verify_pool import close, configure, stats

__all__ = [
    "EXTRACTION",
    "EXTRACTION_METHODS",
    "REWARD_FUNCTIONS",
    "ContainedReward",
    "MathJudgement",
    "arithmetic_answer",
    "check_columns",
    "close",
    "close_contained",
    "combine_rewards",
    "completion_text",
    "configure",
    "default_reward_names",
    "extract_answer",
    "extraction_shares",
    "format_reward",
    "format_think_reward",
    "get_reward_fn",
    "judge_math",
    "length_penalty",
    "math_answer",
    "reward_columns",
    "normalize_gold",
    "stats",
    "take_error_counts",
]
