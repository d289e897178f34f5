"""Evaluation: pass@1 over k samples, maj@k and unbiased pass@k on math benchmarks.

Two entry points share one code path (`eval_examples`):
- `python -m ebpo_lite.eval RUN_DIR_OR_MODEL --benchmark math500,aime24 --k 32 --out r.json`
  (see `main`); resumable through `<out>.partial.jsonl`.
- `ebpo_lite.train_eval.evaluate_policy(run)`, the periodic eval inside training (`eval/accuracy`,
  `eval/expected_accuracy`, and `eval/<bench>/...` when `eval.benchmarks` is set).

Metrics (per problem i with n = k samples of which c_i are correct, averaged over problems):
- pass@1 = c_i / n: Pass@1 averaged over k samples, the paper's headline number.
- pass@j (j <= n) = 1 - C(n - c_i, j) / C(n, j): the unbiased estimator of Chen et al. (2021),
  reported for j = 1, 2, 4, ... and j = n.
- maj@k: 1 if the most frequent extracted answer is right. Answers are grouped by string after
  `answer_key` normalisation (whitespace, `$`, `\\left`/`\\right`, spacing commands, `\\dfrac`,
  `\\text{}`, degree signs and a trailing period removed; integers and decimals canonical), not by
  symbolic equivalence: `1/2` and `0.5` are two groups. Completions with no extractable answer
  do not vote; ties go to the answer seen first; a group's correctness is its first member's.
Answers: the tiny `arithmetic` task scores the whole stripped completion (no extraction); math
benchmarks take the last `\\boxed{}` (else the number after GSM8K's `####`, else math-verify's
own extraction from the text's end) and verify with math-verify (`rewards.judge_math`). A
completion the verifier cannot judge counts as wrong (and is counted). An unboxed answer votes
with math-verify's extracted string. Each record keeps the extraction method of every sample
(`extraction`: boxed / gsm8k_marker / math_verify / none); the summary reports their shares
(`extraction/boxed`, ...) and the results JSON names the rule (`settings.extraction`).

Your own data: `--benchmark FILE.jsonl` (any `.json` / `.jsonl` / `.parquet` file) reads the file
with the run's data mapping (`data.preset`, `data.prompt_field`, ...), and `--benchmark held-out`
(the default for a run folder) is the run's own held-out examples (`data.load_train_eval`: the tiny
task's for a tiny run). Both are scored with the run's first reward function, as the in-training
eval scores them (`eval/accuracy`): a user's `module:function` too; pass@1 counts scores of 1.0,
and `mean_reward` is the mean score. Prompts take the run's `data.prompt_format`. A model that is
not a run folder is evaluated on math500 by default.

Sampling defaults (CLI): k = 1 is greedy (temperature 0); k > 1 samples at temperature 0.6 with
top-p 0.95 (DeepSeek-R1's and the EBPO paper's evaluation setting). Prompts go through the chat
template with the run's `data.system_prompt` / `data.thinking` and are never truncated by the CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ebpo_lite import cli
from ebpo_lite.data.jsonl import append_jsonl, read_jsonl, write_atomic
from ebpo_lite.data.loader import encode_prompt
from ebpo_lite.errors import UserError
from ebpo_lite.rewards.judge import EXTRACTION

if TYPE_CHECKING:
    from ebpo_lite.config import Config, DataConfig
    from ebpo_lite.data.loader import Example

ARITHMETIC_EVAL_SIZE = 256  # the `arithmetic` benchmark: the tiny task's held-out problems
HELD_OUT = "held-out"  # the run's own held-out examples, as a benchmark name
DATA_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet")
MAX_STORED_ANSWER = 200  # characters of each extracted answer kept in the partial file


# ----------------------------------------------------------------------------- pure metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. (2021): 1 - C(n - c, k) / C(n, k).

    Notation: n samples of one problem, c of them correct, k <= n. Computed as the product
    1 - prod_{i = n - c + 1}^{n} (1 - k / i), stable for large n. pass_at_k(n, c, 1) = c / n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


_SPACING = re.compile(r"\\[,!;: ]|\\left|\\right|\\displaystyle")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DEGREE = re.compile(r"\^\{?\\circ\}?")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")


def answer_key(answer: str | None) -> str | None:
    """The string maj@k groups by (rules in the module docstring); None for no answer."""
    from ebpo_lite.rewards.extract import canonical_int, clean_answer

    if answer is None:
        return None
    s = clean_answer(answer)
    s = _TEXT.sub(r"\1", _SPACING.sub("", s))
    s = _DEGREE.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if not s:
        return None
    as_int = canonical_int(s)
    if as_int is not None:
        return as_int
    if _DECIMAL.fullmatch(s):
        s = s.rstrip("0").rstrip(".") if "." in s else s
        return canonical_int(s) or s
    return s


def majority_vote(
    answers: Sequence[str | None], scores: Sequence[float | None]
) -> tuple[str | None, float]:
    """(winning answer key, its score) over one problem's samples; (None, 0.0) when none voted."""
    counts: dict[str, int] = {}
    first_score: dict[str, float] = {}
    for a, s in zip(answers, scores):
        key = answer_key(a)
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        first_score.setdefault(key, float(s or 0.0))
    if not counts:
        return None, 0.0
    best = max(counts, key=lambda a: counts[a])  # max keeps the first of equal counts
    return best, first_score[best]


