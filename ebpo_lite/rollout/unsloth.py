"""Sampling through Unsloth's vLLM engine, which shares the 4-bit base weights with the trainer.

CHECKED ONLY ON A GPU: Unsloth needs a CUDA GPU and pins its own transformers / trl versions, so
Unsloth never runs in this project's CPU CI (tests/test_adapter_save_offline.py runs the code
around it with its loader faked). It is written against Unsloth's documented API and source:

    model, tokenizer = FastLanguageModel.from_pretrained(name, max_seq_length=..., dtype=...,
        load_in_4bit=True, fast_inference=True, max_lora_rank=..., gpu_memory_utilization=...)
    model = FastLanguageModel.get_peft_model(model, r=..., lora_alpha=..., target_modules=[...])
    model.save_lora(folder); request = model.load_lora(folder)      # a new LoRARequest id each time
    outputs = model.fast_generate(prompts, sampling_params=..., lora_request=request)

With `fast_inference=True` Unsloth starts one vLLM engine whose base weights ARE the trainer's (no
second copy of the base in GPU memory, the point of this backend), so the policy must be built by
Unsloth too: `load_unsloth_policy(cfg)` does that and returns an ordinary `Policy`, and
`UnslothRollout` refuses any other policy. Sync is still adapter-only, as in `rollout/vllm.py`:
the adapter is saved to a fresh folder (in /dev/shm when it has room, `common.adapter_workdir`)
and loaded under a new id, with no call to the hub (`save_embedding_layers=False`: see
`policy.Policy.export_adapter`).

Names: Unsloth swaps a hub id for its own repository (unsloth/models/loader_utils.py
`get_model_name` over mapper.py, 2026.10.9: in 4-bit `Qwen/Qwen3-8B` loads
`unsloth/Qwen3-8B-unsloth-bnb-4bit`, in 16-bit `unsloth/Qwen3-8B`); transformers records the id
it loaded as `name_or_path`. The policy's `base_path` and every adapter's
`base_model_name_or_path` (checkpoints, exports) name that base (`loaded_base`, `name_base`).
Load errors are one line (`load_error`), the 4-bit one with its fix.

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ebpo_lite.errors import ConfigError, UserError
from ebpo_lite.rollout.common import (
    Rollout,
    adapter_workdir,
    check_lengths,
    derive_max_model_len,
    exchange_bytes,
    maybe_warn_truncation,
    outputs_to_rollout,
    preserved_rng,
    round_lora_rank,
    sampling_params,
)

if TYPE_CHECKING:
    from ebpo_lite.config import Config
    from ebpo_lite.model.policy import Policy

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
        if _lacks_bnb(str(e)):
            raise load_error(e, "unsloth") from None
        raise UserError(
            "rollout.backend=unsloth: unsloth (with vllm) is not importable "
            f"(pip install 'ebpo-lite[unsloth]'): {type(e).__name__}: {_first_line(e)}"
        ) from None
    return FastLanguageModel, SamplingParams


# What a 4-bit Unsloth load raises when vLLM has no bitsandbytes method: unsloth_zoo
# vllm_utils.py `load_vllm` (2026.10.9) raises RuntimeError("Unsloth: vLLM >= 0.28 moved
# bitsandbytes out of tree. Install it with `pip install vllm-bnb-plugin` to use load_in_4bit
# with fast_inference."); vLLM itself, vllm/config/model.py (0.34): "Unknown quantization method:
# bitsandbytes. Must be one of ..."; an unsloth_zoo older than the move imports the in-tree
# module and fails with "No module named 'vllm.model_executor.layers.quantization.bitsandbytes'".
_NO_BNB = (
    "moved bitsandbytes out of tree",
    "Unknown quantization method: bitsandbytes",
    "quantization.bitsandbytes",
)
# What `from_pretrained` raises for a bad name, a missing package or too little memory
LOAD_ERRORS = (OSError, ValueError, RuntimeError, ImportError, NotImplementedError)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _lacks_bnb(text: str) -> bool:
    return any(marker in text for marker in _NO_BNB)


def load_error(e: BaseException, name: str) -> UserError:
    """One line for an exception Unsloth raised while loading `name`, with the fix when known."""
    if _lacks_bnb(str(e)):
        return UserError(
            "model.load_in_4bit: Unsloth's fast_inference samples the 4-bit base with vLLM's "
            "bitsandbytes method, which this vLLM lacks (vLLM >= 0.28 ships it as the "
            "vllm-bnb-plugin package, and an Unsloth older than that move cannot find it): "
            "pip install -U vllm-bnb-plugin unsloth unsloth_zoo, or set model.load_in_4bit=false"
        )
    why = f"{type(e).__name__}: {_first_line(e)}"
    return UserError(f"model.name: Unsloth cannot load {name!r} ({why})")


def loaded_base(model: Any, requested: str) -> str:
    """The base Unsloth really loaded (its own repository for a mapped hub id; see the module
    docstring): the model's `name_or_path`, else `requested`."""
    name = getattr(model, "name_or_path", None)
    name = name or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else requested


def name_base(model: Any, base: str) -> None:
    """Make every adapter of peft `model` record `base` as its `base_model_name_or_path`."""
    for adapter_cfg in getattr(model, "peft_config", {}).values():
        adapter_cfg.base_model_name_or_path = base


def load_unsloth_policy(cfg: Config, log: Callable[[str], None] = print) -> Policy:
    """Base (4-bit if model.load_in_4bit) + LoRA built by Unsloth, with its vLLM engine attached."""
    from ebpo_lite.model.base_model import resolve
    from ebpo_lite.model.device import resolve_device, resolve_dtype
    from ebpo_lite.model.policy import Policy

    FastLanguageModel, _ = _import_unsloth()
    m, r = cfg.model, cfg.rollout
    if m.trainable_extra:
        raise ConfigError(
            "model.trainable_extra: not supported with rollout.backend=unsloth "
            "(the base weights are shared with its vLLM engine); leave it empty"
        )
    base_path = resolve(cfg, log)  # tiny, smollm2, a .gguf: the folder the other backends load
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
    except LOAD_ERRORS as e:
        raise load_error(e, base_path) from None
    base = loaded_base(model, base_path)
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
    name_base(model, base)  # what checkpoints and exports name as the base
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded = f" (Unsloth loaded {base})" if base != base_path else ""
    log(
        f"Unsloth policy: {m.name}{loaded} (4-bit: {m.load_in_4bit}), LoRA rank {m.lora_rank}, "
        "vLLM engine shares the base weights"
    )
    return Policy(model, tokenizer, device, base, m.lora_rank, [], dtype)


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
        maybe_warn_truncation(r, cfg.algo)
        self.workdir = adapter_workdir("unsloth", exchange_bytes(policy), log)
        self.lora_request: Any = None
        self.used_ids: list[int] = []
        self.sync(policy, version=0)

    def generate(
        self,
        prompt_ids: list[list[int]],
        group_size: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | list[int] | None = None,
    ) -> Rollout:
        """`group_size` completions per prompt, prompt-major, with sampled-token log-probs;
        `max_new_tokens` one budget for all or one per prompt."""
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
        policy.model.save_lora(str(folder), save_embedding_layers=False)  # no hub call
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
