"""Memory arithmetic of a decoder-only transformer: parameters, NF4 weights, LoRA, activations.

Pure functions on architecture numbers (no torch, no config); `ebpo_lite.model.plan` adds them up.
Architecture numbers come from `model_specs.json` (the public config.json of the models the
recipes name), from `<folder>/config.json`, or from `ebpo_lite.model.tiny`.

Notation: L layers, h hidden size, I MLP size, V vocabulary, n_q / n_kv heads of size d,
q = n_q * d, kv = n_kv * d, a = bytes of the compute dtype (2 for bf16 / fp16), r LoRA rank,
T tokens in a micro-batch.

- Weights. 16-bit base: params * a. NF4 base (bitsandbytes Linear4bit, blocksize 64, double
  quantisation as in QLoRA): per linear weight of n values, n/2 bytes of packed 4-bit codes, n/64
  one-byte absmax, n/64/256 fp32 second-level absmax and ~1 KiB of code books; embeddings,
  lm_head and norms stay 16-bit (transformers never quantises them). vLLM's NF4 copy (and
  Unsloth's, which is vLLM's) undoes the double quantisation at load (vllm-bnb-plugin 0.0.3,
  bitsandbytes_loader.py `_dequantize_dq`): n/2 + 4 n/64 bytes, 0.5625 per parameter.
- LoRA: r * (in + out) per adapted module.
- Activations: adapted from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", sec. 4.1: 34*s*b*h + 5*a*s^2*b bytes per GPT layer) by listing the tensors
  autograd keeps in a transformers Qwen3 / Llama layer with a frozen base (RMSNorm, GQA, SwiGLU, no
  dropout), per token: norms 2 * (4h + 4) (fp32 upcast and rsqrt inside RMSNorm); Qwen3 q/k-norm
  fp32 upcasts 4(q + kv) + 4(n_q + n_kv); Q, K, V at full head count 3a*q (transformers repeats
  K/V heads when a padding mask is present) + attention output a*q + fp32 logsumexp 4*n_q;
  SwiGLU 3a*I (SiLU input, SiLU output, up output). Frozen base linears (bf16 or bitsandbytes
  NF4) keep no input; the LoRA adapters do: with a 16-bit base and fp32 adapters (no autocast)
  peft casts each adapted module's input to its own fp32 copy (4 * in_features per module) and
  keeps A.x (4r); otherwise adapters share the base input (a * each distinct input). sdpa /
  flash keep no [n_q, s, s] matrix; eager adds (4 + a) * n_q * s^2 per sequence (fp32 softmax
  output and its cast). With gradient checkpointing only each layer's input (a*h per token)
  stays, plus one layer recomputed in backward. Plus the final norm (4h + 4 per token).
  Checked against the bytes autograd actually saves for the tiny model (tests/test_plan.py):
  within 2-8 % above, the excess being layer 0's norm (its input needs no gradient) and masks.
- Logits (`policy.completion_logprobs`, chunked), P positions whose logits are computed, k rows
  per chunk (LOGPROB_CHUNK_BYTES / 4V, at most P): the forward holds the model-dtype logits
  (a*P*V, kept for backward) and LOGPROB_CHUNK_COPIES fp32 [k, V] buffers (upcast logits, then
  logsumexp's or softmax's); backward holds the logits, their gradient (2a*P*V) and one chunk's
  fp32 buffer plus, for a 16-bit model, its rows in that dtype. The peak is the larger phase;
  never an fp32 [P, V] copy. Checked against torch's allocator (tests/test_plan.py;
  benchmarks/logprob_memory.py at V = 151,936).
- KV cache: 2 * L * kv * (KV dtype bytes) per token; `eval_sequence_bytes` adds what one
  sequence of transformers `generate` holds besides (the eval's chunk size comes from it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ebpo_lite.errors import UserError

GIB = 2**30
NF4_BLOCK, NF4_DQ_BLOCK = 64, 256
NF4_TENSOR_BYTES = 16 * 4 + 256 * 4 + 4  # NF4 code book, 8-bit absmax code book, offset
NF4_CODE_BYTES = 16 * 4  # the fp32 NF4 code book alone (vLLM's quant states keep only it)
LOGPROB_CHUNK_BYTES = 256 * 2**20  # policy.completion_logprobs: one fp32 chunk [rows, V]
LOGPROB_CHUNK_COPIES = 2  # fp32 [rows, V] buffers alive at once while a chunk is computed
ASSUME_AUTOCAST = False  # peft's fp32 copies of LoRA inputs vanish under torch.autocast
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Arch:
    """The architecture numbers the planner needs (names as in a transformers config.json)."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qk_norm(self) -> bool:  # Qwen3 normalises Q and K per head
        return self.model_type == "qwen3"


