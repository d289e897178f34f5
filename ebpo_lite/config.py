"""Typed, frozen configuration: one dataclass per concern.

A recipe is a YAML file whose top-level sections are the fields of `Config`; command-line
overrides are dotted `section.key=value` strings parsed as YAML scalars. The YAML key, the field
name and the log key are the same word. Unknown sections or keys, wrong types and out-of-range
values raise `ConfigError` whose message starts with the dotted key (`train.lr: ...`).

PyYAML reads `1e-5` as a string (YAML 1.1 wants `1.0e-5`): float fields accept such strings.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ebpo_lite.algo.loss_keys import check_loss_keys
from ebpo_lite.catalog import recipe_path
from ebpo_lite.errors import ConfigError
from ebpo_lite.presets import check_held_out, parse_eval_size  # noqa: F401 (re-exported)
from ebpo_lite.renamed import apply_renames

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "ebpo")
SAMPLERS = ("shuffle", "topic", "difficulty", "adaptive")
BACKENDS = ("hf", "vllm", "unsloth")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"  # "tiny" (built in, no download), a hub id, or a local folder
    load_in_4bit: bool = False  # NF4 base via bitsandbytes (QLoRA)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16/fp16 on GPU)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attn_implementation: str = "auto"  # auto | eager | sdpa | flash_attention_2
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    trainable_extra: list[str] = field(default_factory=list)  # name substrings, e.g. ["norm"]
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    sft_warmup_steps: int = 3000  # tiny model only: supervised warm-up, cached under ~/.cache
    sft_tool_share: float = 0.0  # tiny model only: warm-up share of calculator-tool episodes
    sft_seed: int = 0


@dataclass(frozen=True)
class DataConfig:
    name: str = "arithmetic"  # arithmetic(_chat): built in | a preset (gsm8k, ...) | a hub id
    path: str | None = None  # local json / jsonl / parquet file (overrides name's location)
    preset: str = "auto"  # schema preset; auto: guessed from name / path
    split: str = "train"
    prompt_field: str | None = None  # generic mapping for files no preset knows
    answer_field: str | None = None
    topic_field: str | None = None
    difficulty_field: str | None = None
    labels_path: str | None = (
        None  # per-example topic / pass-rate file, or auto (ebpo_lite.engine.labels)
    )
    data_dir: str | None = (
        None  # local copies of the presets (default EBPO_LITE_DATA; else the hub)
    )
    system_prompt: str | None = None  # None: the default "put the final answer in \boxed{}"
    thinking: bool = False  # Qwen3 thinking mode in the chat template
    skip_bad_rows: bool = False
    max_examples: int = 0  # 0: all
    max_prompt_tokens: int = 1024
    num_train: int = 4500  # arithmetic only: 1,500 per topic (about 11k distinct problems exist)
    num_eval: int = 256  # held-out problems: the arithmetic task's; the most eval_size=auto takes
    seed: int = 1234  # which arithmetic problems are generated; which rows eval_size holds out
    # held-out rows for the in-training eval (docs/data.md): auto (a preset's test set, else 10%
    # of the data, at most num_eval, from 10 rows on) | a fraction in (0, 1) | a count | 0 (none)
    eval_size: str = "auto"
    eval_path: str | None = None  # a separate held-out file, read as data.path is
    prompt_format: str = "auto"  # auto (raw for arithmetic, else chat) | chat | raw (as is)


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = "hf"  # hf | vllm | unsloth
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    hf_loop: str = "generate"  # hf backend: generate (transformers) | lean (rollout/hf.py)
    device: str = "auto"  # vLLM's device; a second GPU here gives the two-GPU layout
    # vLLM engine settings
    dtype: str = "auto"  # engine dtype; auto follows model.dtype (fp32 on CPU)
    max_model_len: int = 0  # 0: prompt + completion budget
    kv_cache_gb: float = 0.5  # CPU only: explicit KV-cache size (vLLM otherwise takes 90% of RAM)
    gpu_memory_utilization: float = 0.35
    max_lora_rank: int = 0  # 0: model.lora_rank rounded up to a size vLLM accepts
    sleep: str = "offload"  # GPU, while training: offload (weights to host RAM) | kv | none
    enforce_eager: bool = True


@dataclass(frozen=True)
class AlgoConfig:
    estimator: str = "ebpo"
    grpo_scale: str = "group"  # grpo only: group | batch | none
    # EBPrior options (docs/algorithm.md section 4); defaults are the paper's variant
    tau2: str = "raw"  # raw | moments
    sigma2: str = "total"  # total | within
    center: bool = True
    decay: float | None = None  # None: no decay; 0 < gamma < 1: exponentially weighted
    prior_key: str | None = None  # example field for the hierarchical prior: topic | difficulty
    min_count: int = 8
    tau2_min: float = 1e-6
    leave_one_out: bool = False  # ebpo: each completion's baseline leaves its own reward out
    prompt_prior: bool = False  # ebpo: shrink toward the prompt's posterior from earlier visits
    prompt_capacity: int = 200_000  # prompt_prior: most prompts remembered (about 250 B each)
    # loss (docs/losses.md); keys named as TRL 1.16's GRPOConfig where the meaning is the same
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # cispo: the ratio's cap is 1 + clip_eps_high
    loss_agg: str = "token_mean"  # token_mean | seq_mean | token_sum_norm (Dr. GRPO's)
    # loss_type null: the clipped loss aggregated as loss_agg says (token_mean = dapo,
    # seq_mean = grpo, token_sum_norm = dr_grpo); set, it picks the loss and its aggregation
    loss_type: str | None = None  # grpo | dr_grpo | dapo | bnpo | cispo | sapo | luspo | vespo
    importance_sampling_level: str = "token"  # token | sequence (GSPO's sequence ratio)
    delta: float | None = None  # clipped losses: also cap the ratio at delta (two-sided clip)
    # DAPO's overlong filtering: completions with no stop token leave the loss; the EB prior,
    # the advantages and the curriculum still count their rewards
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0  # train on the top q of tokens by entropy only (1: all)
    sapo_temperature_pos: float = 1.0  # sapo: gate temperature where A > 0
    sapo_temperature_neg: float = 1.05  # sapo: gate temperature where A <= 0
    vespo_k_pos: float = 2.0  # vespo: gamma weight's power, A >= 0
    vespo_lambda_pos: float = 3.0  # vespo: gamma weight's decay, A >= 0
    vespo_k_neg: float = 3.0  # vespo: power, A < 0
    vespo_lambda_neg: float = 2.0  # vespo: decay, A < 0
    kl_coef: float = 0.0  # k3 KL to the adapter-disabled base
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators)
    use_bias_correction_kl: bool = False  # times each token's ratio (TRL's default is true)
    num_iterations: int = 1  # optimisation passes over one rollout batch
    is_correction: str = "token"  # none | token | sequence: sampler/trainer mismatch correction
    is_cap: float = 2.0  # truncation of the importance ratio


@dataclass(frozen=True)
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["auto"])  # auto: by dataset
    weights: list[float] = field(default_factory=list)  # empty: all 1.0
    # seconds: the limit per answer of built-in math verification (math_answer; a timeout scores
    # 0.0), and per batch (one call, every completion of a draw) of a user `module:function`
    # (a timeout masks that batch; see rewards/contained.py)
    timeout_s: float = 5.0
    length_penalty: float = 0.0  # DAPO overlong penalty at max_new_tokens, linear ramp from start
    length_penalty_start: float = 0.8


@dataclass(frozen=True)
class CurriculumConfig:
    sampler: str = "shuffle"  # shuffle | topic | difficulty | adaptive
    topic_order: list[str] = field(default_factory=list)  # empty: order of first appearance
    run_length: int = 4  # topic: batches per topic run
    repeat: bool = True  # difficulty: start over after one pass (False: stop)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    max_extra_draws: int = 2  # dynamic sampling: extra batches drawn at most per step


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn tool use (docs/tools.md): TRL's environment contract."""

    # module:Class, one instance per episode; or {name: module:Class}, by the `environment` column
    factory: str | dict[str, str] | None = None
    tools: list[str] = field(default_factory=list)  # module:function tools without state
    max_turns: int = 4  # model turns per episode (each tool round is one)
    max_tool_response_tokens: int = 256  # a longer tool result is cut, with a marker
    tool_timeout_s: float = 10.0  # per call: a hung tool is killed, the model told so
    format: str = "auto"  # how calls are written: auto (tiny for the tiny model, else chat)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float = 1.0
    schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    prompts_per_step: int = 32
    mini_batches: int = 1  # optimizer steps per rollout batch (the paper: 512 / 128 = 4)
    micro_batch_size: int = 64  # sequences per forward/backward; accumulation over the rest
    share_prompts: bool = True  # one forward per distinct prompt of a micro-batch (exact)
    checkpoint_every: int = 50  # 0: only at the end
    keep_checkpoints: int = 2
    stop_after: int = 0  # stop cleanly after this many steps of this invocation (0: never)
    resume: bool = False
    overwrite: bool = False  # a fresh run in an output_dir with checkpoints replaces them
    threads: int = 0  # torch threads on CPU; 0: leave torch's default
    max_consecutive_skips: int = 5  # steps in a row skipped on NaN / inf before the run stops