def pass_ks(k: int) -> list[int]:
    """The j reported as pass@j: 1, 2, 4, ... below k, and k."""
    out, j = [], 1
    while j < k:
        out.append(j)
        j *= 2
    return [*out, k]


def summarize(records: Sequence[dict[str, Any]], k: int) -> dict[str, float]:
    """Benchmark metrics from per-problem records (`num_correct`, `maj_correct`, ...).

    With per-sample `extraction` methods (math benchmarks), also `extraction/<method>`: the share
    of samples whose answer each method produced.
    """
    from ebpo_lite.rewards import extraction_shares

    n = len(records)
    if n == 0:
        return {"num_problems": 0}
    out: dict[str, float] = {"num_problems": n}
    for j in pass_ks(k):
        out[f"pass@{j}"] = sum(pass_at_k(r["k"], r["num_correct"], j) for r in records) / n
    out[f"maj@{k}"] = sum(r["maj_correct"] for r in records) / n
    out["mean_length"] = sum(sum(r["lengths"]) / len(r["lengths"]) for r in records) / n
    out["truncated_frac"] = sum(r["truncated"] / r["k"] for r in records) / n
    out["unscored"] = sum(r["unscored"] for r in records)
    if all("mean_reward" in r for r in records):  # own data, scored by the run's reward
        out["mean_reward"] = sum(r["mean_reward"] for r in records) / n
    methods = [m for r in records for m in r.get("extraction") or ()]
    out.update({f"extraction/{m}": v for m, v in extraction_shares(methods).items()})
    return out


def mean_over_benchmarks(per_bench: dict[str, dict[str, float]]) -> dict[str, float]:
    """Unweighted mean of each metric over benchmarks (the paper's "Avg." column)."""
    keys = [k for k in next(iter(per_bench.values())) if k.startswith(("pass@", "maj@"))]
    return {k: sum(b[k] for b in per_bench.values()) / len(per_bench) for k in keys}


# ----------------------------------------------------------------------------- problems and scoring


def is_own_data(name: str) -> bool:
    """True for `held-out` and a data file: examples scored by the run's reward function."""
    return name == HELD_OUT or Path(name).suffix.lower() in DATA_SUFFIXES


def prompt_raw(name: str) -> bool | None:
    """`encode_prompt`'s `raw` for a benchmark: the tiny task's text as is, math through the chat
    template, own data as the run's `data.prompt_format` says (None)."""
    return None if is_own_data(name) else name == "arithmetic"


