"""Sampling on the trainer's own model (always available): transformers `generate`, or
`rollout.hf_loop: lean`, a plain decode loop.

The lean loop runs one prefill per prompt, copies its KV cache to the prompt's G samples
(`DynamicCache.batch_repeat_interleave`) and then decodes all B * G rows one token at a time:
softmax(logits / T) with the same top-k, top-p and min-p filters as `generate` (`filter_logits`),
seeded `torch.multinomial`, argmax at temperature 0, stop at every stop id. It draws from the
same seeded stream as `generate` in the same row order, so for the same seed it returns the same
completions (all 512 of 512 in tests/test_lean_loop.py; a draw can differ only where round-off
between the two forward paths moves it across a boundary), and on a small model in about two
thirds of the time (0.049 s against 0.068 s per step of 256 completions, rewards included:
benchmarks/step_time_vs_trl.py): `generate`'s per-token machinery is much of the cost there. On a GPU with a real model the model dominates and
the two are alike; the fast sampler there is vLLM.

The sampler is the policy itself, so `sync` has nothing to do. Sampling is seeded per call inside
a forked RNG, so the trainer's global RNG stream (and hence exact resume) does not depend on it.
No sampler log-probs are returned (`sampler_logprobs=None`): this sampler is the trainer's own
model, so there is no mismatch to measure or correct, and keeping every step's logits would cost
[B*G, T, vocab] floats (about 40 GB for Qwen3-8B at 128 x 512 tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ebpo_lite.rollout.common import Rollout, budgets, cut_at_stop

if TYPE_CHECKING:
    from ebpo_lite.config import RolloutConfig
    from ebpo_lite.model.policy import Policy


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
        max_new_tokens: int | Sequence[int] | None = None,
    ) -> Rollout:
        out = Rollout(
            prompt_ids=list(prompt_ids), completion_ids=[], sampler_logprobs=None, finished=[]
        )
        limits = budgets(max_new_tokens, len(prompt_ids), self.cfg.max_new_tokens)
        for s in range(0, len(prompt_ids), self.micro_batch):
            part = self._generate(
                prompt_ids[s : s + self.micro_batch],
                group_size,
                seed + s,
                temperature,
                max(limits[s : s + self.micro_batch]),
            )
            for j, (ids, done) in enumerate(zip(part.completion_ids, part.finished)):
                limit = limits[s + j // group_size]  # a budget per prompt: the longest is drawn,
                if len(ids) > limit:  # each row keeps its own (the tokens before are the same)
                    ids, done = ids[:limit], False
                out.completion_ids.append(ids)
                out.finished.append(done)
        return out

    @torch.no_grad()
    def _generate(self, prompt_ids, group_size, seed, temperature, max_new_tokens) -> Rollout:
        if self.cfg.hf_loop == "lean":
            return self._lean(prompt_ids, group_size, seed, temperature, max_new_tokens)
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

    def _lean(self, prompt_ids, group_size, seed, temperature, max_new_tokens) -> Rollout:
        """The lean decode loop (module docstring): one prefill per prompt, then B * G rows."""
        policy, cfg = self.policy, self.cfg
        model, tok, dev = policy.model, policy.tokenizer, policy.device
        stops = list(policy.stop_ids)
        temperature = cfg.temperature if temperature is None else temperature
        max_new = max_new_tokens or cfg.max_new_tokens
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), tok.pad_token_id, dtype=torch.long)  # [B, P]
        attn = torch.zeros_like(ids)  # [B, P]
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        gen = torch.Generator(device=dev).manual_seed(seed)
        was_training = model.training
        model.eval()
        out = model(
            input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1
        )
        cache = out.past_key_values
        cache.batch_repeat_interleave(group_size)  # each prompt's KV for its G samples
        attn = attn.repeat_interleave(group_size, dim=0)  # [B*G, P]
        last = pos[:, -1].repeat_interleave(group_size, dim=0)  # [B*G]
        logits = out.logits[:, -1].float().repeat_interleave(group_size, dim=0)  # [B*G, V]
        stop_t = torch.tensor(stops, device=dev)
        done = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev)  # [B*G]
        steps = []
        for _ in range(max_new):
            if temperature == 0:
                nxt = logits.argmax(dim=-1)  # [B*G]
            else:
                z = filter_logits(logits / temperature, cfg.top_k, cfg.top_p, cfg.min_p)
                nxt = torch.multinomial(torch.softmax(z, dim=-1), 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)  # [B*G]
            steps.append(nxt)
            done |= torch.isin(nxt, stop_t)
            if bool(done.all()) or len(steps) == max_new:
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)  # [B*G, P + t]
            last = last + 1
            out = model(
                input_ids=nxt[:, None],
                attention_mask=attn,
                position_ids=last[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1].float()  # [B*G, V]
        model.train(was_training)
        completions, finished = [], []
        for row in torch.stack(steps, dim=1).cpu().tolist():  # [B*G, T]
            cut, stopped = cut_at_stop(row, stops)
            completions.append(cut)
            finished.append(stopped)
        return Rollout(list(prompt_ids), completions, None, finished)

    def sync(self, policy: Policy, version: int) -> None:
        """Nothing to push: this sampler is the trainer's model."""

    def wake(self) -> None:
        """Nothing to wake: generation uses the trainer's own memory."""

    def sleep(self) -> None:
        """Nothing to free (the KV cache of each `generate` call is gone when it returns)."""

    def close(self) -> None:
        """Nothing to free."""


def filter_logits(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """`generate`'s sampling filters on temperature-scaled logits z [N, V]: top-k (0 = off), then
    top-p (keep the smallest set of tokens whose probability reaches top_p, always the first),
    then min-p (drop tokens below min_p times the top probability). Dropped entries are -inf."""
    neg = torch.finfo(z.dtype).min
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]  # [N, 1]
        z = z.masked_fill(z < kth, neg)
    if top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)  # [N, V]
        cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
        drop_sorted = cum - sorted_z.softmax(dim=-1) >= top_p  # mass before this token >= p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)  # [N, V]
        z = z.masked_fill(drop, neg)
    if min_p > 0.0:
        probs = z.softmax(dim=-1)  # [N, V]
        z = z.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, neg)
    return z
