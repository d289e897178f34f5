"""The loss menu's names and config checks, without torch (config.py validates with them).

TRL 1.16's `GRPOConfig.loss_type` values, which aggregation each uses, and the old `algo.loss_agg`
values as names of three of them. The math is in `loss_types.py` and `loss.py`; docs/losses.md
describes every key.
"""

from __future__ import annotations

from typing import Any

from ebpo_lite.errors import ConfigError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")  # the PPO clipped surrogate
# TRL 1.16 `_compute_loss`: grpo and sapo average each sequence's token mean; dr_grpo divides the
# sum by N * max_completion_length; dapo, cispo and vespo by the batch's valid tokens (bnpo by the
# micro-batch's, which here is the same: accumulation is exact); luspo averages sequence sums.
AGGREGATION = {
    "grpo": "seq_mean",
    "sapo": "seq_mean",
    "dr_grpo": "token_sum_norm",
    "dapo": "token_mean",
    "bnpo": "token_mean",
    "cispo": "token_mean",
    "vespo": "token_mean",
    "luspo": "seq_sum",
}
# `algo.loss_agg` (before the menu) -> the loss type it trains with while `algo.loss_type` is null
LOSS_AGG_ALIAS = {"token_mean": "dapo", "seq_mean": "grpo", "token_sum_norm": "dr_grpo"}
KL_ESTIMATORS = ("k1", "k2", "k3")


def loss_type_of(algo: Any) -> str:
    """The loss type a run trains with: `algo.loss_type`, or the one `algo.loss_agg` names."""
    return algo.loss_type or LOSS_AGG_ALIAS[algo.loss_agg]


def loss_options(algo: Any) -> dict:
    """`loss.policy_loss(options=...)` from an `AlgoConfig`: delta, SAPO's and VESPO's scalars."""
    return {
        "delta": algo.delta,
        "sapo_temperature_pos": algo.sapo_temperature_pos,
        "sapo_temperature_neg": algo.sapo_temperature_neg,
        "vespo": (algo.vespo_k_pos, algo.vespo_lambda_pos, algo.vespo_k_neg, algo.vespo_lambda_neg),
    }


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"algo.{key}: {msg}")


def _one_of(value: Any, choices, key: str) -> None:
    _check(value in choices, key, f"expected one of {', '.join(choices)}, got {value!r}")


def check_loss_keys(a: Any) -> None:
    """The loss keys of an `AlgoConfig` (`loss_agg` itself is checked first, by config.py)."""
    if a.loss_type is not None:
        _one_of(a.loss_type, LOSS_TYPES, "loss_type")
        own = AGGREGATION[a.loss_type]
        _check(
            a.loss_agg == "token_mean" or a.loss_agg == own,
            "loss_agg",
            f"{a.loss_agg} conflicts with algo.loss_type={a.loss_type}, which aggregates by "
            f"{own}; drop algo.loss_agg (loss_type sets the aggregation)",
        )
    kind = loss_type_of(a)
    _one_of(a.importance_sampling_level, ("token", "sequence"), "importance_sampling_level")
    _check(
        kind != "vespo" or a.importance_sampling_level == "token",
        "importance_sampling_level",
        "vespo computes its own sequence weight; leave it at token",
    )
    if a.delta is not None:
        _check(a.delta > 1, "delta", f"must be > 1 (TRL advises > 1 + eps), got {a.delta}")
        _check(
            kind in CLIPPED,
            "delta",
            f"caps the ratio of the clipped losses ({', '.join(CLIPPED)}), not of {kind}; "
            "set algo.delta=null",
        )
    q = a.top_entropy_quantile
    _check(0 <= q <= 1, "top_entropy_quantile", f"must be in [0, 1], got {q}")
    for key in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos"):
        _check(getattr(a, key) > 0, key, f"must be > 0, got {getattr(a, key)}")
    for key in ("vespo_lambda_neg", "vespo_k_pos", "vespo_k_neg"):
        _check(getattr(a, key) >= 0, key, f"must be >= 0, got {getattr(a, key)}")
    _one_of(a.kl_estimator, KL_ESTIMATORS, "kl_estimator")