def benchmark_examples(name: str, dcfg: DataConfig | None = None) -> list[Example]:
    """`arithmetic` (the tiny task's held-out problems), `held-out` (the run's), a data file
    (read with the run's mapping) or a `mathdata` benchmark."""
    if is_own_data(name):
        from ebpo_lite import config
        from ebpo_lite.data import loader as data
        from ebpo_lite.data import mathdata

        dcfg = dcfg if dcfg is not None else config.DataConfig()
        if name == HELD_OUT:
            held = data.load_train_eval(dataclasses.replace(dcfg, labels_path=None))[1]
            if not held:
                raise UserError(
                    f"--benchmark: the run holds no examples out ({data.describe_held(held)}); "
                    "name a file (--benchmark FILE.jsonl) or a benchmark (arithmetic, math500, ...)"
                )
            return held
        if not Path(name).is_file():
            raise UserError(f"--benchmark: {name}: file not found")
        one = dataclasses.replace(dcfg, path=name, max_examples=0, eval_path=None)
        return mathdata.load_examples(one)
    if name == "arithmetic":
        from ebpo_lite.data.loader import arithmetic_examples

        seed = dcfg.seed if dcfg is not None else 1234
        return arithmetic_examples(ARITHMETIC_EVAL_SIZE, seed=seed, split="eval")
    from ebpo_lite.data import mathdata

    return mathdata.load_benchmark(name, data_dir=dcfg.data_dir if dcfg is not None else None)


def score(
    bench: str,
    texts: list[str],
    golds: list[str],
    timeout_s: float,
    reward: Callable | None = None,
    columns: dict[str, list] | None = None,
) -> tuple[list[float | None], list[str | None], list[str] | None]:
    """(score, extracted answer) per completion, and the extraction methods (None: arithmetic).

    `reward` (own data: the run's first reward function) scores instead of the benchmark's rule;
    a user's function gets `columns` (`rewards.reward_columns`) and votes with the whole text.
    """
    from ebpo_lite import rewards

    if reward is rewards.arithmetic_answer or reward is None and bench == "arithmetic":
        return rewards.arithmetic_answer(texts, golds), [t.strip() or None for t in texts], None
    if reward is None or reward is rewards.math_answer:
        j = rewards.judge_math(texts, golds, timeout_s=timeout_s)
        return j.scores, j.answers, j.methods
    scores = reward(completions=texts, timeout_s=timeout_s, **(columns or {}))
    return list(scores), [t.strip() or None for t in texts], None


def eval_examples(
    sampler: Any,
    tokenizer: Any,
    bench: str,
    examples: list[Example],
    indices: list[int],
    prompts: list[list[int]],
    k: int,
    seed: int,
    temperature: float,
    max_new_tokens: int,
    timeout_s: float,
    reward: Callable | None = None,
) -> list[dict[str, Any]]:
    """k completions for each of `examples` in one `generate` call: one record per problem.

    `reward`: score with this function (own data) instead of the benchmark's rule (`score`)."""
    from ebpo_lite.data.prompts import prompt_digest
    from ebpo_lite.rewards import reward_columns

    roll = sampler.generate(
        prompts, k, seed=seed, temperature=temperature, max_new_tokens=max_new_tokens
    )
    texts = tokenizer.batch_decode(roll.completion_ids, skip_special_tokens=True)
    golds = [ex.answer for ex in examples for _ in range(k)]
    columns = reward_columns(examples, k) if reward is not None else None
    scores, answers, methods = score(bench, texts, golds, timeout_s, reward, columns)
    records = []
    for p, (i, ex) in enumerate(zip(indices, examples)):
        rows = range(p * k, (p + 1) * k)
        s = [scores[r] for r in rows]
        a = [answers[r] for r in rows]
        maj, maj_ok = majority_vote(a, s)
        records.append(
            {
                "benchmark": bench,
                "index": i,
                "prompt_sha1": prompt_digest(ex.prompt),
                "k": k,
                "num_correct": int(sum(1 for v in s if v == 1.0)),
                "unscored": sum(1 for v in s if v is None),
                "maj_correct": maj_ok,
                "maj_answer": maj[:MAX_STORED_ANSWER] if maj else None,
                "answers": [x[:MAX_STORED_ANSWER] if x else None for x in a],
                "extraction": [methods[r] for r in rows] if methods else None,
                "lengths": [len(roll.completion_ids[r]) for r in rows],
                "truncated": sum(1 for r in rows if not roll.finished[r]),
            }
        )
        if reward is not None:
            kept = [float(v) for v in s if v is not None]
            records[-1]["mean_reward"] = sum(kept) / len(kept) if kept else 0.0
    return records


