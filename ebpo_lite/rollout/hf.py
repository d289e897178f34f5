"""Sampling with transformers `generate` on the trainer's own model (always available).

The sampler is the policy itself, so `sync` has nothing to do. Sampling is seeded per call inside
a forked RNG, so the trainer's global RNG stream (and hence exact resume) does not depend on it.
No sampler log-probs are returned (`sampler_logprobs=None`): this sampler is the trainer's own
model, so there is no mismatch to measure or correct, and keeping every step's logits would cost
[B*G, T, vocab] floats (about 40 GB for Qwen3-8B at 128 x 512 tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ebpo_lite.rollout.common import Rollout, cut_at_stop

if TYPE_CHECKING:
    from ebpo_lite.config import RolloutConfig
    from ebpo_lite.policy import Policy


class HFRollout:
    def __init__(self, cfg: RolloutConfig, policy: Policy, micro_batch: int = 256):
        self.cfg = cfg
        self.policy = policy
        self.micro_batch = micro_batch  # prompts per generate call

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> Rollout:
        out = Rollout(
            prompt_ids=list(prompt_ids), completion_ids=[], sampler_logprobs=None, finished=[]
        )
        for s in range(0, len(prompt_ids), self.micro_batch):
            part = self._generate(
                prompt_ids[s : s + self.micro_batch],
                group_size,
                seed + s,
                temperature,
                max_new_tokens,
            )
            out.completion_ids += part.completion_ids
            out.finished += part.finished
        return out

    @torch.no_grad()
    def _generate(self, prompt_ids, group_size, seed, temperature, max_new_tokens) -> Rollout:
        policy, cfg = self.policy, self.cfg
        tok, stops = policy.tokenizer, list(policy.stop_ids)
        temperature = cfg.temperature if temperature is None else temperature
        greedy = temperature == 0
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        kwargs = dict(
            max_new_tokens=max_new_tokens or cfg.max_new_tokens,
            num_return_sequences=group_size,
            eos_token_id=stops,  # every end-of-turn id, not only the tokenizer's eos
            pad_token_id=tok.pad_token_id,
            return_dict_in_generate=True,
        )
        if greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(
                do_sample=True,
                temperature=temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k or None,
                min_p=cfg.min_p or None,
            )
        was_training = policy.model.training
        policy.model.eval()
        devices = [policy.device] if policy.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            gen = policy.model.generate(
                input_ids=ids.to(policy.device), attention_mask=attn.to(policy.device), **kwargs
            )
        policy.model.train(was_training)
        new = gen.sequences[:, width:].cpu()  # [B*G, T]
        completions, finished = [], []
        for row in new.tolist():
            ids, done = cut_at_stop(row, stops)  # drops the padding after the stop id
            completions.append(ids)
            finished.append(done)
        return Rollout(list(prompt_ids), completions, None, finished)

    def sync(self, policy: Policy, version: int) -> None:
        """Nothing to push: this sampler is the trainer's model."""

    def wake(self) -> None:
        """Nothing to wake: generation uses the trainer's own memory."""

    def sleep(self) -> None:
        """Nothing to free (the KV cache of each `generate` call is gone when it returns)."""

    def close(self) -> None:
        """Nothing to free."""
