"""ebpo_lite: single-GPU RL from verifiable rewards with EBPO (empirical-Bayes GRPO).

Importing the package is cheap and CPU-safe: vllm, bitsandbytes, unsloth, trl and verl are
imported only inside the modules that use them, and torch only with the first module or name
that needs it (the names below load on first use), so `ebpo-lite --help`, `recipes` and
`plan` start without it.

The Python API (docs/python.md): `load_config`, `train_run`, `evaluate`, `export_run` and
`TrainResult` (`ebpo_lite.api`); `Config` and its sections (`ebpo_lite.config`); the errors
they raise; the advantage estimators (`ebpo_lite.algo.advantages`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it, imported when the name is first used
_HOMES = {
    **dict.fromkeys(
        ("load_config", "train_run", "evaluate", "export_run", "resume_or_new", "TrainResult"),
        "api",
    ),
    **dict.fromkeys(
        (
            "Config",
            "ModelConfig",
            "DataConfig",
            "RolloutConfig",
            "AlgoConfig",
            "RewardConfig",
            "CurriculumConfig",
            "TrainConfig",
            "EvalConfig",
            "LogConfig",
        ),
        "config",
    ),
    **dict.fromkeys(("ConfigError", "UserError", "TrainingFault"), "errors"),
    **dict.fromkeys(
        (
            "EBPrior",
            "compute_advantages",
            "dr_grpo_advantages",
            "ebpo_advantages",
            "grpo_advantages",
            "rloo_advantages",
        ),
        "algo.advantages",
    ),
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    """`ebpo_lite.train_run`, `ebpo_lite.EBPrior` and the other names above, on first use."""
    if name in _HOMES:
        return getattr(importlib.import_module(f"ebpo_lite.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'ebpo_lite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