def chunk_seed(seed: int, bench: str, start: int) -> int:
    """Sampling seed of the chunk of problems starting at `start` (stable across resumes)."""
    return (seed * 1_000_003 + zlib.crc32(bench.encode()) + start) % (2**31)


# ----------------------------------------------------------------------------- CLI: loading


def load_target(target: str, overrides: Sequence[str]) -> tuple[Config, Path | None, Path | None]:
    """(config, run directory or None, checkpoint or None) for a run dir, checkpoint or model.

    A run directory holds `config.yaml` (its newest `checkpoints/step_N` is used); a checkpoint
    folder `RUN/checkpoints/step_N` names one step; anything else is a model folder or hub id
    evaluated with the default config (`section.key=value` overrides apply in every case).
    """
    from ebpo_lite import config
    from ebpo_lite.engine import checkpoint

    path = Path(target)
    if (path / "trainable.safetensors").is_file() and path.parent.name == "checkpoints":
        run_dir, ckpt = path.parent.parent, path
    elif (path / "config.yaml").is_file():
        run_dir, ckpt = path, checkpoint.latest(path)
    elif path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        have = ", ".join(p.name for p in checkpoint.list_checkpoints(path.parent.parent))
        raise UserError(f"{path}: no such checkpoint of that run (it has: {have or 'none'})")
    else:
        cfg = config.load(None, overrides)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=target))
        return cfg, None, None
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir}: no config.yaml; not a training output_dir")
    return config.load(run_dir / "config.yaml", overrides), run_dir, ckpt


def load_policy(cfg: Config, ckpt: Path | None, log: Callable[[str], None] = print):
    """The run's policy with the checkpoint's trainable tensors (LoRA and any trained norms)."""
    from ebpo_lite.engine.checkpoint import read_tensors
    from ebpo_lite.engine.run import load_policy as build_policy

    state = None  # read first: a bad checkpoint fails before the model loads
    if ckpt is not None:
        then = "evaluate another checkpoint of the run (RUN/checkpoints/step_N)"
        state = read_tensors(ckpt / "trainable.safetensors", then)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    policy = build_policy(cfg, log=log)
    if state is not None:
        policy.load_trainable_state(state)
    policy.model.eval()
    return policy


def make_sampler(cfg: Config, policy: Any, backend: str, log: Callable[[str], None] = print):
    """vLLM when asked (or `auto` and importable), transformers otherwise; (sampler, name)."""
    import importlib.util

    if backend not in ("auto", "hf", "vllm"):
        raise UserError(f"--backend: expected auto, hf or vllm, got {backend!r}")
    want = backend
    if backend == "auto":
        backend = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if backend == "vllm":
        try:
            from ebpo_lite.rollout.vllm import VLLMRollout
        except ImportError as e:
            if want == "vllm":
                raise UserError(f"--backend vllm: vLLM is not usable here ({e})") from None
            log(f"vLLM not usable ({e}); sampling with transformers")
        else:
            sampler = VLLMRollout(cfg, policy, log=log)
            sampler.sync(policy, version=1)  # serves trained base tensors (norms) too, if any
            return sampler, "vllm"
    from ebpo_lite.rollout.hf import HFRollout

    return HFRollout(cfg.rollout, policy, micro_batch=64), "hf"


# ----------------------------------------------------------------------------- CLI: resumable runs


def _settings(args: argparse.Namespace, cfg: Config, ckpt: Path | None) -> dict[str, Any]:
    return {
        "target": args.target,
        "checkpoint": ckpt.name if ckpt else None,
        "k": args.k,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "system_prompt": cfg.data.system_prompt,
        "thinking": cfg.data.thinking,
        "extraction": EXTRACTION,  # results scored by another rule are not resumed
        **(
            {"reward": list(cfg.reward.functions)}
            if any(is_own_data(b) for b in args.benchmarks)
            else {}
        ),
    }


