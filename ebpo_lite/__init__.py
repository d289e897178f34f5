"""ebpo_lite: single-GPU RL from verifiable rewards with EBPO (empirical-Bayes GRPO).

Importing the package is cheap and CPU-safe: vllm, bitsandbytes, unsloth, trl and verl are
imported only inside the modules that use them. The estimators live in `ebpo_lite.advantages`.
"""

__version__ = "0.1.0"
