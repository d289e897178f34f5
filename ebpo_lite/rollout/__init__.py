"""The sampler seam: one Protocol, two backends.

`hf.py` samples with transformers `generate` (always available); `vllm.py` colocates an in-process
vLLM engine that receives only the LoRA adapter after each optimizer step (lazy import of vllm).

Layout of a `Rollout`: completions are flattened prompt-major, row `i * G + g` is the g-th
completion of prompt i, so rewards reshape to `[B, G]` without bookkeeping.

Stop ids: chat models end a turn with a token that is often not the tokenizer's `eos_token`
(Qwen3's `<|im_end|>`, Llama 3's `<|eot_id|>`); the model's `generation_config.eos_token_id`
lists them (an int or a list). `stop_token_ids` is the one place that reads them, and
`cut_at_stop` the one place that cuts a completion after the first of them: every sampler stops
on all of them and trims with it, so no completion (hence no completion mask) runs past the end of
the turn, and `finished` means "ended with a stop id". Both live, with `Rollout` and the other
engine-free helpers, in `rollout/common.py`, which every backend imports (and this module
re-exports); this module holds the Protocol and `make_backend`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ebpo_lite.model.base_model import stop_token_ids
from ebpo_lite.rollout.common import Rollout, cut_at_stop

__all__ = ["Rollout", "RolloutBackend", "cut_at_stop", "make_backend", "stop_token_ids"]

if TYPE_CHECKING:
    from ebpo_lite.config import Config
    from ebpo_lite.model.policy import Policy


class RolloutBackend(Protocol):
    """What the training loop needs from a sampler."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | Sequence[int] | None = None,
    ) -> Rollout:
        """Sample `group_size` completions per prompt with the current policy.

        `temperature` / `max_new_tokens` override the rollout config (the eval uses them;
        temperature 0 is greedy). `max_new_tokens` may be one budget per prompt (the multi-turn
        loop's continuations, `ebpo_lite.engine.episodes`: each episode has its own left).
        """
        ...

    def sync(self, policy: Policy, version: int) -> None:
        """Make the next `generate` use the policy's current weights (`version` increases)."""
        ...

    def wake(self) -> None:
        """Start a sampling phase (all rollout draws of a step, or all eval chunks): the engine's
        memory back if it was asleep. `generate` wakes it too, so callers outside the loop
        need neither call."""
        ...

    def sleep(self) -> None:
        """End a sampling phase before training: free the engine's memory until `wake`."""
        ...

    def close(self) -> None: ...


def make_backend(cfg: Config, policy: Policy) -> RolloutBackend:
    """Build the backend named by `rollout.backend`; heavy imports happen only here."""
    name = cfg.rollout.backend
    if name == "hf":
        from ebpo_lite.rollout.hf import HFRollout

        return HFRollout(cfg.rollout, policy)
    if name == "vllm":
        from ebpo_lite.rollout.vllm import VLLMRollout

        return VLLMRollout(cfg, policy)
    if name == "unsloth":
        from ebpo_lite.rollout.unsloth import UnslothRollout

        return UnslothRollout(cfg, policy)
    from ebpo_lite.errors import ConfigError

    raise ConfigError(f"rollout.backend: unknown backend {name!r} (expected hf, vllm or unsloth)")
