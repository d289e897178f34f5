"""Difficulty labels: the base policy's pass rate on every training prompt.

`python -m ebpo_lite.difficulty RECIPE.yaml [section.key=value ...] [--k 16] [--temperature 1.0]
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
from typing import Any

from ebpo_lite import cli
from ebpo_lite.errors import UserError


def pass_rates(totals: list[float | None], k: int) -> list[tuple[float | None, int, float | None]]:
    """(pass rate, samples judged, mean reward) per prompt from prompt-major rewards [B * k]."""
    out = []
    for s in range(0, len(totals), k):
        judged = [t for t in totals[s : s + k] if t is not None]
        if not judged:
            out.append((None, 0, None))
            continue
        rate = sum(min(max(t, 0.0), 1.0) for t in judged) / len(judged)
        out.append((rate, len(judged), sum(judged) / len(judged)))
    return out


def _check_resume(rows: list[dict[str, Any]], path: Path, k: int, temperature: float) -> None:
    for r in rows:
        if r.get("k") != k or r.get("temperature") != temperature:
            raise UserError(
                f"{path}: rows computed with k={r.get('k')}, temperature={r.get('temperature')} "
                f"(asked k={k}, temperature={temperature}); delete it or choose another --out"
            )


K = 16  # samples per prompt: the paper's setting (also `data.labels_path=auto`'s)
TEMPERATURE = 1.0


def label(args: argparse.Namespace) -> Path:
    from ebpo_lite import config, data, rewards
    from ebpo_lite.eval import load_policy, make_sampler, read_jsonl
    from ebpo_lite.run import reward_functions

    cfg = config.load(args.recipe, args.overrides)
    if args.k < 1 or args.batch_size < 1 or args.temperature <= 0:
        raise UserError("--k and --batch-size must be >= 1 and --temperature > 0")
    examples, _ = data.load_train_eval(dataclasses.replace(cfg.data, labels_path=None))
    examples = examples[: args.limit or None]
    out = Path(args.out or Path(cfg.output_dir) / "difficulty.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    check_file(out, examples, args.k, args.temperature)  # before the model loads
    fns, weights = reward_functions(cfg)
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


def check_file(out: Path, examples: list, k: int, temperature: float) -> set[int]:
    """The indices a labels file being resumed already holds; UserError if its rows were made
    with other settings or for other data."""
    from ebpo_lite.eval import read_jsonl
    from ebpo_lite.prompts import prompt_digest

    rows = read_jsonl(out)
    _check_resume(rows, out, k, temperature)
    for r in rows:
        i = r.get("index")
        if not isinstance(i, int) or i >= len(examples):
            raise UserError(f"{out}: index {i!r} is not a training example here; other data?")
        if r.get("prompt_sha1") != prompt_digest(examples[i].prompt):
            raise UserError(f"{out}: example {i} differs from the file's; labels for other data?")
    return {r["index"] for r in rows}


def label_prompts(
    cfg: Any,
    examples: list,
    prompts: list[list[int]],
    sampler: Any,
    tokenizer: Any,
    reward: tuple[list, list[float]],
    out: Path,
    k: int = K,
    temperature: float = TEMPERATURE,
    max_new_tokens: int | None = None,
    batch_size: int = 32,
) -> None:
    """Append a labels row to `out` for every example it does not hold yet: k completions of
    `prompts[i]` (the encoded example i) from `sampler`, scored by `reward` (the run's (name,
    function) pairs and weights). `python -m ebpo_lite.difficulty` and `data.labels_path=auto`
    (`ebpo_lite.labels`) both label through here, with the same seeds."""
    from tqdm import tqdm

    from ebpo_lite import rewards
    from ebpo_lite.eval import append_jsonl
    from ebpo_lite.prompts import prompt_digest

    done = check_file(out, examples, k, temperature)
    todo = [i for i in range(len(examples)) if i not in done]
    fns, weights = reward
    bar = tqdm(total=len(examples), initial=len(done), desc="difficulty", unit="prompt")
    try:
        for start in range(0, len(examples), batch_size):
            idx = [i for i in todo if start <= i < start + batch_size]
            if not idx:
                continue
            exs = [examples[i] for i in idx]
            seed = (cfg.train.seed * 1_000_003 + 7919 + start) % (2**31)
            roll = sampler.generate(
                [prompts[i] for i in idx], k, seed=seed, temperature=temperature,
                max_new_tokens=max_new_tokens,
            )  # fmt: skip
            texts = tokenizer.batch_decode(roll.completion_ids, skip_special_tokens=True)
            columns: dict[str, Any] = {"answer": [ex.answer for ex in exs for _ in range(k)]}
            for key in sorted({key for ex in exs for key in ex.meta}):
                columns[key] = [ex.meta.get(key) for ex in exs for _ in range(k)]
            totals, _ = rewards.combine_rewards(
                dict(fns), weights, texts, timeout_s=cfg.reward.timeout_s, **columns
            )
            recs = [
                {"index": i, "prompt_sha1": prompt_digest(ex.prompt), "pass_rate": rate,
                 "k": k, "temperature": temperature, "num_scored": n, "mean_reward": mean}
                for i, ex, (rate, n, mean) in zip(idx, exs, pass_rates(totals, k))
            ]  # fmt: skip
            append_jsonl(out, recs)
            bar.update(len(recs))
    finally:
        bar.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ebpo_lite.difficulty",
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