# ----------------------------------------------------------------------------- architectures


def load_specs() -> dict[str, dict[str, Any]]:
    path = Path(__file__).with_name("model_specs.json")
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def arch_from_config(d: dict[str, Any], name: str, where: str) -> Arch:
    """Build an Arch from a config.json mapping; UserError naming `where` and the missing key."""
    if "hidden_size" not in d and isinstance(d.get("text_config"), dict):
        d = d["text_config"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        if not isinstance(d.get(key), int):
            raise UserError(f"{where}: {key} missing or not an integer")
    heads = d["num_attention_heads"]
    return Arch(
        name=name,
        model_type=str(d.get("model_type", "")),
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings") or 0),
    )


def arch_for(name: str) -> Arch:
    """`tiny`, a local folder with config.json, or a model named in model_specs.json (`smollm2`:
    SmolLM2-135M-Instruct's; another .gguf file: its converted folder, once converted)."""
    from ebpo_lite.model import base_model

    if name == "tiny":
        from ebpo_lite.model.tiny import tiny_config_kwargs

        return arch_from_config({"model_type": "qwen3", **tiny_config_kwargs()}, "tiny", "tiny")
    if name == base_model.SMOLLM2:
        name = base_model.SMOLLM2_HUB_ID
    elif base_model.is_gguf_name(name):
        name = str(base_model.converted_dir(base_model.gguf_file(name)))
    folder = Path(name).expanduser()
    if folder.is_dir():
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise UserError(f"model.name: {folder} is a folder without config.json")
        try:
            data = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{cfg_path}: cannot read as JSON ({e})") from None
        return arch_from_config(data, name, str(cfg_path))
    specs = load_specs()
    by_lower = {k.lower(): k for k in specs} | {k.split("/")[-1].lower(): k for k in specs}
    key = by_lower.get(name.lower())
    if key is None:
        raise UserError(
            f"model.name: no architecture numbers for {name!r} (known: {', '.join(specs)}); "
            "give a local folder holding its config.json"
        )
    return arch_from_config(specs[key], key, f"model_specs.json[{key}]")


# ----------------------------------------------------------------------------- parameter math


def linear_shapes(arch: Arch) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of one decoder layer."""
    h, i, q, kv = arch.hidden_size, arch.intermediate_size, arch.q_dim, arch.kv_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def param_counts(arch: Arch) -> dict[str, int]:
    """Parameter counts by group: linear (quantisable), embed, lm_head, norm, total."""
    h, L = arch.hidden_size, arch.num_hidden_layers
    linear = L * sum(a * b for a, b in linear_shapes(arch).values())
    norm_per_layer = 2 * h + (2 * arch.head_dim if arch.qk_norm else 0)
    embed = arch.vocab_size * h
    lm_head = 0 if arch.tie_word_embeddings else embed
    norm = L * norm_per_layer + h  # + the final norm
    return {
        "linear": linear,
        "embed": embed,
        "lm_head": lm_head,
        "norm": norm,
        "total": linear + embed + lm_head + norm,
    }


def nf4_bytes(n: int) -> int:
    """Bytes bitsandbytes keeps for one NF4 weight of n values (blocksize 64, double quant)."""
    blocks = math.ceil(n / NF4_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_DQ_BLOCK) + NF4_TENSOR_BYTES


def vllm_nf4_bytes(n: int) -> int:
    """Bytes vLLM's bitsandbytes copy keeps for one NF4 weight of n values: packed codes, one
    fp32 absmax per 64 values (double quantisation undone at load) and the NF4 code book."""
    return math.ceil(n / 2) + 4 * math.ceil(n / NF4_BLOCK) + NF4_CODE_BYTES


def base_weight_bytes(arch: Arch, four_bit: bool, a: int, fp32_absmax: bool = False) -> int:
    """The frozen base model: NF4 linear layers + 16-bit rest, or everything at `a` bytes;
    `fp32_absmax`: vLLM's NF4 layout (`vllm_nf4_bytes`) instead of the trainer's."""
    counts = param_counts(arch)
    rest = counts["embed"] + counts["lm_head"] + counts["norm"]
    if not four_bit:
        return counts["total"] * a
    nf4 = vllm_nf4_bytes if fp32_absmax else nf4_bytes
    per_layer = sum(nf4(i * o) for i, o in linear_shapes(arch).values())
    return arch.num_hidden_layers * per_layer + rest * a


def lora_targets(names: list[str]) -> tuple[str, ...]:
    """model.lora_target_modules -> the adapted linear names ('all-linear' = all seven)."""
    if any(n == "all-linear" for n in names):
        return LINEARS
    unknown = [n for n in names if n.split(".")[-1] not in LINEARS]
    if unknown:
        raise UserError(
            f"model.lora_target_modules: cannot plan for {unknown} "
            f"(known: all-linear, {', '.join(LINEARS)})"
        )
    return tuple(n for n in LINEARS if n in {x.split(".")[-1] for x in names})


def lora_param_count(arch: Arch, rank: int, targets: tuple[str, ...]) -> int:
    shapes = linear_shapes(arch)
    return arch.num_hidden_layers * sum(rank * sum(shapes[t]) for t in targets)


def extra_trainable_count(arch: Arch, substrings: list[str]) -> int:
    """Base parameters made trainable by model.trainable_extra (embed_tokens, lm_head, norm)."""
    counts, total = param_counts(arch), 0
    for group, names in (
        ("embed", ("embed_tokens", "embed")),
        ("lm_head", ("lm_head",)),
        ("norm", ("norm", "layernorm")),
    ):
        if any(s in n or n in s for s in substrings for n in names):
            total += counts[group]
    return total


def kv_bytes_per_token(arch: Arch, kv_bytes: int) -> int:
    return 2 * arch.num_hidden_layers * arch.kv_dim * kv_bytes


def eval_sequence_bytes(arch: Arch, a: int, prompt_tokens: int, new_tokens: int) -> int:
    """Working memory of one sequence in transformers `generate`, bytes: the KV cache of prompt +
    completion tokens (rounded up to 16-token blocks), the prefill's transient activations of one
    layer (prompt_tokens x (3 I + 4 h) x a: SwiGLU's three MLP tensors, residual, norm, attention
    output) and one decoding step's fp32 logits with the sampler's two working copies (3 x 4 V)."""
    tokens = prompt_tokens + new_tokens
    if arch.max_position_embeddings:
        tokens = min(tokens, arch.max_position_embeddings)
    kv = math.ceil(tokens / 16) * 16 * kv_bytes_per_token(arch, a)
    prefill = prompt_tokens * (3 * arch.intermediate_size + 4 * arch.hidden_size) * a
    return kv + prefill + 3 * 4 * arch.vocab_size


# ----------------------------------------------------------------------------- activation math


def layer_bytes_per_token(
    arch: Arch, a: int, rank: int, targets: tuple[str, ...], autocast: bool = ASSUME_AUTOCAST
) -> int:
    """Bytes autograd keeps per token in one decoder layer (see the module docstring)."""
    h, i, q, kv = arch.hidden_size, arch.intermediate_size, arch.q_dim, arch.kv_dim
    heads = arch.num_attention_heads
    total = 2 * (4 * h + 4)  # two RMSNorms: fp32 upcast + rsqrt
    if arch.qk_norm:
        total += 4 * (q + kv) + 4 * (heads + arch.num_key_value_heads)
    total += 3 * a * q + a * q + 4 * heads  # Q, K, V (full heads), output, logsumexp
    total += 3 * a * i  # SiLU input, SiLU output, up output
    shapes = linear_shapes(arch)
    if a < 4 and not autocast:  # each adapter casts its own fp32 copy of its input
        return total + sum(4 * shapes[t][0] + 4 * rank for t in targets)
    inputs = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
    shared = {inputs.get(t, t): shapes[t][0] for t in targets}  # adapters share one input
    return total + a * sum(shared.values()) + sum((a if autocast else 4) * rank for _ in targets)


def activation_bytes(
    arch: Arch,
    a: int,
    rank: int,
    targets: tuple[str, ...],
    micro_batch: int,
    seq: int,
    checkpointing: bool,
    attn: str,
) -> int:
    """Saved activations for one micro-batch of `micro_batch` sequences of `seq` tokens."""
    tokens = micro_batch * seq  # T
    one_layer = tokens * layer_bytes_per_token(arch, a, rank, targets)
    if attn == "eager":
        one_layer += micro_batch * (4 + (a if a < 4 else 0)) * arch.num_attention_heads * seq**2
    head = tokens * (4 * arch.hidden_size + 4)  # final norm (lm_head is frozen: keeps no input)
    if checkpointing:
        return arch.num_hidden_layers * tokens * a * arch.hidden_size + one_layer + head
    return arch.num_hidden_layers * one_layer + head


def microbatch_bytes(
    arch: Arch,
    a: int,
    rank: int,
    targets: tuple[str, ...],
    micro_batch: int,
    seq: int,
    logit_positions: int,
    checkpointing: bool,
    attn: str,
) -> int:
    """Peak bytes of one training micro-batch: activations + logits at the moment they peak.

    Without checkpointing every layer's saved tensors are alive while the logits' buffers are
    (the log-prob backward runs first): their sum. With checkpointing the layer inputs and the
    final norm stay throughout, but the one layer being recomputed exists only during its own
    backward, after the logits' backward has freed its buffers: inputs + head + the larger of
    the two (benchmarks/plan_vs_measured.py measured the sum 22 % above the allocator's peak).
    """
    act = activation_bytes(arch, a, rank, targets, micro_batch, seq, checkpointing, attn)
    logits = logits_bytes(arch, logit_positions, a)
    if not checkpointing:
        return act + logits
    tokens = micro_batch * seq
    kept = tokens * (arch.num_hidden_layers * a * arch.hidden_size + 4 * arch.hidden_size + 4)
    return kept + max(act - kept, logits)  # act - kept: the recomputed layer


def logprob_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk of `policy.completion_logprobs`: one fp32 [rows, V] in LOGPROB_CHUNK_BYTES."""
    return max(1, LOGPROB_CHUNK_BYTES // (4 * vocab_size))


def logits_bytes(arch: Arch, positions: int, a: int) -> int:
    """Logits, log-probs and their gradient for `positions` kept positions (module docstring)."""
    v = arch.vocab_size
    rows = min(positions, logprob_chunk_rows(v))
    gathered = a if a < 4 else 0  # an fp32 model's gathered rows are the upcast copy itself
    forward = positions * v * a + rows * v * 4 * LOGPROB_CHUNK_COPIES
    backward = positions * v * 2 * a + rows * v * (4 + gathered)
    return max(forward, backward)
