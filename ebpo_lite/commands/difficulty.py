"""Difficulty labels: the base policy's pass rate on every training prompt.

`ebpo-lite label difficulty RECIPE.yaml [section.key=value ...] [--k 16] [--temperature 1.0]
[--out FILE]` samples k completions per training prompt with the recipe's model before any
training (LoRA B starts at zero, so the fresh adapter is the base policy), scores them with the
recipe's reward functions and writes one JSON line per example, the labels format
`mathdata.apply_labels` reads:

    {"index": 12, "prompt_sha1": "…", "pass_rate": 0.25, "k": 16, "temperature": 1.0,
     "num_scored": 16, "mean_reward": 0.25}

Point `data.labels_path` at the file: each labelled example then gets difficulty = 1 - pass_rate
(for `curriculum.sampler: difficulty` and `algo.prior_key: difficulty`).

Choices: the paper's setting is the default (k = 16 at temperature 1.0), with the recipe's top-p /
top-k / min-p and `rollout.max_new_tokens`. A sample's pass is the recipe's weighted reward
(without the length penalty) clipped to [0, 1]: with the default single 0/1 correctness reward
this is the fraction of correct samples. Samples the reward cannot judge are left out; a prompt
with none judged gets `pass_rate: null` (left unlabelled by `apply_labels`).
Resumable: rows are appended as chunks finish and indices already in the file are skipped; a
last line cut by a crash is dropped. Prompts are encoded exactly as in training (`data.encode_prompt`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ebpo_lite import cli
from ebpo_lite.engine.labels import TEMPERATURE, K, check_file, label_prompts, pass_rates
from ebpo_lite.errors import UserError

__all__ = ["label", "main", "pass_rates"]


def label(args: argparse.Namespace) -> Path:
    from ebpo_lite import config, rewards
    from ebpo_lite.data import loader as data
    from ebpo_lite.data.jsonl import read_jsonl
    from ebpo_lite.engine.run import reward_functions
    from ebpo_lite.eval import load_policy, make_sampler

    cfg = config.load(args.recipe, args.overrides)
    if args.k < 1 or args.batch_size < 1 or args.temperature <= 0:
        raise UserError("--k and --batch-size must be >= 1 and --temperature > 0")
    examples, _ = data.load_train_eval(dataclasses.replace(cfg.data, labels_path=None))
    examples = examples[: args.limit or None]
    out = Path(args.out or Path(cfg.output_dir) / "difficulty.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    check_file(out, examples, args.k, args.temperature)  # before the model loads
    fns, weights = reward_functions(cfg.reward, cfg.data)
    policy = load_policy(cfg, ckpt=None)
    max_new = args.max_new_tokens or cfg.rollout.max_new_tokens
    scfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, temperature=args.temperature, max_new_tokens=max_new)
    )  # fmt: skip
    sampler, backend = make_sampler(scfg, policy, args.backend)
    prompts = [data.encode_prompt(policy.tokenizer, ex, cfg.data) for ex in examples]
    try:
        label_prompts(
            cfg, examples, prompts, sampler, policy.tokenizer, (fns, weights), out,
            k=args.k, temperature=args.temperature, max_new_tokens=max_new,
            batch_size=args.batch_size,
        )  # fmt: skip
    finally:
        sampler.close()
        rewards.close_contained(fns)
    rates = [r["pass_rate"] for r in read_jsonl(out) if r["pass_rate"] is not None]
    mean = sum(rates) / len(rates) if rates else float("nan")
    print(
        f"{out}: {len(examples)} prompts labelled ({backend}), mean pass rate {mean:.3f}, "
        f"{sum(r == 0 for r in rates)} never solved, {sum(r == 1 for r in rates)} always solved\n"
        f"use it with: data.labels_path={out}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=cli.prog("python -m ebpo_lite.commands.difficulty"),
        description="Per-example pass rates of the base policy, as a labels file.",
    )
    p.add_argument("recipe", help="recipe YAML (its model, data and reward are used)")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.add_argument("--k", type=int, default=K, help=f"samples per prompt (default {K})")
    p.add_argument("--temperature", type=float, default=TEMPERATURE, help="default 1.0")
    p.add_argument("--max-new-tokens", type=int, default=0, help="default rollout.max_new_tokens")
    p.add_argument("--out", default=None, help="default OUTPUT_DIR/difficulty.jsonl")
    p.add_argument("--limit", type=int, default=0, help="only the first N training examples")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    p.add_argument("--backend", default="auto", choices=("auto", "hf", "vllm"))
    args = p.parse_intermixed_args(argv)
    return cli.run(label, args)


if __name__ == "__main__":
    sys.exit(main())
