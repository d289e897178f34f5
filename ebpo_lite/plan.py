"""GPU memory planner: will this recipe fit, and with which settings, before anything loads.

    python -m ebpo_lite.plan RECIPE.yaml [key=value ...] [--gpu NAME_OR_GIB] [--json FILE]

Prints a table of every component; `--json` writes them all (`policy_weights_gb`, `total_gb`, ...,
`fits`, `recommended_gpu_memory_utilization`, `recommended_micro_batch_size`, `advice`). Exit status:
0 fits, 1 does not fit on the named GPU (default 24 GiB), 2 a user error (one line on stderr).
All sizes are GiB (2^30 bytes), as `nvidia-smi` and `torch.cuda` report them.

The per-model arithmetic (weights, NF4, LoRA, activations, logits, KV cache) is in
`ebpo_lite.memory`, with its formulas and sources. This module adds it up for a recipe:
- trainer: frozen base (NF4 or 16-bit) + LoRA params, gradients (fp32) and AdamW states (2 x fp32)
  + activations and logits of one micro-batch (train.micro_batch_size sequences of
  data.max_prompt_tokens + rollout.max_new_tokens tokens: the worst case; logits only for the
  max_new_tokens + 1 completion positions, as `policy.completion_logprobs` asks for them, in the
  model's dtype with their gradient, plus one fp32 chunk of rows for the log-softmax);
- sampler: hf: transformers generate (up to 256 prompts x G sequences per call) holds their KV
  cache and, with output_logits, every generated step's fp32 logits [steps, sequences, V];
  vllm: its own base copy (NF4 when model.load_in_4bit, as vLLM's in-flight bitsandbytes
  quantisation, else 16-bit), LoRA buffers at max_lora_rank, KV cache for
  prompts_per_step x G x (prompt + completion) tokens in blocks of 16 (no prefix sharing counted)
  and a fixed overhead; unsloth: as vllm without a second base copy (it shares the trainer's).
  vLLM reserves gpu_memory_utilization x GPU memory; with fewer KV blocks than all sequences need
  it runs them in waves, so the least it needs is one group of G sequences;
- phases on the trainer's GPU: generation = contexts + trainer weights/LoRA/optimizer + vLLM's
  reservation when colocated; training = the same + activations + logits, with vLLM asleep
  (rollout.sleep_between_phases: it keeps VLLM_SLEEP_RESIDUAL_GIB) or still holding its
  reservation. A second GPU (rollout.device) holds only vLLM. The peak is the larger phase;
- overheads: a CUDA context per process and GPU, FRAGMENTATION x the trainer's allocations.
`total_gb` sums the peaks of all GPUs with every sequence in vLLM's KV cache at once;
`min_total_gb` with one group; `per_device_gb` with the recipe's gpu_memory_utilization on the
named GPU, which decides `fits`. `eval_chunk_prompts`: prompts per transformers `generate` call in
the held-out eval (eval.k samples each) that fit beside the trainer (`eval_sequence_bytes`; at run
time `eval_chunk_size` sizes it from the memory free then; on CPU a fixed EVAL_CHUNK_CPU). Not counted: the KL reference forward (no grad, below the
training peak), data, Python objects. The trainer's components are measured on CPU
(results/plan_vs_measured.md: within 20 % of torch's allocator); GPU-only assumptions, for
scripts/gpu_smoke.py (docs/gpu_check.md): CUDA_CONTEXT_GIB, FRAGMENTATION, VLLM_*, KV cache.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ebpo_lite import cli
from ebpo_lite.errors import UserError
from ebpo_lite.memory import (
    ASSUME_AUTOCAST,
    GIB,
    LOGPROB_CHUNK_BYTES,
    LOGPROB_CHUNK_COPIES,
    Arch,
    arch_for,
    arch_from_config,
    base_weight_bytes,
    eval_sequence_bytes,
    extra_trainable_count,
    kv_bytes_per_token,
    logits_bytes,
    lora_param_count,
    lora_targets,
    microbatch_bytes,
    param_counts,
)

CUDA_CONTEXT_GIB = 0.5  # per process and GPU: CUDA context + cuBLAS workspace, outside torch
FRAGMENTATION = 0.10  # caching-allocator slack on the trainer's allocations
VLLM_OVERHEAD_GIB = 1.0  # vLLM's profiling activation peak + sampler buffers (enforce_eager)
VLLM_CUDA_GRAPHS_GIB = 0.5  # extra when rollout.enforce_eager is false
VLLM_SLEEP_RESIDUAL_GIB = 0.5  # what a sleeping vLLM (level 1) still holds
UTIL_MARGIN = 0.05  # recommended gpu_memory_utilization: vLLM's need * (1 + margin)
SAFETY_GIB = 0.5  # left free on a GPU when recommending settings
KV_BLOCK_TOKENS = 16
HF_PROMPTS_PER_CALL = 256  # rollout/hf.py's micro_batch of prompts per generate call
EVAL_CHUNK_CPU = 64  # prompts per eval generate call on CPU, where memory is not the limit
EVAL_CHUNK_MAX = 256  # never more per call on a GPU either (padding waste, latency)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# name -> (label, GiB as nvidia-smi reports the card's memory, approximately)
GPUS = {
    "t4": ("Tesla T4 16GB", 15.0),
    "p100": ("Tesla P100 16GB", 15.9),
    "l4": ("NVIDIA L4 24GB", 22.5),
    "a10g": ("NVIDIA A10G 24GB", 22.5),
    "rtx3090": ("RTX 3090 24GB", 24.0),
    "rtx4090": ("RTX 4090 24GB", 24.0),
    "a10040gb": ("A100 40GB", 40.0),
    "a10080gb": ("A100 80GB", 80.0),
    "h100": ("H100 80GB", 79.6),
    "h200": ("H200 141GB", 140.4),
}
_GPU_ALIASES = {
    "3090": "rtx3090",
    "4090": "rtx4090",
    "a10040": "a10040gb",
    "a10080": "a10080gb",
    "h10080gb": "h100",
    "h200141gb": "h200",
    "t416gb": "t4",
    "p10016gb": "p100",
    "l424gb": "l4",
    "a10g24gb": "a10g",
}


# ----------------------------------------------------------------------------- the plan


def _dtype_bytes(name: str) -> int:
    return 4 if name == "float32" else 2  # auto plans for a GPU: bf16 or fp16


def _device(text: str, default: str) -> str:
    t = (text or "auto").strip().lower()
    return default if t == "auto" else "cuda:0" if t == "cuda" else t


def vllm_lora_rank(rank: int, max_lora_rank: int) -> int:
    """The rank vLLM's LoRA buffers are sized for (rollout.max_lora_rank, or r rounded up)."""
    return max_lora_rank or next((x for x in VLLM_LORA_RANKS if x >= rank), rank)


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS


