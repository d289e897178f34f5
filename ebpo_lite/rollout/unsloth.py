"""Sampling through Unsloth's vLLM engine, which shares the 4-bit base weights with the trainer.

CHECKED ONLY ON A GPU: Unsloth needs a CUDA GPU and pins its own transformers / trl versions, so
nothing here runs in this project's CPU CI. It is written against Unsloth's documented API:

    model, tokenizer = FastLanguageModel.from_pretrained(name, max_seq_length=..., dtype=...,
        load_in_4bit=True, fast_inference=True, max_lora_rank=..., gpu_memory_utilization=...)
    model = FastLanguageModel.get_peft_model(model, r=..., lora_alpha=..., target_modules=[...])
    model.save_lora(folder); request = model.load_lora(folder)      # a new LoRARequest id each time
    outputs = model.fast_generate(prompts, sampling_params=..., lora_request=request)

With `fast_inference=True` Unsloth starts one vLLM engine whose base weights ARE the trainer's (no
second copy of the base in GPU memory, the point of this backend), so the policy must be built by
Unsloth too: `load_unsloth_policy(cfg)` does that and returns an ordinary `Policy`, and
`UnslothRollout` refuses any other policy. Sync is still adapter-only, as in `rollout/vllm.py`:
the adapter is saved to a fresh folder (in /dev/shm when writable) and loaded under a new id.

Departures from `rollout/vllm.py`: no trainable base tensors (`model.trainable_extra` must be
empty: base weights are shared with vLLM, whose caches would go stale), no sleep / wake (Unsloth
manages the engine's memory itself), and `target_modules: [all-linear]` becomes the seven Llama /
Qwen projection names, since Unsloth wants explicit names. Unsloth builds the engine, so this
module cannot pin `logprobs_mode="processed_logprobs"` as `rollout/vllm.py` does: with vLLM's
default (`raw_logprobs`, the temperature-1 model) and rollout.temperature != 1 the sampler
log-probs are not the trainer's, and rollout/logp_diff_* shows that gap.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ebpo_lite.errors import ConfigError, UserError
from ebpo_lite.rollout.common import (
    Rollout,
    adapter_root,
    check_lengths,
    derive_max_model_len,
    maybe_warn_truncation,
    outputs_to_rollout,
    preserved_rng,
    round_lora_rank,
    sampling_params,
)

if TYPE_CHECKING:
    from ebpo_lite.config import Config
    from ebpo_lite.policy import Policy

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _import_unsloth():
    """(FastLanguageModel, SamplingParams), or a UserError saying what is missing."""
    try:
        has_cuda = torch.cuda.is_available()
    except Exception:  # a broken driver install
        has_cuda = False
    if not has_cuda:
        raise UserError(
            "rollout.backend=unsloth: needs a CUDA GPU (none is visible); use "
            "rollout.backend=vllm or hf"
        )
    try:
        from unsloth import FastLanguageModel  # must come before transformers' models
        from vllm import SamplingParams
    # unsloth raises NotImplementedError / RuntimeError at import too, not only ImportError
    except Exception as e:
        raise UserError(
            "rollout.backend=unsloth: unsloth (with vllm) is not importable "
            f"(pip install 'ebpo-lite[unsloth]'): {type(e).__name__}: {e}"
        ) from None
    return FastLanguageModel, SamplingParams


def load_unsloth_policy(cfg: Config, log: Callable[[str], None] = print) -> Policy:
    """Base (4-bit if model.load_in_4bit) + LoRA built by Unsloth, with its vLLM engine attached."""
    from ebpo_lite.device import resolve_device, resolve_dtype
    from ebpo_lite.policy import Policy

    FastLanguageModel, _ = _import_unsloth()
    m, r = cfg.model, cfg.rollout
    if m.trainable_extra:
        raise ConfigError(
            "model.trainable_extra: not supported with rollout.backend=unsloth "
            "(the base weights are shared with its vLLM engine); leave it empty"
        )
    base_path = m.name  # the tiny model: its warmed-up folder, as the other backends load it
    if m.name == "tiny":
        from ebpo_lite.tiny import warm_tiny_model

        base_path = str(warm_tiny_model(m.sft_warmup_steps, m.sft_seed, cfg.data.seed, log))
    device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, device)
    max_len = derive_max_model_len(
        cfg.data.max_prompt_tokens, r.max_new_tokens, None, r.max_model_len
    )
    rank = round_lora_rank(
        r.max_lora_rank or m.lora_rank,
        "rollout.max_lora_rank" if r.max_lora_rank else "model.lora_rank",
    )
    try:
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=base_path,
            max_seq_length=max_len,
            dtype=dtype,
            load_in_4bit=m.load_in_4bit,
            fast_inference=True,
            max_lora_rank=rank,
            gpu_memory_utilization=r.gpu_memory_utilization,
            random_state=cfg.train.seed,
        )
    except OSError as e:
        raise UserError(f"model.name: Unsloth cannot load {base_path!r} ({e})") from None
    targets = (
        ALL_LINEAR if list(m.lora_target_modules) == ["all-linear"] else list(m.lora_target_modules)
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=m.lora_rank,
        lora_alpha=m.lora_alpha,
        lora_dropout=m.lora_dropout,
        target_modules=targets,
        bias="none",
        random_state=cfg.train.seed,
        use_gradient_checkpointing="unsloth" if m.gradient_checkpointing else False,
    )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    log(
        f"Unsloth policy: {m.name} (4-bit: {m.load_in_4bit}), LoRA rank {m.lora_rank}, "
        "vLLM engine shares the base weights"
    )
    return Policy(model, tokenizer, device, m.name, m.lora_rank, [], dtype)


class UnslothRollout:
    """The `RolloutBackend` on the vLLM engine Unsloth attached to the policy (GPU only)."""

    def __init__(self, cfg: Config, policy: Policy, log: Callable[[str], None] = print):
        _import_unsloth()
        if not hasattr(policy.model, "fast_generate") or not hasattr(policy.model, "load_lora"):
            raise UserError(
                "rollout.backend=unsloth: the policy was not loaded by Unsloth with "
                "fast_inference=True (build it with "
                "ebpo_lite.rollout.unsloth.load_unsloth_policy)"
            )
        self.cfg = cfg
        self.policy = policy
        self.log = log
        r = cfg.rollout
        self.max_model_len = derive_max_model_len(
            cfg.data.max_prompt_tokens, r.max_new_tokens, None, r.max_model_len
        )
        maybe_warn_truncation(cfg)
        self.workdir = Path(tempfile.mkdtemp(prefix="ebpo_lite_unsloth_", dir=adapter_root()))
        self.lora_request: Any = None
        self.used_ids: list[int] = []
        self.sync(policy, version=0)

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> Rollout:
        """`group_size` completions per prompt, prompt-major, with sampled-token log-probs."""
        _, SamplingParams = _import_unsloth()
        max_tokens = max_new_tokens or self.cfg.rollout.max_new_tokens
        check_lengths(prompt_ids, max_tokens, self.max_model_len)
        params = sampling_params(
            SamplingParams,
            self.cfg.rollout,
            group_size,
            seed,
            len(prompt_ids),
            temperature,
            max_tokens,
            self.policy.stop_ids,
        )
        inputs = [{"prompt_token_ids": list(p)} for p in prompt_ids]  # vLLM's TokensPrompt
        with preserved_rng():
            outs = self.policy.model.fast_generate(
                inputs, sampling_params=params, lora_request=self.lora_request, use_tqdm=False
            )
        return outputs_to_rollout(prompt_ids, outs, self.policy.stop_ids)

    def sync(self, policy: Policy, version: int) -> None:
        """Save the adapter to a fresh folder and serve it under a new LoRARequest id."""
        folder = self.workdir / f"adapter-v{version}-{len(self.used_ids)}"
        policy.model.save_lora(str(folder))
        old, self.lora_request = self.lora_request, policy.model.load_lora(str(folder))
        if self.lora_request.lora_int_id in self.used_ids:
            raise RuntimeError(f"Unsloth reused LoRA id {self.lora_request.lora_int_id}")
        self.used_ids.append(self.lora_request.lora_int_id)
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def wake(self) -> None:
        """Nothing to do: Unsloth manages its engine's memory itself."""

    def sleep(self) -> None:
        """Nothing to do: Unsloth manages its engine's memory itself."""

    def close(self) -> None:
        """Delete the adapter folders; the engine belongs to the policy's model."""
        shutil.rmtree(self.workdir, ignore_errors=True)