def _done_records(partial: Path, settings: dict[str, Any]) -> dict[tuple[str, int], dict]:
    rows = read_jsonl(partial)
    if rows and rows[0].get("settings") != settings:
        old = rows[0].get("settings")
        diff = {k: (old or {}).get(k) for k in settings if (old or {}).get(k) != settings[k]}
        raise UserError(
            f"{partial}: holds results for other settings {diff}; delete it or choose another --out"
        )
    return {(r["benchmark"], r["index"]): r for r in rows[1:]}


def run_benchmark(
    args, cfg, policy, sampler, bench: str, partial: Path, done: dict, reward=None
) -> list[dict]:
    """All records of one benchmark, generating only the problems not yet in `partial`;
    `reward` scores own data (`is_own_data`)."""
    from tqdm import tqdm

    from ebpo_lite.data.prompts import prompt_digest

    examples = benchmark_examples(bench, cfg.data)[: args.limit or None]
    for i, ex in enumerate(examples):
        r = done.get((bench, i))
        if r is not None and r["prompt_sha1"] != prompt_digest(ex.prompt):
            raise UserError(f"{partial}: {bench} problem {i} differs from the file's; delete it")
    todo = [i for i in range(len(examples)) if (bench, i) not in done]
    bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc=bench, unit="problem")
    bs = args.batch_size
    for start in range(0, len(examples), bs):
        idx = [i for i in todo if start <= i < start + bs]
        if not idx:
            continue
        exs = [examples[i] for i in idx]
        raw = prompt_raw(bench)
        prompts = [
            encode_prompt(policy.tokenizer, ex, cfg.data, raw=raw, truncate=False) for ex in exs
        ]
        recs = eval_examples(
            sampler,
            policy.tokenizer,
            bench,
            exs,
            idx,
            prompts,
            args.k,
            chunk_seed(args.seed, bench, start),
            args.temperature,
            args.max_new_tokens,
            cfg.reward.timeout_s,
            reward if is_own_data(bench) else None,
        )
        append_jsonl(partial, recs)
        done.update({(bench, r["index"]): r for r in recs})
        bar.update(len(recs))
    bar.close()
    return [done[(bench, i)] for i in range(len(examples))]


def _longest_prompt(d: DataConfig, tokenizer, benches: list[str], limit: int) -> int:
    longest = 1
    for bench in benches:
        for ex in benchmark_examples(bench, d)[: limit or None]:
            prompt = encode_prompt(tokenizer, ex, d, raw=prompt_raw(bench), truncate=False)
            longest = max(longest, len(prompt))
    return longest


def format_table(per_bench: dict[str, dict[str, float]], k: int) -> str:
    cols = ["pass@1", f"maj@{k}", f"pass@{k}"] if k > 1 else ["pass@1"]
    head = f"{'benchmark':<16}{'n':>6}" + "".join(f"{c:>10}" for c in cols)
    lines = [head, "-" * len(head)]
    for name, m in per_bench.items():
        n = m.get("num_problems", "")
        lines.append(f"{name:<16}{n:>6}" + "".join(f"{m[c]:>10.4f}" for c in cols))
    return "\n".join(lines)