@dataclass(frozen=True)
class _Layout:
    """Fixed sizes (GiB) and placement; `peaks` adds the parts that depend on settings."""

    trainer_dev: str
    sampler_dev: str
    colocated: bool  # vLLM / Unsloth on the trainer's GPU
    uses_vllm: bool
    sleep: bool
    static: float  # policy weights + LoRA + gradients + optimizer
    hf_gen: float  # transformers generate: KV cache + logits of all sequences

    def contexts(self) -> float:
        """The trainer's process (a colocated vLLM engine runs in-process: no second context)."""
        return CUDA_CONTEXT_GIB

    def phases(self, dynamic: float, reserved: float) -> tuple[float, float]:
        """(generation, training) peak on the trainer's GPU."""
        v_gen = reserved if self.colocated else 0.0
        v_train = (VLLM_SLEEP_RESIDUAL_GIB if self.sleep else reserved) if self.colocated else 0.0
        gen = self.contexts() + (self.static + self.hf_gen) * (1 + FRAGMENTATION) + v_gen
        train = self.contexts() + (self.static + dynamic) * (1 + FRAGMENTATION) + v_train
        return gen, train

    def peaks(self, dynamic: float, reserved: float) -> dict[str, float]:
        out = {self.trainer_dev: max(self.phases(dynamic, reserved))}
        if self.uses_vllm and not self.colocated:
            out[self.sampler_dev] = CUDA_CONTEXT_GIB + reserved
        return out


