"""ebpo_lite: single-GPU RL from verifiable rewards with EBPO (empirical-Bayes GRPO).

Importing the package is cheap and CPU-safe: vllm, bitsandbytes, unsloth, trl and verl are
imported only inside the modules that use them, and torch only with the first module or name
that needs it (the estimators below load on first use), so `ebpo-lite --help`, `recipes` and
`plan` start without it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = [
    "EBPrior",
    "compute_advantages",
    "dr_grpo_advantages",
    "ebpo_advantages",
    "grpo_advantages",
    "rloo_advantages",
]


def __getattr__(name: str):
    """`ebpo_lite.EBPrior` and the other estimators, imported from `advantages` on first use."""
    if name in __all__:
        return getattr(importlib.import_module("ebpo_lite.advantages"), name)
    raise AttributeError(f"module 'ebpo_lite' has no attribute {name!r}")
