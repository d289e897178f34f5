"""Verifiable rewards: math answers (math-verify in a worker pool), the tiny arithmetic task,
format, the overlong length penalty, and the weighted combination of several reward functions.

All reward functions follow TRL's convention: `fn(completions, **columns) -> list[float | None]`.
See `functions.py` for the choices made, `verify_pool.py` for the time limit design, and
`contained.py` for how user functions (`module:function`) run: in a worker process, where an
exception, a hang or a bad result masks the affected completions and is counted.
"""

from ebpo_lite.rewards.contained import ContainedReward, take_error_counts
from ebpo_lite.rewards.contained import close as close_contained
from ebpo_lite.rewards.extract import completion_text, extract_answer, normalize_gold
from ebpo_lite.rewards.functions import (
    REWARD_FUNCTIONS,
    arithmetic_answer,
    combine_rewards,
    default_reward_names,
    format_reward,
    format_think_reward,
    get_reward_fn,
    length_penalty,
    math_answer,
)
from ebpo_lite.rewards.verify_pool import close, configure, stats

__all__ = [
    "REWARD_FUNCTIONS",
    "ContainedReward",
    "arithmetic_answer",
    "close",
    "close_contained",
    "combine_rewards",
    "completion_text",
    "configure",
    "default_reward_names",
    "extract_answer",
    "format_reward",
    "format_think_reward",
    "get_reward_fn",
    "length_penalty",
    "math_answer",
    "normalize_gold",
    "stats",
    "take_error_counts",
]