@dataclass(frozen=True)
class EvalConfig:
    every: int = 50  # 0: only before the first and after the last step
    num_examples: int = 256  # held-out problems used by the in-training eval
    benchmarks: list[str] = field(default_factory=list)  # e.g. [math500, aime24]
    k: int = 1
    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int = 0  # 0: rollout.max_new_tokens


@dataclass(frozen=True)
class LogConfig:
    progress: str = "auto"  # auto | bar | lines | none
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "ebpo_lite"
    # what the model writes (ebpo_lite/engine/samples.py, docs/monitoring.md)
    show_completions: int = 2  # completions printed at the first step and each eval step; 0: off
    completions_every: int = 10  # steps between writes of completions.jsonl; 0: never


@dataclass(frozen=True)
class Config:
    output_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ----------------------------------------------------------------------------- parsing


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a recipe (a path, or a packaged recipe's name: `catalog.recipe_path`) and apply
    `section.key=value` overrides; validate everything."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(recipe_path(path))
    for item in overrides:
        _apply_override(raw, item)
    apply_renames(raw)  # older keys (renamed.py), e.g. rollout.sleep_between_phases
    cfg = _build(Config, raw, prefix="")
    validate(cfg)
    # where it came from, for commands printed back to the user (not a field: never dumped)
    object.__setattr__(cfg, "_origin", (None if path is None else str(path), tuple(overrides)))
    return cfg


def origin(cfg: Config) -> tuple[str | None, tuple[str, ...]]:
    """The recipe path and overrides `load` built `cfg` from; (None, ()) when not known (a
    config made in code or by `dataclasses.replace`)."""
    return getattr(cfg, "_origin", (None, ()))


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        what = "is a folder, not a recipe file" if path.is_dir() else "recipe file not found"
        raise ConfigError(
            f"{path}: {what}; give the path of a YAML recipe, e.g. recipes/tiny_cpu.yaml, "
            "or a packaged recipe's name (ebpo-lite recipes lists them)"
        )
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ConfigError(
            f"{path}:{e.line}: {e.key!r} is set a second time here, and YAML would silently keep "
            "only the last; merge the two or delete one"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(
            f"{where}: not valid YAML ({getattr(e, 'problem', e)}); fix the indentation, "
            "colon or bracket there"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    if data is None:
        raise ConfigError(
            f"{path}: the recipe is empty; start from a packaged one (ebpo-lite recipes lists "
            "them), e.g. recipes/tiny_cpu.yaml"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections at the top level (model:, data:, train:, ...), "
            f"got a {type(data).__name__}"
        )
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int):
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key set twice in one mapping is an error."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"{item}: overrides are written key=value, e.g. train.steps=20")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        # meant as a list or mapping: never take it literally as a string
        if text.strip().startswith(("[", "{")):
            raise ConfigError(
                f"{key}: {text!r} is not a valid list or mapping ({getattr(e, 'problem', e)}); "
                f"write it as {key}=[a,b] or {key}={{k: v}}"
            ) from None
        value = text
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            head = key[: key.index(p) + len(p)]
            raise ConfigError(f"{key}: {head} is a value, not a section; write {head}=VALUE")
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        first = dataclasses.fields(cls)[0].name
        raise ConfigError(
            f"{where}: expected a section of keys, got {raw!r}; set its keys one by one, "
            f"e.g. {where}.{first}=..."
        )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            kind = "section" if not prefix else "key"
            raise ConfigError(
                f"{prefix}{key}: unknown {kind} (expected one of: {', '.join(sorted(names))})"
                + _did_you_mean(str(key), names, prefix)
            )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            kwargs[f.name] = _build(typ, raw[f.name], prefix=f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = _coerce(raw[f.name], typ, f"{prefix}{f.name}")
    return cls(**kwargs)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        if isinstance(value, dict) and any(typing.get_origin(a) is dict for a in args):
            return _coerce(value, next(a for a in args if typing.get_origin(a) is dict), key)
        return _coerce(value, args[0], key)
    if origin is dict:  # {str: str}
        if not isinstance(value, dict) or not value:
            raise ConfigError(f"{key}: expected a mapping of names to values, got {value!r}")
        return {str(k): _coerce(v, str, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        (inner,) = typing.get_args(typ)
        if isinstance(value, str) and inner is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a float, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {typ}")  # pragma: no cover


# ----------------------------------------------------------------------------- validation


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _did_you_mean(value: str, choices, prefix: str = "") -> str:
    """'; did you mean X?' for a near miss (a typo), else ''."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _one_of(value: str, choices: tuple[str, ...] | list[str], key: str) -> None:
    hint = _did_you_mean(value, choices)
    _check(value in choices, key, f"expected one of {', '.join(choices)}, got {value!r}{hint}")


def validate(cfg: Config) -> None:
    """Range and choice checks; every message names the key."""
    m, d, r, a, rw, c, t, e = (
        cfg.model,
        cfg.data,
        cfg.rollout,
        cfg.algo,
        cfg.reward,
        cfg.curriculum,
        cfg.train,
        cfg.eval,
    )
    _check(bool(cfg.output_dir), "output_dir", "must not be empty")
    _check(bool(m.name), "model.name", "must not be empty")
    _one_of(m.dtype, ("auto", "float32", "bfloat16", "float16"), "model.dtype")
    _one_of(
        m.attn_implementation,
        ("auto", "eager", "sdpa", "flash_attention_2"),
        "model.attn_implementation",
    )
    _check(m.lora_rank >= 1, "model.lora_rank", f"must be >= 1, got {m.lora_rank}")
    _check(m.lora_alpha > 0, "model.lora_alpha", f"must be > 0, got {m.lora_alpha}")
    _check(
        0 <= m.lora_dropout < 1, "model.lora_dropout", f"must be in [0, 1), got {m.lora_dropout}"
    )
    _check(m.sft_warmup_steps >= 0, "model.sft_warmup_steps", "must be >= 0")
    _check(0 <= m.sft_tool_share <= 1, "model.sft_tool_share", "must be in [0, 1]")
    _check(bool(m.device), "model.device", "must not be empty")
    _check(d.max_examples >= 0, "data.max_examples", "must be >= 0")
    _check(d.num_train >= 1, "data.num_train", "must be >= 1")
    _check(d.num_eval >= 0, "data.num_eval", "must be >= 0")
    check_held_out(d)
    _one_of(d.prompt_format, ("auto", "chat", "raw"), "data.prompt_format")
    from ebpo_lite.presets import BENCHMARKS, PRESETS

    _one_of(d.preset, PRESETS, "data.preset")
    _one_of(r.backend, BACKENDS, "rollout.backend")
    _check(r.group_size >= 2, "rollout.group_size", f"must be >= 2, got {r.group_size}")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    _check(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _check(r.top_k >= 0, "rollout.top_k", f"must be >= 0, got {r.top_k}")
    _check(0 <= r.min_p < 1, "rollout.min_p", f"must be in [0, 1), got {r.min_p}")
    _one_of(r.hf_loop, ("generate", "lean"), "rollout.hf_loop")
    _one_of(r.sleep, ("offload", "kv", "none"), "rollout.sleep")
    _check(r.kv_cache_gb > 0, "rollout.kv_cache_gb", "must be > 0")
    _check(
        0 < r.gpu_memory_utilization < 1,
        "rollout.gpu_memory_utilization",
        f"must be in (0, 1), got {r.gpu_memory_utilization}",
    )
    _check(r.max_lora_rank >= 0, "rollout.max_lora_rank", "must be >= 0")
    _check(r.max_model_len >= 0, "rollout.max_model_len", "must be >= 0")
    _one_of(a.estimator, ESTIMATORS, "algo.estimator")
    _one_of(a.grpo_scale, ("group", "batch", "none"), "algo.grpo_scale")
    _one_of(a.tau2, ("raw", "moments"), "algo.tau2")
    _one_of(a.sigma2, ("total", "within"), "algo.sigma2")
    _check(a.decay is None or 0 < a.decay < 1, "algo.decay", f"must be in (0, 1), got {a.decay}")
    _check(a.min_count >= 1, "algo.min_count", "must be >= 1")
    _check(a.prompt_capacity >= 1, "algo.prompt_capacity", "must be >= 1")
    for flag in ("leave_one_out", "prompt_prior"):
        _check(
            not getattr(a, flag) or a.estimator == "ebpo",
            f"algo.{flag}",
            f"is an option of algo.estimator=ebpo, not {a.estimator}; set algo.estimator=ebpo "
            f"or algo.{flag}=false",
        )
    _check(a.clip_eps_low >= 0, "algo.clip_eps_low", "must be >= 0")
    _check(a.clip_eps_high >= 0, "algo.clip_eps_high", "must be >= 0")
    _check(
        a.loss_agg != "dr_grpo",
        "algo.loss_agg",
        "'dr_grpo' is now 'token_sum_norm' (Dr. GRPO's constant normaliser); "
        "algo.estimator=dr_grpo is the advantage",
    )
    _one_of(a.loss_agg, ("token_mean", "seq_mean", "token_sum_norm"), "algo.loss_agg")
    check_loss_keys(a)
    _check(a.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {a.kl_coef}")
    _check(a.num_iterations >= 1, "algo.num_iterations", "must be >= 1")
    _one_of(a.is_correction, ("none", "token", "sequence"), "algo.is_correction")
    _check(a.is_cap >= 1, "algo.is_cap", f"must be >= 1, got {a.is_cap}")
    _check(len(rw.functions) >= 1, "reward.functions", "name at least one reward function")
    _check(
        not rw.weights or len(rw.weights) == len(rw.functions),
        "reward.weights",
        f"expected {len(rw.functions)} weights (one per reward.functions), got {len(rw.weights)}",
    )
    _check(rw.timeout_s > 0, "reward.timeout_s", "must be > 0")
    _check(rw.length_penalty >= 0, "reward.length_penalty", "must be >= 0")
    _one_of(c.sampler, SAMPLERS, "curriculum.sampler")
    _check(c.run_length >= 1, "curriculum.run_length", "must be >= 1")
    _check(c.max_extra_draws >= 0, "curriculum.max_extra_draws", "must be >= 0")
    _check(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
    _check(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    _check(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    _check(
        len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas),
        "train.betas",
        f"expected two numbers in [0, 1), got {t.betas}",
    )
    _check(t.max_grad_norm > 0, "train.max_grad_norm", "must be > 0")
    _one_of(t.schedule, ("constant", "cosine"), "train.schedule")
    _check(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    _check(t.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
    _check(t.mini_batches >= 1, "train.mini_batches", "must be >= 1")
    _check(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    _check(t.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
    _check(t.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
    _check(t.stop_after >= 0, "train.stop_after", "must be >= 0")
    _check(
        not (t.resume and t.overwrite),
        "train.overwrite",
        "true together with train.resume=true: continue the run (resume) or replace its "
        "checkpoints (overwrite), not both",
    )
    _check(t.threads >= 0, "train.threads", "must be >= 0")
    _check(t.max_consecutive_skips >= 1, "train.max_consecutive_skips", "must be >= 1")
    _check(e.every >= 0, "eval.every", "must be >= 0")
    _check(e.num_examples >= 0, "eval.num_examples", "must be >= 0")
    _check(e.k >= 1, "eval.k", "must be >= 1")
    _check(e.temperature >= 0, "eval.temperature", "must be >= 0")
    for name in e.benchmarks:
        _one_of(name, ("arithmetic", *BENCHMARKS), "eval.benchmarks")
    v = cfg.env
    _check(v.max_turns >= 1, "env.max_turns", f"must be >= 1, got {v.max_turns}")
    _check(v.max_tool_response_tokens >= 1, "env.max_tool_response_tokens", "must be >= 1")
    _check(v.tool_timeout_s > 0, "env.tool_timeout_s", f"must be > 0, got {v.tool_timeout_s}")
    _one_of(v.format, ("auto", "tiny", "chat"), "env.format")
    _one_of(cfg.log.progress, ("auto", "bar", "lines", "none"), "log.progress")
    _check(cfg.log.show_completions >= 0, "log.show_completions", "must be >= 0 (0: off)")
    _check(cfg.log.completions_every >= 0, "log.completions_every", "must be >= 0 (0: never)")
