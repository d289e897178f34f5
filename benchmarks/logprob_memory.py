"""Peak memory of one training micro-batch through `policy.completion_logprobs`, old vs chunked.

Usage: .venv/bin/python benchmarks/logprob_memory.py [--dtype bfloat16 float32] [--out PATH]
Writes benchmarks/results/logprob_memory.json with the command and the machine.

One micro-batch = forward through a random-init Qwen3 with a 151,936-token vocabulary (Qwen3's;
2 small layers, LoRA r 16 on all linears) + log-probs and entropy of N x C completion tokens +
backward of a token-mean loss, as `run.Run._update` does. "old" is the unchunked implementation
(fp32 [N, C, V] logits kept by autograd, an fp32 softmax for the entropy), kept here only for this
comparison; "new" is `ebpo_lite.model.policy.completion_logprobs` (fp32 chunks of rows).

Memory is measured with torch's profiler (`profile_memory=True`): every allocation and free of
torch's CPU allocator is an event with its byte count, and the running sum of those events, from
the start of the micro-batch, peaks at the number reported (exact tensor bytes, no RSS guess).
The planner's estimate (`ebpo_lite.model.memory.logits_bytes`) for the same shapes is recorded beside.

Measured here (results/logprob_memory.json, N = 4, C = 512, 2 threads): bf16 5.87 -> 1.61 GiB,
fp32 5.87 -> 2.65 GiB (one fp32 [N, C, V] copy is 1.16 GiB; the old path peaked at about five);
the planner's new logits term is 1.54 / 2.57 GiB, the rest being activations. The times include
the profiler's overhead on 2 shared cores and are not a speed benchmark.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _machine import command, machine
from _memory import allocator_bytes

from ebpo_lite.model.memory import arch_from_config, logits_bytes
from ebpo_lite.model.policy import completion_logprobs, make_batch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def old_completion_logprobs(model, batch, with_entropy: bool = False):
    """The implementation before chunking (temperature 1), for comparison only."""
    width_c = batch.completion_mask.shape[1]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=width_c + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1].float()  # [N, C, V]
    targets = batch.input_ids[:, batch.prompt_width :]  # [N, C]
    logz = torch.logsumexp(logits, dim=-1)  # [N, C]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz  # [N, C]
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)  # [N, C, V]
        entropy = logz - (probs * logits).sum(-1)  # [N, C]
    return logp, entropy


def build(dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG, attn_implementation="sdpa")).to(dtype)
    return get_peft_model(model, LoraConfig(r=16, target_modules="all-linear")).train()


def micro_batch(model, batch, fn) -> None:
    """Forward, log-probs + entropy, token-mean loss, backward; gradients dropped after."""
    logp, entropy = fn(model, batch, with_entropy=True)  # [N, C], [N, C]
    mask = batch.completion_mask  # [N, C]
    loss = -(logp * mask).sum() / mask.sum() + 0.0 * entropy.sum()
    loss.backward()
    for p in model.parameters():
        p.grad = None


def peak_bytes(model, batch, fn) -> tuple[int, float]:
    """(peak bytes above the start, seconds) of one micro-batch, from the allocator's events."""
    micro_batch(model, batch, fn)  # warm-up: lazy inits outside the measurement
    t0 = time.perf_counter()
    _, _, peak = allocator_bytes(lambda: micro_batch(model, batch, fn))
    seconds = time.perf_counter() - t0
    return peak, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--sequences", type=int, default=4)  # N
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--completion-tokens", type=int, default=512)  # C
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/logprob_memory.json"))
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    n, p_len, c_len = args.sequences, args.prompt_tokens, args.completion_tokens
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, VOCAB, (p_len,), generator=gen).tolist() for _ in range(n)]
    completions = [torch.randint(4, VOCAB, (c_len,), generator=gen).tolist() for _ in range(n)]
    batch = make_batch(prompts, completions, pad_id=0)
    arch = arch_from_config({"model_type": "qwen3", **CONFIG}, "random-qwen3", "benchmark")
    rows = []
    for name in args.dtype:
        dtype = getattr(torch, name)
        a = torch.finfo(dtype).bits // 8
        model = build(dtype)
        for impl, fn in (("old", old_completion_logprobs), ("new", completion_logprobs)):
            peak, seconds = peak_bytes(model, batch, fn)
            rows.append(
                {
                    "dtype": name,
                    "implementation": impl,
                    "peak_gib": round(peak / 2**30, 3),
                    "seconds": round(seconds, 2),
                }
            )
            print(rows[-1], flush=True)
        rows.append(
            {
                "dtype": name,
                "planner_logits_gib_new": round(logits_bytes(arch, n * (c_len + 1), a) / 2**30, 3),
                # the planner's former term: 12 bytes per kept position and vocabulary entry
                "planner_logits_gib_old": round(12 * n * (c_len + 1) * VOCAB / 2**30, 3),
            }
        )
        del model
    fp32_copy = n * c_len * VOCAB * 4
    result = {
        "what": "peak memory of one training micro-batch through completion_logprobs",
        "command": command(),
        "machine": machine(**_versions()),
        "method": "torch.profiler profile_memory=True: running sum of CPU allocator events",
        "model": {**CONFIG, "lora_rank": 16, "init": "random"},
        "sequences": n,
        "prompt_tokens": p_len,
        "completion_tokens": c_len,
        "one_fp32_NxCxV_copy_gib": round(fp32_copy / 2**30, 3),
        "results": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _versions() -> dict:
    import peft
    import transformers

    return {"transformers": transformers.__version__, "peft": peft.__version__}


if __name__ == "__main__":
    main()