def _components(cfg: Any, arch: Arch) -> dict[str, Any]:
    """Every size the plan adds up (GiB), from the config and the architecture."""
    m, r, t = cfg.model, cfg.rollout, cfg.train
    a = _dtype_bytes(m.dtype)
    kv_b = _dtype_bytes(r.dtype if r.dtype != "auto" else m.dtype)
    targets = lora_targets(m.lora_target_modules)
    seq = cfg.data.max_prompt_tokens + r.max_new_tokens
    if arch.max_position_embeddings:  # no sequence outgrows the model's context
        seq = min(seq, arch.max_position_embeddings)
    n_seqs = t.prompts_per_step * r.group_size
    uses_vllm = r.backend in ("vllm", "unsloth")
    n_lora = lora_param_count(arch, m.lora_rank, targets)
    lora = n_lora * 4 / GIB
    kv_tok = kv_bytes_per_token(arch, kv_b)
    c = {
        "arch": arch,
        "a": a,
        "targets": targets,
        "seq": seq,
        "n_seqs": n_seqs,
        "attn": "sdpa" if m.attn_implementation == "auto" else m.attn_implementation,
        "logit_rows": r.max_new_tokens + 1,  # the policy keeps completion logits only
        "n_lora": n_lora,
        "n_extra": extra_trainable_count(arch, m.trainable_extra),
        "policy": base_weight_bytes(arch, m.load_in_4bit, a) / GIB,
        "lora": lora,
        "grads": lora,
        "adam": 2 * lora,
        "hf_gen": 0.0,
        "vllm_weights": 0.0,
        "vllm_lora": 0.0,
        "vllm_overhead": 0.0,
        "kv_seq": _blocks(seq) * kv_tok / GIB,
        "kv_longest": _blocks(r.max_model_len or seq) * kv_tok / GIB,
    }
    c["extra"] = c["n_extra"] * (a + 8) / GIB  # gradients in the weights' dtype + 2 fp32 states
    c["static"] = c["policy"] + c["lora"] + c["grads"] + c["adam"] + c["extra"]
    if r.backend == "hf":  # rollout/hf.py: up to 256 prompts x G per generate call, which
        # keeps every step's fp32 logits (output_logits) besides the KV cache
        n_gen = min(t.prompts_per_step, HF_PROMPTS_PER_CALL) * r.group_size
        logits_kept = n_gen * r.max_new_tokens * arch.vocab_size * 4
        c["hf_gen"] = (n_gen * seq * kv_bytes_per_token(arch, a) + logits_kept) / GIB
    if r.backend == "vllm":
        c["vllm_weights"] = base_weight_bytes(arch, m.load_in_4bit, kv_b) / GIB
    if uses_vllm:
        rank = vllm_lora_rank(m.lora_rank, r.max_lora_rank)
        c["vllm_lora"] = lora_param_count(arch, rank, targets) * kv_b / GIB
        c["vllm_overhead"] = VLLM_OVERHEAD_GIB + (0.0 if r.enforce_eager else VLLM_CUDA_GRAPHS_GIB)
    c["vllm_fixed"] = c["vllm_weights"] + c["vllm_lora"] + c["vllm_overhead"]
    trainer_dev = _device(m.device, "cuda:0")
    sampler_dev = _device(r.device, trainer_dev) if uses_vllm else trainer_dev
    c["layout"] = _Layout(
        trainer_dev=trainer_dev,
        sampler_dev=sampler_dev,
        colocated=uses_vllm and sampler_dev == trainer_dev,
        uses_vllm=uses_vllm,
        sleep=r.sleep_between_phases,
        static=c["static"],
        hf_gen=c["hf_gen"],
    )
    return c


