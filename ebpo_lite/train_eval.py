"""The periodic eval inside training: `evaluate_policy(run)`, one sampling phase.

Metrics: `eval/accuracy` (held-out problems at `eval.temperature`, greedy by default, scored by the
run's first reward), `eval/expected_accuracy` (tiny task: the exact probability that one
temperature-1 sample is right, from the trainer's forward pass: no sampling noise), and, when
each also per type where the problems carry labels (`eval/accuracy/topic=add`,
`eval/accuracy/difficulty=2`, ...), and, when `eval.benchmarks` is set, `eval/<bench>/pass@1`, `eval/<bench>/maj@k`, `eval/<bench>/pass@k` with
`eval.k` samples (`ebpo_lite.eval`'s metrics); `time/eval_s` is the wall time of all of it.
With more than one reward function, `eval/reward` is the mean of their weighted sum (the
training reward, without `reward.length_penalty`) over the same completions; `eval/accuracy` is
the first function's alone. With a user reward function first, `eval/reward_errors` counts its
masked scores (left out of `eval/accuracy`, as in training; see `rewards/contained.py`). With `math_answer` first,
`eval/extraction/<method>` is the share of held-out completions whose answer came from a box,
GSM8K's `####`, math-verify's free-text extraction, or nothing (`rewards/judge.py`); benchmarks
report the same per benchmark (`eval/<bench>/extraction/<method>`).

Sampler: the run's own engine when `rollout.backend` is vllm (or unsloth) and the eval's prompts +
`eval.max_new_tokens` fit its context: the colocated engine already serves the current adapter
(synced after every step) and schedules its KV cache itself, so all prompts go in one call.
Otherwise transformers `generate` in chunks of prompts that fit the memory free at that moment
(`plan.eval_chunk_size`; a fixed size on CPU), with the vLLM engine, if any, put to sleep first.
Greedy completions do not depend on the chunking.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from ebpo_lite.data.loader import encode_prompt, is_arithmetic
from ebpo_lite.engine.episodes import episode_metrics
from ebpo_lite.engine.tools import reward_inputs
from ebpo_lite.eval import (
    benchmark_examples,
    chunk_seed,
    eval_examples,
    mean_over_benchmarks,
    summarize,
)
from ebpo_lite.rewards import (
    ContainedReward,
    combine_rewards,
    extraction_shares,
    judge_math,
    math_answer,
    reward_columns,
    take_error_counts,
)

if TYPE_CHECKING:
    from ebpo_lite.engine.run import Run

BENCHMARK_CHUNK = 64  # problems per eval_examples call (fixes each chunk's sampling seed)


def evaluate_policy(run: Run) -> dict[str, Any]:
    """The eval metrics of the policy now (see the module docstring); {} when nothing to do."""
    cfg, policy = run.cfg, run.policy
    examples = run.eval_examples[: cfg.eval.num_examples]
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if examples:
        prompts = [encode_prompt(policy.tokenizer, ex, cfg.data) for ex in examples]
        if run.episodes is not None:  # tool use: the prompts as training renders them
            prompts = [run.episodes.encode(ex) for ex in examples]
        sampler = eval_sampler(run, prompts, 1, max_new)
        roll = sample(run, sampler, examples, prompts, max_new)
        if roll.episodes is not None:  # an episode's answer is its last model turn
            texts = [ep.final_text for ep in roll.episodes]
            out.update(episode_metrics(roll.episodes, prefix="eval/env"))
        else:
            texts = policy.tokenizer.batch_decode(roll.completion_ids, skip_special_tokens=True)
        _, fn = run.reward_fns[0]
        golds = [ex.answer for ex in examples]
        if fn is math_answer:  # the same scores, with the extraction method of each
            judged = judge_math(texts, golds, timeout_s=cfg.reward.timeout_s)
            scores = judged.scores
            shares = extraction_shares(judged.methods).items()
            out.update({f"eval/extraction/{m}": v for m, v in shares})
        else:  # called as in training: TRL's signature, every column by name
            columns = {**reward_columns(examples), **reward_inputs(run.tools, len(texts))[0]}
            scores = fn(completions=texts, timeout_s=cfg.reward.timeout_s, **columns)
        out.update(per_type_means("eval/accuracy", scores, examples))
        if len(run.reward_fns) > 1:  # the training reward: every function, weighted
            out["eval/reward"] = _total_reward(run, scores, texts, examples)
        if isinstance(fn, ContainedReward):  # a user function: masked scores are left out
            out["eval/reward_errors"] = take_error_counts([fn])["reward/errors"]
        if is_arithmetic(cfg.data) and run.episodes is None:  # one-turn answers only
            exact = expected_accuracies(policy, prompts, [ex.answer for ex in examples])
            out.update(per_type_means("eval/expected_accuracy", exact, examples))
    if cfg.eval.benchmarks:
        out.update(_benchmark_metrics(run, max_new))
    if out:
        out["time/eval_s"] = time.perf_counter() - t0
    return out


def sample(run: Run, sampler: Any, examples: list, prompts: list[list[int]], max_new: int):
    """One completion per held-out prompt at `eval.temperature`: one `generate`, or with tool
    use whole episodes (engine/episodes.py), on `sampler`."""
    cfg = run.cfg
    kwargs = dict(seed=cfg.train.seed, temperature=cfg.eval.temperature, max_new_tokens=max_new)
    if run.episodes is not None:
        return run.episodes.run(sampler, examples, prompts, 1, **kwargs)
    return sampler.generate(prompts, 1, **kwargs)


def _total_reward(run: Run, scores: list, texts: list[str], examples: list) -> float:
    """Mean over held-out completions of the weighted sum of all reward functions (`scores`: the
    first one's, already computed); completions any function could not score are left out."""
    rest, _ = combine_rewards(
        dict(run.reward_fns[1:]),
        run.reward_weights[1:],
        texts,
        timeout_s=run.cfg.reward.timeout_s,
        **reward_columns(examples),
        **reward_inputs(run.tools, len(texts))[0],  # tool use: `environments`
    )
    first = run.reward_fns[0][1]
    take_error_counts([f for _, f in run.reward_fns[1:] if f is not first])  # not a step's errors
    w = run.reward_weights[0]
    totals = [None if a is None or b is None else w * a + b for a, b in zip(scores, rest)]
    kept = [t for t in totals if t is not None]
    return sum(kept) / len(kept) if kept else float("nan")


def eval_sampler(run: Run, prompts: list[list[int]], k: int, max_new: int) -> Any:
    """The run's engine if these prompts + `max_new` fit its context, else chunked transformers.

    Either way the sampling phase starts here: the engine is woken once for all chunks, or put to
    sleep so that transformers has its memory.
    """
    from ebpo_lite.model.plan import eval_chunk_size
    from ebpo_lite.rollout.hf import HFRollout

    backend, cfg = run.backend, run.cfg
    longest = max((len(p) for p in prompts), default=0)
    limit = getattr(backend, "max_model_len", 0)
    if cfg.rollout.backend != "hf" and longest + max_new <= limit:
        backend.wake()
        return backend
    backend.sleep()
    chunk = eval_chunk_size(cfg, run.policy, k, longest, max_new)
    return HFRollout(cfg.rollout, run.policy, micro_batch=chunk)


def _benchmark_metrics(run: Run, max_new: int) -> dict[str, float]:
    """`eval/<bench>/<metric>` over the first `eval.num_examples` problems of each benchmark."""
    cfg, tok = run.cfg, run.policy.tokenizer
    k, out = cfg.eval.k, {}
    per_bench = {}
    for bench in cfg.eval.benchmarks:
        examples = benchmark_examples(bench, cfg.data)[: cfg.eval.num_examples or None]
        prompts = [encode_prompt(tok, ex, cfg.data, raw=bench == "arithmetic") for ex in examples]
        sampler = eval_sampler(run, prompts, k, max_new)
        records = []
        step = BENCHMARK_CHUNK
        for s in range(0, len(examples), step):
            records += eval_examples(
                sampler,
                tok,
                bench,
                examples[s : s + step],
                list(range(s, s + len(examples[s : s + step]))),
                prompts[s : s + step],
                k,
                chunk_seed(cfg.train.seed, bench, s),
                cfg.eval.temperature,
                max_new,
                cfg.reward.timeout_s,
            )
        per_bench[bench] = summarize(records, k)
        for key, v in per_bench[bench].items():
            if key in ("pass@1", f"maj@{k}", f"pass@{k}") or key.startswith("extraction/"):
                out[f"eval/{bench}/{key}"] = v
    if len(per_bench) > 1:
        for key, v in mean_over_benchmarks(per_bench).items():
            if key in ("pass@1", f"maj@{k}", f"pass@{k}"):
                out[f"eval/mean/{key}"] = v
    return out


@torch.no_grad()
def expected_accuracies(policy, prompts: list[list[int]], answers: list[str]) -> list[float]:
    """Per problem, P(answer + EOS | prompt) under the policy at temperature 1."""
    tok = policy.tokenizer
    targets = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in answers]
    return [math.exp(sum(lp)) for lp in policy.token_logprobs(prompts, targets)]


def per_type_means(key: str, values: list, examples: list) -> dict[str, float]:
    """`key` (mean over all), `key/topic=T` and `key/difficulty=D` (means per type).

    None values (unscorable) are left out of every mean; a type with none left is not reported.
    """
    groups: dict[str, list[float]] = {key: []}
    for v, ex in zip(values, examples):
        if v is None:
            continue
        names = [key]
        if ex.topic is not None:
            names.append(f"{key}/topic={ex.topic}")
        if ex.difficulty is not None:
            names.append(f"{key}/difficulty={ex.difficulty:g}")
        for name in names:
            groups.setdefault(name, []).append(float(v))
    out = {name: sum(vs) / len(vs) for name, vs in sorted(groups.items()) if vs}
    out.setdefault(key, float("nan"))
    return out
