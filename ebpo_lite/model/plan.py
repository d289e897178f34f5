"""GPU memory planner: will this recipe fit, and with which settings, before anything loads.

    ebpo-lite plan RECIPE.yaml [key=value ...] [--gpu NAME_OR_GIB] [--host-ram GIB] [--json FILE]

`--gpu` takes a card's name or its memory in GiB (`ebpo_lite.model.gpus`: `3090` is the card).

Prints a table of every component; `--json` writes them all (`policy_weights_gb`, `total_gb`, ...,
`fits`, `recommended_gpu_memory_utilization`, `recommended_micro_batch_size`, `advice`). Exit status:
0 fits, 1 does not fit on the named GPU (default 24 GiB) or host, 2 a user error (one line on stderr).
All sizes are GiB (2^30 bytes), as `nvidia-smi` and `torch.cuda` report them.

The per-model arithmetic (weights, NF4, LoRA, activations, logits, KV cache) is in
`ebpo_lite.model.memory`, with its formulas and sources. This module adds it up for a recipe:
- trainer: frozen base (NF4 or 16-bit) + LoRA params, gradients (fp32) and AdamW states (2 x fp32)
  + activations and logits of one micro-batch (train.micro_batch_size sequences of
  data.max_prompt_tokens + rollout.max_new_tokens tokens: the worst case; logits only for the
  max_new_tokens + 1 completion positions, as `policy.completion_logprobs` asks for them, in the
  model's dtype with their gradient, plus one fp32 chunk of rows for the log-softmax);
- sampler: hf: transformers generate (up to 256 prompts x G sequences per call) holds their KV
  cache and, with output_logits, every generated step's fp32 logits [steps, sequences, V];
  vllm: its own base copy (NF4 when model.load_in_4bit, in vLLM's layout: fp32 absmax, 0.5625
  bytes per parameter, else 16-bit), LoRA buffers at max_lora_rank, KV cache for
  prompts_per_step x G x (prompt + completion) tokens in blocks of 16 (no prefix sharing counted),
  its profiling peak at the max_num_seqs / max_num_batched_tokens rollout/vllm.py passes
  (`plan_vllm.vllm_batch_limits`) and memory outside torch; unsloth: one base, vLLM's, shared
  with the trainer (inside vLLM's reservation, not on the trainer's side), Unsloth's own
  max_num_seqs / max_num_batched_tokens, CUDA graphs. vLLM reserves ceil(total x
  gpu_memory_utilization) of the GPU, however much of it others hold; Unsloth first rescales the
  utilization to util x free / total, so its vLLM reserves util x the memory free at load
  (`plan_vllm`, with the upstream files read). With fewer KV blocks than all sequences need vLLM
  runs them in waves, so the least it needs is one group of G sequences;
- phases on the trainer's GPU: generation = contexts + trainer weights/LoRA/optimizer + vLLM's
  reservation when colocated; training = the same + activations + logits, with vLLM as
  rollout.sleep leaves it (vllm backend): offload keeps VLLM_SLEEP_RESIDUAL_GIB, kv its weights,
  LoRA buffers, graph pool and memory outside torch, none its whole reservation (always with
  unsloth: ebpo_lite never sleeps that engine). A
  second GPU (rollout.device) holds vLLM's child process (its context and reservation) and the
  context the trainer's process opens there when preflight reads its free memory. The peak is
  the larger phase;
- overheads: a CUDA context per process and GPU, FRAGMENTATION x the trainer's allocations;
- host RAM (`--host-ram`, default and preflight: this machine's): rollout.sleep=offload copies
  vLLM's weights each way a step (`sleep_copy_gb`, `sleep_copy_seconds`) and pins them for the
  run (`sleep_pinned_host_gb`, + HOST_PROCESS_GIB: `host_fits`; `fits` needs both; plan_vllm).
`total_gb` sums the peaks of all GPUs with every sequence in vLLM's KV cache at once;
`min_total_gb` with one group; `per_device_gb` with the recipe's gpu_memory_utilization on the
named GPU, which decides `fits` against `free_gb` (default: the whole GPU; preflight passes what
is free now).
`eval_chunk_prompts`: prompts per transformers `generate` call in the held-out eval (eval.k
samples each) that fit beside the trainer (`eval_sequence_bytes`; at run time `eval_chunk_size`
sizes it from the memory free then; on CPU a fixed EVAL_CHUNK_CPU). Not counted: the KL
reference forward (no grad, below the training peak), data, Python objects. The trainer's
components are measured on CPU (results/plan_vs_measured.md: within 20 % of torch's allocator);
every constant's basis (measured on CPU, read in upstream source, or assumed: nothing here has
run on a GPU yet) is in `plan_vllm.CONSTANTS`, in `--json` as `constants` and in the table's
last lines; scripts/gpu_smoke.py (docs/gpu_check.md) is the GPU check.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ebpo_lite import cli
from ebpo_lite.errors import UserError
from ebpo_lite.model.gpus import GPU_FORMS, machine_ram_gib, parse_gpu, parse_host_ram
from ebpo_lite.model.memory import (
    GIB,
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
from ebpo_lite.model.plan_vllm import (
    CONSTANTS,
    CUDA_CONTEXT_GIB,
    FRAGMENTATION,
    HOST_PROCESS_GIB,
    KV_BLOCK_TOKENS,
    SAFETY_GIB,
    UTIL_MARGIN,
    VLLM_CUDA_GRAPHS_GIB,
    VLLM_NON_TORCH_GIB,
    Layout,
    constants_by_basis,
    host_advice,
    sampler_components,
    sleep_copy_seconds,
    sleep_costs,
    sleep_line,
)

HF_PROMPTS_PER_CALL = 256  # rollout/hf.py's micro_batch of prompts per generate call
EVAL_CHUNK_CPU = 64  # prompts per eval generate call on CPU, where memory is not the limit
EVAL_CHUNK_MAX = 256  # never more per call on a GPU either (padding waste, latency)

# ----------------------------------------------------------------------------- the plan


def _dtype_bytes(name: str) -> int:
    return 4 if name == "float32" else 2  # auto plans for a GPU: bf16 or fp16


def _device(text: str, default: str) -> str:
    t = (text or "auto").strip().lower()
    return default if t == "auto" else "cuda:0" if t == "cuda" else t


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS


def _components(cfg: Any, arch: Arch, total: float, free: float) -> dict[str, Any]:
    """Every size the plan adds up (GiB), from the config, the architecture and the GPU."""
    m, r, t = cfg.model, cfg.rollout, cfg.train
    a = _dtype_bytes(m.dtype)
    kv_b = _dtype_bytes(r.dtype if r.dtype != "auto" else m.dtype)
    targets = lora_targets(m.lora_target_modules)
    seq = cfg.data.max_prompt_tokens + r.max_new_tokens
    if arch.max_position_embeddings:  # no sequence outgrows the model's context
        seq = min(seq, arch.max_position_embeddings)
    n_seqs = t.prompts_per_step * r.group_size
    uses_vllm, unsloth = r.backend in ("vllm", "unsloth"), r.backend == "unsloth"
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
        # Unsloth's trainer holds vLLM's tensors, in vLLM's NF4 layout
        "policy": base_weight_bytes(arch, m.load_in_4bit, a, fp32_absmax=unsloth) / GIB,
        "lora": lora,
        "grads": lora,
        "adam": 2 * lora,
        "hf_gen": 0.0,
        "vllm_weights": 0.0,
        "vllm_lora": 0.0,
        "vllm_overhead": 0.0,
        "limits": (0, 0),
        "reserved": 0.0,
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
        c["vllm_weights"] = base_weight_bytes(arch, m.load_in_4bit, kv_b, fp32_absmax=True) / GIB
    elif unsloth:
        c["vllm_weights"] = c["policy"]  # the one base, inside vLLM's reservation
    if uses_vllm:
        sampler_components(cfg, c, total, free, kv_b)
    c["vllm_fixed"] = c["vllm_weights"] + c["vllm_lora"] + c["vllm_overhead"]
    c["vllm_graphs"] = VLLM_CUDA_GRAPHS_GIB if c.get("graphs") else 0.0
    trainer_dev = _device(m.device, "cuda:0")
    sampler_dev = _device(r.device, trainer_dev) if uses_vllm else trainer_dev
    c["layout"] = Layout(
        trainer_dev=trainer_dev,
        sampler_dev=sampler_dev,
        colocated=uses_vllm and sampler_dev == trainer_dev,
        uses_vllm=uses_vllm,
        sleep=r.sleep if r.backend == "vllm" else "none",
        kv_kept=c["vllm_weights"] + c["vllm_lora"] + c["vllm_graphs"] + VLLM_NON_TORCH_GIB,
        static=c["static"] - (c["policy"] if unsloth else 0.0),
        hf_gen=c["hf_gen"],
    )
    sleep_costs(cfg, c, arch, kv_b)
    return c


def _dynamic(cfg: Any, c: dict[str, Any], micro_batch: int, checkpointing: bool) -> float:
    """Activations + logits of one micro-batch at their peak, GiB (`memory.microbatch_bytes`)."""
    shape = (c["targets"], micro_batch, c["seq"], micro_batch * c["logit_rows"], checkpointing)
    return microbatch_bytes(c["arch"], c["a"], cfg.model.lora_rank, *shape, c["attn"]) / GIB


def _best_micro_batch(
    cfg: Any, c: dict[str, Any], cap: float, checkpointing: bool, reserved: float
) -> int:
    """Largest power of two <= the sequences of a step whose training phase fits; 0: none."""
    p = 1 << (c["n_seqs"].bit_length() - 1)
    while p >= 1:
        if c["layout"].phases(_dynamic(cfg, c, p, checkpointing), reserved)[1] <= cap:
            return p
        p //= 2
    return 0


def _best_utilization(c: dict[str, Any], total: float, cap: float, dynamic: float) -> float | None:
    """vLLM's need for all sequences at once (+ margin), capped by the room left, as the
    utilization to set (Unsloth's: a share of the memory free at load); None: no room."""
    lay = c["layout"]
    if not lay.uses_vllm:
        return None
    if lay.colocated:
        gen0, train0 = lay.phases(dynamic, 0.0)
        room = cap - SAFETY_GIB - (gen0 if lay.sleep != "none" else max(gen0, train0))
    else:
        room = cap - SAFETY_GIB - lay.sampler_contexts()
    need = (c["vllm_fixed"] + c["n_seqs"] * c["kv_seq"]) * (1 + UTIL_MARGIN)
    base = c.get("at_load", total)
    util = min(math.floor(min(need, room) / base * 100) / 100, 0.95)
    if util * base < c["vllm_fixed"] + c["kv_longest"]:
        return None
    return util


def _advice(cfg: Any, c: dict[str, Any], p: dict[str, Any], cap: float, vllm_ok: bool) -> list[str]:
    """What to change, plainly, when the recipe does not fit as written."""
    m, lay, out = cfg.model, c["layout"], []
    if lay.contexts() + c["static"] * (1 + FRAGMENTATION) > cap:
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
    if cfg.rollout.backend == "hf" and lay.phases(0.0, 0.0)[0] > cap:
        out.append(
            "transformers generate holds all prompts x G sequences at once: lower "
            "train.prompts_per_step or use rollout.backend=vllm"
        )
    return out


def _vllm_ok(c: dict[str, Any], reserved: float, cap: float) -> bool:
    """vLLM's reservation holds its weights and one longest sequence, and fits beside the trainer."""
    lay = c["layout"]
    if not lay.uses_vllm:
        return True
    if reserved < c["vllm_fixed"] + c["kv_longest"]:
        return False
    return max(lay.peaks(0.0, reserved).values()) <= cap


def plan(
    cfg: Any,
    gpu_gb: float,
    gpu_name: str | None = None,
    free_gb: float | None = None,
    host_gb: float | None = None,
) -> dict[str, Any]:
    """Estimate the recipe's GPU memory on a GPU of `gpu_gb` GiB of which `free_gb` (default:
    all) is this run's to use, and its host RAM against `host_gb` (None: not checked); see the
    module docstring."""
    arch = arch_for(cfg.model.name)
    cap = gpu_gb if free_gb is None else min(free_gb, gpu_gb)
    c, m, r = _components(cfg, arch, gpu_gb, cap), cfg.model, cfg.rollout
    lay, n_seqs, seq = c["layout"], c["n_seqs"], c["seq"]
    mb = min(cfg.train.micro_batch_size, n_seqs)
    logits = logits_bytes(arch, mb * c["logit_rows"], c["a"]) / GIB
    act = {ck: _dynamic(cfg, c, mb, ck) - logits for ck in (False, True)}
    dyn = act[m.gradient_checkpointing] + logits
    kv_full = n_seqs * c["kv_seq"] if lay.uses_vllm else 0.0
    kv_min = min(r.group_size, n_seqs) * c["kv_seq"] if lay.uses_vllm else 0.0
    need_full = c["vllm_fixed"] + kv_full if lay.uses_vllm else 0.0
    need_min = c["vllm_fixed"] + kv_min if lay.uses_vllm else 0.0
    reserved = c["reserved"]
    peaks = lay.peaks(dyn, reserved)
    vllm_ok = _vllm_ok(c, reserved, cap)
    gen, train = lay.phases(dyn, need_full)
    counts = param_counts(arch)
    concurrent = int((reserved - c["vllm_fixed"]) / c["kv_seq"]) if lay.uses_vllm else 0
    p: dict[str, Any] = {
        "model": arch.name,
        "gpu_name": gpu_name or f"{gpu_gb:g} GiB",
        "gpu_gb": gpu_gb,
        "gpu_free_gb": cap,
        "backend": r.backend,
        "trainer_device": lay.trainer_dev,
        "sampler_device": lay.sampler_dev,
        "colocated": lay.colocated,
        "vllm_shares_base": r.backend == "unsloth",
        "vllm_sleeps": lay.sleep != "none",
        "vllm_sleep": lay.sleep,
        "sleep_copy_gb": c["sleep_copy"],
        "sleep_copy_seconds": sleep_copy_seconds(c["sleep_copy"] * GIB),
        "sleep_pinned_host_gb": c["sleep_pinned"],
        "host_need_gb": HOST_PROCESS_GIB + c["sleep_pinned"],
        "host_gb": host_gb,
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
        "vllm_max_num_seqs": c["limits"][0],
        "vllm_max_num_batched_tokens": c["limits"][1],
        "vllm_kv_cache_gb": kv_full,
        "vllm_kv_cache_min_gb": kv_min,
        "vllm_need_gb": need_full,
        "vllm_reserved_gb": reserved,
        "vllm_concurrent_sequences": max(0, min(n_seqs, concurrent, c["limits"][0])),
        "cuda_context_gb": lay.contexts() + lay.sampler_contexts(),
        "fragmentation_gb": FRAGMENTATION * (lay.static + max(dyn, c["hf_gen"])),
        "generation_phase_gb": gen,
        "training_phase_gb": train,
        "total_gb": sum(lay.peaks(dyn, need_full).values()),
        "min_total_gb": sum(lay.peaks(dyn, need_min).values()),
        "per_device_gb": peaks,
        "gpu_fits": vllm_ok and all(v <= cap for v in peaks.values()),
        "recommended_micro_batch_size": _best_micro_batch(
            cfg, c, cap, m.gradient_checkpointing, reserved
        ),
        "micro_batch_with_checkpointing": _best_micro_batch(cfg, c, cap, True, reserved),
        "recommended_gpu_memory_utilization": _best_utilization(c, gpu_gb, cap, dyn),
        "constants": {
            k: {"value": v, "basis": b, "source": s} for k, (v, b, s) in CONSTANTS.items()
        },
    }
    p["host_fits"] = host_gb is None or p["host_need_gb"] <= host_gb
    p["fits"] = p["gpu_fits"] and p["host_fits"]
    p["eval_chunk_prompts"] = _eval_chunk(cfg, c, cap, reserved)
    p["advice"] = [] if p["gpu_fits"] else _advice(cfg, c, p, cap, vllm_ok)
    p["advice"] += [] if p["host_fits"] else [host_advice(p)]
    return p


def _eval_chunk(cfg: Any, c: dict[str, Any], cap: float, reserved: float) -> int:
    """Prompts per transformers eval call (eval.k samples each) in the room the trainer's
    weights leave, vLLM asleep (or holding its reservation) when colocated."""
    lay = c["layout"]
    held = lay.contexts() + lay.static * (1 + FRAGMENTATION) + lay.asleep(reserved)
    room = cap - SAFETY_GIB - held
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

    from ebpo_lite.model.device import cuda_memory_gib, resolve_dtype

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


TOTALS_NOTE = [
    "phase and total rows: every sequence of a step in vLLM's KV cache at once (least: one group);",
    "the run holds that reservation and samples in waves: the 'as written' line decides fits.",
]


def format_table(p: dict[str, Any]) -> str:
    """The plan as plain text, one component per line (GiB)."""
    ck = "checkpointed" if p["activations_gb"] == p["activations_checkpointing_gb"] else "no ckpt"
    mb, seq = p["micro_batch_size"], p["tokens_per_sequence"]
    shared = ", vLLM's, shared" if p["vllm_shares_base"] else ""
    n_seqs, n_tok = p["vllm_max_num_seqs"], p["vllm_max_num_batched_tokens"]
    rows = [
        ("trainer", f"policy weights (frozen base{shared})", p["policy_weights_gb"]),
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
        ("vLLM", "base copy", 0.0 if shared else p["vllm_weights_gb"]),
        ("vLLM", "LoRA buffers", p["vllm_lora_gb"]),
        ("vLLM", f"KV cache, {p['sequences_per_step']} x {seq} tokens", p["vllm_kv_cache_gb"]),
        ("vLLM", f"profiling peak ({n_seqs} seqs, {n_tok} tokens) + rest", p["vllm_overhead_gb"]),
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
    free = f", {p['gpu_free_gb']:.1f} free" if p["gpu_free_gb"] < p["gpu_gb"] else ""
    lines.append(
        f"on {p['gpu_name']} ({p['gpu_gb']:g} GiB{free}) as written: {used} GiB -> "
        + ("fits" if p["fits"] else "DOES NOT FIT")
    )
    if p["backend"] != "hf":
        lines.append(
            f"vLLM reserves {p['vllm_reserved_gb']:.1f} GiB: "
            f"{p['vllm_concurrent_sequences']} of {p['sequences_per_step']} sequences at once"
        )
        lines += TOTALS_NOTE
        lines.append(sleep_line(p))
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
    return "\n".join(lines + _constants_lines(p["constants"]))


def _constants_lines(constants: dict[str, dict[str, Any]]) -> list[str]:
    """Which numbers are assumptions (no GPU has measured them yet) and which are not."""
    by_basis = constants_by_basis()
    assumed = ", ".join(f"{k} {constants[k]['value']}" for k in by_basis.get("assumed", []))
    return [
        f"assumed, not yet measured on a GPU: {assumed}",
        f"read in upstream source: {', '.join(by_basis.get('from-source', []))}",
        f"measured on CPU: {', '.join(by_basis.get('measured-on-CPU', []))}",
    ]


EXIT_STATUS = (
    "exit status: 0 the recipe fits, 1 it does not fit on that GPU (the table says what to "
    "change), 2 a user error (one line on stderr)"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print usage too)
        raise UserError(f"plan: {message}")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog=cli.prog("python -m ebpo_lite.model.plan"),
        description=__doc__.split("\n")[0],
        epilog=EXIT_STATUS,
    )
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--gpu", default="24", help=f"{GPU_FORMS} (default 24)")
    host = "the host's RAM in GiB for rollout.sleep=offload (auto: this machine's; Colab: 12.7)"
    parser.add_argument("--host-ram", default="auto", help=host)
    parser.add_argument("--json", help="write the plan as JSON to this file")
    try:
        args = parser.parse_intermixed_args(argv)
        from ebpo_lite import config

        cfg = config.load(args.recipe, args.overrides)
        name, gib = parse_gpu(args.gpu)
        p = plan(cfg, gib, name, host_gb=parse_host_ram(args.host_ram))
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
    from ebpo_lite.model.device import cuda_memory_gib, cuda_name, resolve_device

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
    # (reading the second GPU opens this process's context there: the plan counts it).
    # vLLM's reservation is a share of the GPU's size, not of what is free (plan_vllm).
    mems = [cuda_memory_gib(d) for d in devices]
    size = min(total for _, total, _ in mems)
    gib = min(min(total, free + held + CUDA_CONTEXT_GIB) for free, total, held in mems)
    try:
        p = plan(cfg, size, cuda_name(dev), free_gb=gib, host_gb=machine_ram_gib())
    except UserError as e:
        print(f"preflight: memory check skipped ({e})", file=sys.stderr)
        return
    if not p["fits"]:
        used = ", ".join(f"{d} {v:.1f}" for d, v in p["per_device_gb"].items())
        need = f"{used} GiB" + (f", {p['host_need_gb']:.1f} GiB of host RAM" * (not p["host_fits"]))
        raise UserError(
            f"preflight: {p['model']} needs {need}, {gib:.1f} GiB usable per GPU; "
            + "; ".join(p["advice"] or [f"see ebpo-lite plan RECIPE --gpu {gib:.0f}"])
        )


if __name__ == "__main__":
    sys.exit(main())