def _dynamic(cfg: Any, c: dict[str, Any], micro_batch: int, checkpointing: bool) -> float:
    """Activations + logits of one micro-batch at their peak, GiB (`memory.microbatch_bytes`)."""
    shape = (c["targets"], micro_batch, c["seq"], micro_batch * c["logit_rows"], checkpointing)
    return microbatch_bytes(c["arch"], c["a"], cfg.model.lora_rank, *shape, c["attn"]) / GIB


def _best_micro_batch(
    cfg: Any, c: dict[str, Any], gpu_gb: float, checkpointing: bool, reserved: float
) -> int:
    """Largest power of two <= the sequences of a step whose training phase fits; 0: none."""
    p = 1 << (c["n_seqs"].bit_length() - 1)
    while p >= 1:
        if c["layout"].phases(_dynamic(cfg, c, p, checkpointing), reserved)[1] <= gpu_gb:
            return p
        p //= 2
    return 0


def _best_utilization(cfg: Any, c: dict[str, Any], gpu_gb: float, dynamic: float) -> float | None:
    """vLLM's need for all sequences at once (+ margin), capped by the room left; None: no room."""
    lay = c["layout"]
    if not lay.uses_vllm:
        return None
    if lay.colocated:
        gen0, train0 = lay.phases(dynamic, 0.0)
        room = gpu_gb - SAFETY_GIB - (gen0 if lay.sleep else max(gen0, train0))
    else:
        room = gpu_gb - SAFETY_GIB - CUDA_CONTEXT_GIB
    need = (c["vllm_fixed"] + c["n_seqs"] * c["kv_seq"]) * (1 + UTIL_MARGIN)
    util = min(math.floor(min(need, room) / gpu_gb * 100) / 100, 0.95)
    if util * gpu_gb < c["vllm_fixed"] + c["kv_longest"]:
        return None
    return util


def _advice(
    cfg: Any, c: dict[str, Any], p: dict[str, Any], gpu_gb: float, vllm_ok: bool
) -> list[str]:
    """What to change, plainly, when the recipe does not fit as written."""
    m, lay, out = cfg.model, c["layout"], []
    if lay.contexts() + c["static"] * (1 + FRAGMENTATION) > gpu_gb:
        if not m.load_in_4bit:
            out.append("set model.load_in_4bit=true (NF4 base)")
        out.append(
            f"the weights alone need {p['trainer_static_gb']:.1f} GiB: use a smaller model "
            "or a bigger GPU"
        )
        return out
    rec_mb, rec_util = p["recommended_micro_batch_size"], p["recommended_gpu_memory_utilization"]
    if lay.uses_vllm and rec_util is None:
        out.append(
            "vLLM cannot fit next to the trainer: use a smaller model, shorter sequences "
            "(rollout.max_new_tokens, data.max_prompt_tokens) or a second GPU "
            "(rollout.device=cuda:1)"
        )
    elif not vllm_ok:
        out.append(f"set rollout.gpu_memory_utilization={rec_util}")
    if rec_mb == 0:
        if not m.gradient_checkpointing and p["micro_batch_with_checkpointing"] > 0:
            out.append(
                "enable model.gradient_checkpointing (then train.micro_batch_size="
                f"{p['micro_batch_with_checkpointing']})"
            )
        else:
            out.append(
                "even one sequence does not train: shorten rollout.max_new_tokens or "
                "data.max_prompt_tokens, or use a smaller model"
            )
    elif rec_mb < p["micro_batch_size"]:
        out.append(f"lower train.micro_batch_size to {rec_mb}")
        if not m.gradient_checkpointing and p["micro_batch_with_checkpointing"] > rec_mb:
            out.append(
                "or enable model.gradient_checkpointing (then train.micro_batch_size="
                f"{p['micro_batch_with_checkpointing']})"
            )
    if cfg.rollout.backend == "hf" and lay.phases(0.0, 0.0)[0] > gpu_gb:
        out.append(
            "transformers generate holds all prompts x G sequences at once: lower "
            "train.prompts_per_step or use rollout.backend=vllm"
        )
    return out


