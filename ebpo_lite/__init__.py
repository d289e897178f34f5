"""ebpo_lite: single-GPU RL from verifiable rewards with EBPO (empirical-Bayes GRPO).

Importing the package is cheap and CPU-safe: vllm, bitsandbytes, unsloth, trl and verl are
imported only inside the modules that use them.
"""

from ebpo_lite.advantages import (
    EBPrior,
    compute_advantages,
    dr_grpo_advantages,
    ebpo_advantages,
    grpo_advantages,
    rloo_advantages,
)

__version__ = "0.1.0"
__all__ = [
    "EBPrior",
    "compute_advantages",
    "dr_grpo_advantages",
    "ebpo_advantages",
    "grpo_advantages",
    "rloo_advantages",
]