def _benchmark_names(text: str | None) -> list[str]:
    """The --benchmark list ([] when not given: `evaluate` picks by target); one line for a name
    that is neither a benchmark nor a data file."""
    if text is None:
        return []
    benches = [b.strip() for b in text.split(",") if b.strip()]
    if not benches:
        raise UserError("--benchmark: name at least one benchmark")
    from ebpo_lite.presets import BENCHMARKS

    known = ("arithmetic", *BENCHMARKS, HELD_OUT)
    for b in benches:
        if b not in known and not is_own_data(b):
            raise UserError(
                f"--benchmark: unknown {b!r} (expected some of {', '.join(known)}, or a "
                ".json, .jsonl or .parquet file)"
            )
    return benches


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI's work: load, generate what is missing, summarise, write JSON, print the table."""
    benches = _benchmark_names(args.benchmark)
    for name in ("k", "batch_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.limit < 0:
        raise UserError(f"--limit: must be >= 0, got {args.limit}")
    if args.temperature is not None and args.temperature < 0:
        raise UserError(f"--temperature: must be >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.out and Path(args.out).is_dir():
        raise UserError(f"--out: {args.out} is a folder; give a JSON file path")
    cfg, run_dir, ckpt = load_target(args.target, args.overrides)
    if not benches:  # a run: its own held-out data; a model: math500
        benches = [HELD_OUT] if run_dir is not None else ["math500"]
    args.benchmarks = benches
    if run_dir is not None and ckpt is None:
        print(f"{run_dir}: no checkpoint yet; evaluating the base model", file=sys.stderr)
    args.temperature = (
        args.temperature if args.temperature is not None else (0.6 if args.k > 1 else 0.0)
    )
    args.max_new_tokens = args.max_new_tokens or (
        (cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens) if run_dir else 4096
    )
    out = Path(args.out or (run_dir / "eval.json" if run_dir else "eval.json"))
    partial = Path(f"{out}.partial.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    for bench in benches:  # missing data fails (or downloads) before anything is written or loaded
        benchmark_examples(bench, cfg.data)
    reward = None
    if any(is_own_data(b) for b in benches):  # the run's first reward, as the in-training eval's
        from ebpo_lite.engine.run import reward_functions

        reward = reward_functions(cfg.reward, cfg.data)[0][0][1]
    done = _done_records(partial, _settings(args, cfg, ckpt))
    policy = load_policy(cfg, ckpt)
    longest = _longest_prompt(cfg.data, policy.tokenizer, benches, args.limit)
    top_p = args.top_p if args.temperature > 0 else 1.0
    scfg = dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(
            cfg.rollout, top_p=top_p, top_k=0, min_p=0.0, max_new_tokens=args.max_new_tokens
        ),
        data=dataclasses.replace(cfg.data, max_prompt_tokens=max(longest, 1)),
    )
    sampler, backend = make_sampler(scfg, policy, args.backend)
    if not partial.is_file() or not partial.read_text().strip():  # written once the model loaded
        append_jsonl(partial, [{"settings": _settings(args, cfg, ckpt)}])
    per_bench: dict[str, dict[str, float]] = {}
    try:
        for bench in benches:
            per_bench[bench] = summarize(
                run_benchmark(args, cfg, policy, sampler, bench, partial, done, reward), args.k
            )
    finally:
        sampler.close()
        if reward is not None:
            from ebpo_lite.rewards import close_contained

            close_contained([reward])
    result = {
        "settings": {**_settings(args, cfg, ckpt), "backend": backend, "limit": args.limit},
        "benchmarks": per_bench,
        "mean": mean_over_benchmarks(per_bench),
    }
    write_atomic(out, json.dumps(result, indent=2))
    table = dict(per_bench)
    if len(per_bench) > 1:
        table["mean"] = result["mean"]
    print(format_table(table, args.k))
    print(f"results: {out} (per-problem records: {partial})")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=cli.prog("python -m ebpo_lite.eval"),
        description="Pass@1 over k samples, maj@k and pass@k of a run or a model on benchmarks.",
    )
    p.add_argument("target", help="training output_dir, RUN/checkpoints/step_N, model dir or id")
    p.add_argument("overrides", nargs="*", help="section.key=value applied to the config")
    p.add_argument(
        "--benchmark",
        default=None,
        help="comma list: arithmetic, math500, ..., held-out (the run's own; the default for a "
        "run), or a .jsonl/.json/.parquet file read with the run's data settings (default for a "
        "model: math500)",
    )
    p.add_argument("--k", type=int, default=1, help="samples per problem (default 1)")
    p.add_argument("--temperature", type=float, default=None, help="default 0.6 (k>1) / 0 (k=1)")
    p.add_argument("--top-p", type=float, default=0.95, help="when sampling (default 0.95)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="default: the run's; 4096")
    p.add_argument("--limit", type=int, default=0, help="first N problems per benchmark")
    p.add_argument("--out", default=None, help="JSON file (default RUN_DIR/eval.json)")
    p.add_argument("--backend", default="auto", choices=("auto", "hf", "vllm"))
    p.add_argument("--batch-size", type=int, default=16, help="problems per generate call")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_intermixed_args(argv)
    return cli.run(evaluate, args)


if __name__ == "__main__":
    sys.exit(main())