def _vllm_ok(c: dict[str, Any], reserved: float, gpu_gb: float) -> bool:
    """vLLM's reservation holds its weights and one longest sequence, and fits beside the trainer."""
    lay = c["layout"]
    if not lay.uses_vllm:
        return True
    if reserved < c["vllm_fixed"] + c["kv_longest"]:
        return False
    return max(lay.peaks(0.0, reserved).values()) <= gpu_gb


def plan(cfg: Any, gpu_gb: float, gpu_name: str | None = None) -> dict[str, Any]:
    """Estimate the recipe's GPU memory on a GPU of `gpu_gb` GiB; see the module docstring."""
    arch = arch_for(cfg.model.name)
    c, m, r = _components(cfg, arch), cfg.model, cfg.rollout
    lay, n_seqs, seq = c["layout"], c["n_seqs"], c["seq"]
    mb = min(cfg.train.micro_batch_size, n_seqs)
    logits = logits_bytes(arch, mb * c["logit_rows"], c["a"]) / GIB
    act = {ck: _dynamic(cfg, c, mb, ck) - logits for ck in (False, True)}
    dyn = act[m.gradient_checkpointing] + logits
    kv_full = n_seqs * c["kv_seq"] if lay.uses_vllm else 0.0
    kv_min = min(r.group_size, n_seqs) * c["kv_seq"] if lay.uses_vllm else 0.0
    need_full = c["vllm_fixed"] + kv_full if lay.uses_vllm else 0.0
    need_min = c["vllm_fixed"] + kv_min if lay.uses_vllm else 0.0
    reserved = r.gpu_memory_utilization * gpu_gb if lay.uses_vllm else 0.0
    peaks = lay.peaks(dyn, reserved)
    vllm_ok = _vllm_ok(c, reserved, gpu_gb)
    gen, train = lay.phases(dyn, need_full)
    counts = param_counts(arch)
    concurrent = int((reserved - c["vllm_fixed"]) / c["kv_seq"]) if lay.uses_vllm else 0
    p: dict[str, Any] = {
        "model": arch.name,
        "gpu_name": gpu_name or f"{gpu_gb:g} GiB",
        "gpu_gb": gpu_gb,
        "backend": r.backend,
        "trainer_device": lay.trainer_dev,
        "sampler_device": lay.sampler_dev,
        "colocated": lay.colocated,
        "params_total": counts["total"],
        "params_linear": counts["linear"],
        "lora_params": c["n_lora"],
        "lora_targets": list(c["targets"]),
        "extra_trainable_params": c["n_extra"],
        "policy_weights_gb": c["policy"],
        "lora_params_gb": c["lora"],
        "lora_grads_gb": c["grads"],
        "optimizer_gb": c["adam"],
        "extra_trainable_gb": c["extra"],
        "trainer_static_gb": c["static"],
        "micro_batch_size": mb,
        "tokens_per_sequence": seq,
        "sequences_per_step": n_seqs,
        "attn_implementation": c["attn"],
        "activations_gb": act[m.gradient_checkpointing],
        "activations_no_checkpointing_gb": act[False],
        "activations_checkpointing_gb": act[True],
        "logits_gb": logits,
        "logit_rows": c["logit_rows"],
        "hf_generation_gb": c["hf_gen"],
        "vllm_weights_gb": c["vllm_weights"],
        "vllm_lora_gb": c["vllm_lora"],
        "vllm_overhead_gb": c["vllm_overhead"],
        "vllm_kv_cache_gb": kv_full,
        "vllm_kv_cache_min_gb": kv_min,
        "vllm_need_gb": need_full,
        "vllm_reserved_gb": reserved,
        "vllm_concurrent_sequences": max(0, min(n_seqs, concurrent)),
        "cuda_context_gb": lay.contexts() + (CUDA_CONTEXT_GIB if len(peaks) > 1 else 0.0),
        "fragmentation_gb": FRAGMENTATION * (c["static"] + max(dyn, c["hf_gen"])),
        "generation_phase_gb": gen,
        "training_phase_gb": train,
        "total_gb": sum(lay.peaks(dyn, need_full).values()),
        "min_total_gb": sum(lay.peaks(dyn, need_min).values()),
        "per_device_gb": peaks,
        "fits": vllm_ok and all(v <= gpu_gb for v in peaks.values()),
        "recommended_micro_batch_size": _best_micro_batch(
            cfg, c, gpu_gb, m.gradient_checkpointing, reserved
        ),
        "micro_batch_with_checkpointing": _best_micro_batch(cfg, c, gpu_gb, True, reserved),
        "recommended_gpu_memory_utilization": _best_utilization(cfg, c, gpu_gb, dyn),
        "assumptions": {
            "cuda_context_gib": CUDA_CONTEXT_GIB,
            "fragmentation": FRAGMENTATION,
            "vllm_overhead_gib": VLLM_OVERHEAD_GIB,
            "vllm_sleep_residual_gib": VLLM_SLEEP_RESIDUAL_GIB,
            "util_margin": UTIL_MARGIN,
            "safety_gib": SAFETY_GIB,
            "nf4": "blocksize 64, double quant",
            "autocast": ASSUME_AUTOCAST,
            "logprob_chunk_bytes": LOGPROB_CHUNK_BYTES,
            "logprob_chunk_fp32_copies": LOGPROB_CHUNK_COPIES,
        },
    }
    p["eval_chunk_prompts"] = _eval_chunk(cfg, c, gpu_gb, reserved)
    p["advice"] = [] if p["fits"] else _advice(cfg, c, p, gpu_gb, vllm_ok)
    return p


