"""Per-example labels a run needs (`data.labels_path`), and where they come from.

Which kinds a config needs (`needed`): `topic` for `curriculum.sampler: topic` or
`algo.prior_key: topic`; `difficulty` (the base policy's pass rate) for `curriculum.sampler:
difficulty` or `algo.prior_key: difficulty`.

- A file path: written beforehand by `ebpo-lite label difficulty` or `python -m
  ebpo_lite.data.topics`. When it is missing the run stops before anything loads, with the exact
  command that writes it (`check_path`, called by `checks.before_load`).
- `auto`: the run makes them itself, before its first step, and reuses them on later runs. Each
  kind goes to `<cache>/labels/<data>-<kind>-<digest>.jsonl` (the cache is EBPO_LITE_CACHE, default
  ~/.cache/ebpo_lite). The digest covers everything the labels depend on, so a run with other data
  or another model gets its own file, and any other run reuses it. Topics come from
  `topics.topic_labels` (the dataset's field, else k-means of embeddings, k = 9) before the model
  loads. Pass rates come from `label_prompts` (which `ebpo-lite label difficulty` runs too)
  with the run's own model and sampler (16 samples per prompt at temperature 1.0; the fresh
  adapter is the base policy) after the model loads. A labelling run cut short resumes.
The pass-rate labeller itself lives here (`label_prompts`, `pass_rates`), so the run and the
`difficulty` command share it without importing each other.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ebpo_lite.errors import ConfigError, UserError

if TYPE_CHECKING:
    from ebpo_lite.config import (
        AlgoConfig,
        Config,
        CurriculumConfig,
        RolloutConfig,
        TrainConfig,
    )
    from ebpo_lite.data.example import Example

AUTO = "auto"
TOOLS = {"difficulty": "ebpo-lite label difficulty", "topic": "ebpo-lite label topics"}


def needed(c: CurriculumConfig, a: AlgoConfig) -> list[str]:
    """The label kinds the config uses, topic first."""
    uses = {c.sampler, a.prior_key}
    return [kind for kind in ("topic", "difficulty") if kind in uses]


def command(cfg: Config, out: str) -> str:
    """The command line that writes the labels file `out` for this config: the recipe and
    overrides it was loaded from (`config.origin`), less `output_dir` and `data.labels_path`."""
    from ebpo_lite.config import origin

    kinds = needed(cfg.curriculum, cfg.algo)
    tool = TOOLS["topic" if kinds == ["topic"] else "difficulty"]
    recipe, overrides = origin(cfg)
    keep = [o for o in overrides if not o.startswith(("output_dir=", "data.labels_path="))]
    args = [recipe or "RECIPE.yaml", *keep, "--out", out]
    return f"{tool} " + " ".join(shlex.quote(a) for a in args)


def check_path(cfg: Config) -> None:
    """A `data.labels_path` file that is not there: one line with the command that writes it."""
    path = cfg.data.labels_path
    if path is None or path == AUTO or Path(path).is_file():
        return
    raise ConfigError(
        f"data.labels_path: {path} not found; write it first with: {command(cfg, path)} "
        "(or set data.labels_path=auto to make it in this run, or data.labels_path=null)"
    )


def auto_path(cfg: Config, kind: str) -> Path:
    """Where `auto` keeps labels of `kind` for this config (see the module docstring)."""
    from ebpo_lite.config import to_dict
    from ebpo_lite.model.tiny import cache_root

    d = to_dict(cfg)
    data = {k: v for k, v in d["data"].items() if k != "labels_path"}
    key: dict[str, Any] = {"kind": kind, "data": data}
    if kind == "difficulty":  # what the base policy's samples and their scores depend on
        skip = ("lora_", "gradient_checkpointing", "trainable_extra", "device")
        key["model"] = {k: v for k, v in d["model"].items() if not k.startswith(skip)}
        key["reward"] = d["reward"]
        key["rollout"] = {k: d["rollout"][k] for k in ("max_new_tokens", "top_p", "top_k", "min_p")}
        key["sampling"] = [K, TEMPERATURE, d["train"]["seed"]]
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    source = Path(cfg.data.path).stem if cfg.data.path else cfg.data.name
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in source)
    return cache_root() / "labels" / f"{name}-{kind}-{digest}.jsonl"


def auto_batch_size(t: TrainConfig, r: RolloutConfig) -> int:
    """Prompts per sampling call of `auto`: K samples each, as many sequences as a training step
    samples (which the run's memory plan allows for)."""
    return max(1, t.prompts_per_step * r.group_size // K)


def maybe_topic_labels(
    cfg: Config, examples: list[Example], log: Callable[[str], None] = print
) -> list[Example]:
    """With `data.labels_path=auto`: say which labels the run makes, and make / reuse the topic
    labels (before the model loads)."""
    if cfg.data.labels_path != AUTO:
        return examples
    kinds = needed(cfg.curriculum, cfg.algo)
    if not kinds:
        log(
            "data.labels_path=auto: nothing here uses labels (curriculum.sampler="
            f"{cfg.curriculum.sampler}, algo.prior_key={cfg.algo.prior_key}); none made"
        )
        return examples
    if "topic" not in kinds:
        return examples
    from ebpo_lite.data import mathdata, topics

    out = auto_path(cfg, "topic")
    if out.is_file():
        log(f"data.labels_path=auto: topic labels reused from {out}")
    else:
        names, method = topics.topic_labels(examples, "auto")
        topics.write_labels(out, examples, names)
        log(f"data.labels_path=auto: {len(set(names))} topics ({method}) written to {out}")
    return mathdata.apply_labels(examples, out)


def maybe_difficulty_labels(
    cfg: Config,
    examples: list[Example],
    prompts: list[list[int]],
    policy: Any,
    sampler: Any,
    reward: tuple[list, list[float]],
    log: Callable[[str], None] = print,
) -> list[Example]:
    """With `data.labels_path=auto` and a config that uses difficulty: the base policy's pass
    rates, sampled with the run's own sampler (or reused), applied to `examples`."""
    if cfg.data.labels_path != AUTO or "difficulty" not in needed(cfg.curriculum, cfg.algo):
        return examples
    from ebpo_lite.data import mathdata
    from ebpo_lite.data.jsonl import read_jsonl

    out = auto_path(cfg, "difficulty")
    done = {r.get("index") for r in read_jsonl(out)}
    if all(i in done for i in range(len(examples))):
        log(f"data.labels_path=auto: difficulty labels reused from {out}")
    else:
        log(
            f"data.labels_path=auto: labelling {len(examples) - len(done)} prompts by the base "
            f"model's pass rate ({K} samples each) into {out}"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        sampler.wake()
        try:
            label_prompts(
                cfg, examples, prompts, sampler, policy.tokenizer, reward, out,
                max_new_tokens=cfg.rollout.max_new_tokens,
                batch_size=auto_batch_size(cfg.train, cfg.rollout),
            )  # fmt: skip
        finally:
            sampler.sleep()
    return mathdata.apply_labels(examples, out)


# ----------------------------------------------------------------------------- pass rates


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


def check_file(out: Path, examples: list, k: int, temperature: float) -> set[int]:
    """The indices a labels file being resumed already holds; UserError if its rows were made
    with other settings or for other data."""
    from ebpo_lite.data.jsonl import read_jsonl
    from ebpo_lite.data.prompts import prompt_digest

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
    function) pairs and weights). `ebpo-lite label difficulty` and `data.labels_path=auto`
    both label through here, with the same seeds."""
    from tqdm import tqdm

    from ebpo_lite import rewards
    from ebpo_lite.data.jsonl import append_jsonl
    from ebpo_lite.data.prompts import prompt_digest

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


def check_sampler_labels(cfg: Config, examples: list[Example]) -> None:
    """`curriculum.sampler=topic` / `difficulty` over examples none of which has that label: one
    UserError before the model loads (the sampler would put every example in the topic 'other',
    or in one random order, and run as a plain shuffle while the run said it was a curriculum).
    Some examples without a label are the sampler's documented case (`curriculum.py`); labels
    that `data.labels_path=auto` makes are not there yet for difficulty, so that is left alone."""
    kind = cfg.curriculum.sampler
    if kind not in ("topic", "difficulty") or (
        kind == "difficulty" and cfg.data.labels_path == AUTO
    ):
        return
    if examples and all(getattr(ex, kind) is None for ex in examples):
        raise UserError(
            f"curriculum.sampler: {kind} needs a {kind} per example and none of the "
            f"{len(examples)} training examples has one; label them (data.{kind}_field, or "
            f"data.labels_path=auto), or set curriculum.sampler=shuffle"
        )


def prior_keys(examples: list[Example], key: str) -> list[str | int]:
    """Each example's key for the hierarchical prior (`algo.prior_key`), or one UserError naming
    the examples that lack it (checked before the model loads: it used to be a traceback at step
    1). A field of `Example` (`topic`, `difficulty`) or of its source row (`meta`).

    The EB prior keys on strings and ints (`ebprior`). A str or int value is its own key. Floats
    are binned, one rule for the whole data (docs/algorithm.md section 4): when every float is a
    whole number (MATH's `Level 3` -> 3.0, the tiny task's levels) each keys as that int; when
    every float lies in [0, 1] (`1 - pass_rate` labels) they key by quarter, as the strings
    `[0,0.25)` ... `[0.75,1]`; otherwise by their floor.
    """
    values, missing = [], []
    for i, ex in enumerate(examples):
        value = getattr(ex, key) if hasattr(ex, key) else ex.meta.get(key)
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        if not ok or (isinstance(value, float) and value != value):  # None, NaN, a list ...
            missing.append(i)
        values.append(value)
    if missing:
        what = f"no {key}" if key in ("topic", "difficulty") else f"no str or number {key!r}"
        fix = (
            f"label them (data.{key}_field or data.labels_path)"
            if key in ("topic", "difficulty")
            else "name a field every row has"
        )
        raise UserError(
            f"algo.prior_key: {len(missing)} of {len(examples)} training examples have {what} "
            f"(first: example {missing[0]}); {fix}, or set algo.prior_key=null"
        )
    floats = [v for v in values if isinstance(v, float)]
    if all(v.is_integer() for v in floats):
        return [int(v) if isinstance(v, float) else v for v in values]
    if all(0.0 <= v <= 1.0 for v in floats):
        return [_quarter(v) if isinstance(v, float) else v for v in values]
    return [int(v // 1) if isinstance(v, float) else v for v in values]


def _quarter(v: float) -> str:
    lo = min(int(v * 4), 3) / 4
    return f"[{lo:g},{lo + 0.25:g}{']' if lo == 0.75 else ')'}"