def _eval_chunk(cfg: Any, c: dict[str, Any], gpu_gb: float, reserved: float) -> int:
    """Prompts per transformers eval call (eval.k samples each) in the room the trainer's
    weights leave, vLLM asleep (or holding its reservation) when colocated."""
    lay = c["layout"]
    v = (VLLM_SLEEP_RESIDUAL_GIB if lay.sleep else reserved) if lay.colocated else 0.0
    room = gpu_gb - SAFETY_GIB - lay.contexts() - c["static"] * (1 + FRAGMENTATION) - v
    new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    budget = max(room, 0.0) * GIB / (1 + FRAGMENTATION)
    return eval_chunk_prompts(
        c["arch"], c["a"], cfg.data.max_prompt_tokens, new, cfg.eval.k, budget
    )


# ----------------------------------------------------------------------------- eval chunks


def eval_chunk_prompts(
    arch: Arch, a: int, prompt_tokens: int, new_tokens: int, k: int, budget_bytes: float
) -> int:
    """Prompts per eval `generate` call (k sequences each) that fit `budget_bytes`: in
    [1, EVAL_CHUNK_MAX]; 1 even when one prompt does not fit (the caller's OOM says so)."""
    per_prompt = k * eval_sequence_bytes(arch, a, prompt_tokens, new_tokens)
    return max(1, min(EVAL_CHUNK_MAX, int(budget_bytes // per_prompt)))


def eval_chunk_size(cfg: Any, policy: Any, k: int, prompt_tokens: int, new_tokens: int) -> int:
    """`eval_chunk_prompts` for the live policy: on CUDA the memory free now (plus what torch's
    allocator caches unused), less SAFETY_GIB and FRAGMENTATION; EVAL_CHUNK_CPU elsewhere."""
    import torch

    from ebpo_lite.device import cuda_memory_gib, resolve_dtype

    dev = policy.device
    mem = cuda_memory_gib(dev)
    if mem is None:
        return EVAL_CHUNK_CPU
    free, _, reserved = mem
    cached = reserved - torch.cuda.memory_allocated(dev) / GIB
    budget = (free + cached - SAFETY_GIB) * GIB / (1 + FRAGMENTATION)
    arch = arch_from_config(policy.model.config.to_dict(), cfg.model.name, "model config")
    a = resolve_dtype(cfg.model.dtype, dev).itemsize
    return eval_chunk_prompts(arch, a, prompt_tokens, new_tokens, k, budget)


# ----------------------------------------------------------------------------- CLI, preflight


def parse_gpu(text: str) -> tuple[str, float]:
    """A GPU name (T4, L4, A10G, RTX4090, A100-40GB, H100, ...) or a number of GiB."""
    try:
        gib = float(text)
    except ValueError:
        key = re.sub(r"[^a-z0-9]", "", text.lower())
        key = _GPU_ALIASES.get(key, key)
        if key not in GPUS:
            names = ", ".join(label.rsplit(" ", 1)[0] for label, _ in GPUS.values())
            raise UserError(
                f"--gpu: unknown GPU {text!r} (known: {names}; or a number of GiB)"
            ) from None
        return GPUS[key]
    if not gib > 0:
        raise UserError(f"--gpu: expected a positive number of GiB, got {text!r}")
    return f"{gib:g} GiB", gib


def format_table(p: dict[str, Any]) -> str:
    """The plan as plain text, one component per line (GiB)."""
    ck = "checkpointed" if p["activations_gb"] == p["activations_checkpointing_gb"] else "no ckpt"
    mb, seq = p["micro_batch_size"], p["tokens_per_sequence"]
    rows = [
        ("trainer", "policy weights (frozen base)", p["policy_weights_gb"]),
        ("trainer", f"LoRA parameters, {p['lora_params'] / 1e6:.1f} M fp32", p["lora_params_gb"]),
        ("trainer", "LoRA gradients (fp32)", p["lora_grads_gb"]),
        ("trainer", "AdamW states (2 x fp32)", p["optimizer_gb"]),
        ("trainer", "extra trainable (model.trainable_extra)", p["extra_trainable_gb"]),
        ("trainer", f"activations, {mb} x {seq} tokens ({ck})", p["activations_gb"]),
        (
            "",
            f"  with checkpointing {p['activations_checkpointing_gb']:.2f}, "
            f"without {p['activations_no_checkpointing_gb']:.2f}",
            None,
        ),
        ("trainer", f"logits + grad, {mb} x {p['logit_rows']} positions", p["logits_gb"]),
        ("trainer", "HF generate KV cache + logits", p["hf_generation_gb"]),
        ("vLLM", "base copy", p["vllm_weights_gb"]),
        ("vLLM", "LoRA buffers", p["vllm_lora_gb"]),
        ("vLLM", f"KV cache, {p['sequences_per_step']} x {seq} tokens", p["vllm_kv_cache_gb"]),
        ("vLLM", "profiling / sampler overhead", p["vllm_overhead_gb"]),
        ("overhead", "CUDA contexts", p["cuda_context_gb"]),
        ("overhead", "allocator fragmentation", p["fragmentation_gb"]),
        ("phase", "generation (trainer device)", p["generation_phase_gb"]),
        ("phase", "training (trainer device)", p["training_phase_gb"]),
        ("total", "all sequences at once", p["total_gb"]),
        ("total", "least (one group in the KV cache)", p["min_total_gb"]),
    ]
    lines = [
        f"model {p['model']}: {p['params_total'] / 1e9:.2f} B parameters "
        f"({p['params_linear'] / 1e9:.2f} B in linear layers); LoRA on {', '.join(p['lora_targets'])}",
        f"backend {p['backend']}: trainer on {p['trainer_device']}, sampler on "
        f"{p['sampler_device']}{' (colocated)' if p['colocated'] else ''}",
        f"{'part':<9} {'component':<46} {'GiB':>8}",
    ]
    for part, what, gib in rows:
        if gib is None:
            lines.append(f"{part:<9} {what}")
        elif gib or part in ("phase", "total") or what.startswith(("policy", "activ", "logits")):
            lines.append(f"{part:<9} {what:<46} {gib:8.2f}")
    used = ", ".join(f"{d} {v:.1f}" for d, v in p["per_device_gb"].items())
    lines.append(
        f"on {p['gpu_name']} ({p['gpu_gb']:g} GiB) as written: {used} GiB -> "
        + ("fits" if p["fits"] else "DOES NOT FIT")
    )
    if p["backend"] != "hf":
        lines.append(
            f"vLLM reserves {p['vllm_reserved_gb']:.1f} GiB: "
            f"{p['vllm_concurrent_sequences']} of {p['sequences_per_step']} sequences at once"
        )
    rec_mb = p["recommended_micro_batch_size"] or "none fits"
    rec_util = p["recommended_gpu_memory_utilization"]
    lines.append(
        f"transformers eval: {p['eval_chunk_prompts']} prompts per generate call "
        "(through vLLM when rollout.backend=vllm)"
    )
    rec = f"recommended: train.micro_batch_size={rec_mb}"
    if p["backend"] != "hf":
        rec += f", rollout.gpu_memory_utilization={rec_util or 'none fits'}"
    lines.append(rec)
    lines += [f"to fit: {a}" for a in p["advice"]]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print usage too)
        raise UserError(f"plan: {message}")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog=cli.prog("python -m ebpo_lite.plan"), description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--gpu", default="24", help="GPU name or GiB (default 24)")
    parser.add_argument("--json", help="write the plan as JSON to this file")
    try:
        args = parser.parse_intermixed_args(argv)
        from ebpo_lite import config

        cfg = config.load(args.recipe, args.overrides)
        name, gib = parse_gpu(args.gpu)
        p = plan(cfg, gib, name)
        print(format_table(p))
        if args.json:
            try:
                Path(args.json).write_text(json.dumps(p, indent=2) + "\n")
            except OSError as e:
                raise UserError(f"--json: cannot write {args.json} ({e.strerror})") from None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if p["fits"] else 1


def preflight(cfg: Any) -> None:
    """Refuse, before anything loads, a plan that cannot fit on the visible GPU(s); no-op on CPU."""
    from ebpo_lite.device import cuda_memory_gib, cuda_name, resolve_device

    dev = resolve_device(cfg.model.device)
    if dev.type != "cuda":
        return
    devices = [dev]
    if cfg.rollout.backend in ("vllm", "unsloth"):
        rdev = resolve_device(
            cfg.rollout.device if cfg.rollout.device != "auto" else str(dev), key="rollout.device"
        )
        devices += [rdev] if rdev != dev else []
    # usable: free memory (other processes count) + what this process already holds (its
    # context, and any weights loaded before this check), capped by the GPU's size
    mems = [cuda_memory_gib(d) for d in devices]
    gib = min(min(total, free + held + CUDA_CONTEXT_GIB) for free, total, held in mems)
    try:
        p = plan(cfg, gib, cuda_name(dev))
    except UserError as e:
        print(f"preflight: memory check skipped ({e})", file=sys.stderr)
        return
    if not p["fits"]:
        used = ", ".join(f"{d} {v:.1f}" for d, v in p["per_device_gb"].items())
        raise UserError(
            f"preflight: {p['model']} needs {used} GiB, {gib:.1f} GiB usable per GPU; "
            + "; ".join(p["advice"] or [f"see python -m ebpo_lite.plan RECIPE --gpu {gib:.0f}"])
        )


if __name__ == "__main__":
    sys.exit(main())
