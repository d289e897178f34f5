"""Checks of a run's config against this machine and the paths it names, made before anything is
loaded, downloaded or written: a mistake then costs a second, not a model load, and leaves no
trace on disk.

Each raises a one-line `ConfigError` / `UserError` that names the key or path first and then says
what to do (`errors.py`). What is checked:
- `output_dir`: not a file (nor inside one); no checkpoints of another run unless `train.resume`
  or `train.overwrite`; a resumed run's recorded `config.yaml` agrees on every setting its
  checkpoint depends on (`RESUME_KEYS`), which would otherwise fail deep inside the model load
  or, worse, resume silently into a different run.
- the GPU stack against the config (`stack.check`, within `machine`): vLLM / Unsloth within the
  tested window, a bitsandbytes method in vLLM for a 4-bit run on a GPU, no trained base
  tensors with an NF4 vLLM copy, no 4-bit vLLM hub recipe on a machine without CUDA.
- the machine: `train.threads` within the CPU cores this process may use, a core left for
  vLLM's worker on CPU (measured on 2 cores: 2 trainer threads beside it made steps take
  0.1-2.4 s, 1 thread was steady), the packages `rollout.backend=vllm`, `model.load_in_4bit`,
  `log.wandb` and `log.tensorboard` need.
- `model.name`: `tiny`, `smollm2` (its package installed) or a `.gguf` file that exists
  (`base_model`), a local folder holding `config.json`, or a valid hub id: in the local cache,
  else (unless HF_HUB_OFFLINE is set) one question to the hub, within HUB_TIMEOUT_S, that its
  config.json is there (`hub_model`): never a download attempt for a mistyped path or id, and
  never a minute of retries without a network.
- `data.labels_path`: the file exists (or is `auto`); if not, the line is the command that
  writes it (`labels.check_path`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ebpo_lite.engine import checkpoint
from ebpo_lite.errors import ConfigError, UserError
from ebpo_lite.model.base_model import hub_model, model_name  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from ebpo_lite.config import Config, LogConfig

# Settings a resumed run must keep (refused when they differ): what the checkpoint's tensors fit
# (model.* names, shapes and scale; the tiny base's warm-up), the EB prior's and the curriculum's
# state, and the examples, their order and their prompt text, which the sampler's positions index
# (data.*). Any other changed setting is allowed and named in one line (`same_run`).
RESUME_KEYS = (
    "model.name",
    "model.lora_rank",
    "model.lora_alpha",
    "model.lora_target_modules",
    "model.trainable_extra",
    "model.sft_warmup_steps",
    "model.sft_seed",
    "model.sft_tool_share",
    "algo.estimator",
    "algo.prior_key",
    "algo.prompt_prior",
    "curriculum.sampler",
    "curriculum.topic_order",
    "data.name",
    "data.path",
    "data.preset",
    "data.split",
    "data.prompt_field",
    "data.answer_field",
    "data.topic_field",
    "data.difficulty_field",
    "data.labels_path",
    "data.system_prompt",
    "data.thinking",
    "data.skip_bad_rows",
    "data.max_examples",
    "data.max_prompt_tokens",
    "data.num_train",
    "data.num_eval",
    "data.seed",
)
# per invocation by design: never named when a resume changes them
QUIET_KEYS = ("output_dir", "train.resume", "train.overwrite", "train.stop_after")


def before_load(cfg: Config, log=print) -> None:
    """Every check of this module, cheapest first; nothing is read but small files."""
    from ebpo_lite.engine.labels import check_path

    output_dir(cfg, log)
    machine(cfg)
    model_name(cfg.model.name)
    check_path(cfg)  # a missing data.labels_path: the command that writes it


# ----------------------------------------------------------------------------- output_dir


def output_dir(cfg: Config, log=print) -> None:
    """A folder (or a path where one can be made) that holds no other run's checkpoints."""
    out = Path(cfg.output_dir)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                inside = "" if p == out else f", so {out} cannot be made inside it"
                raise ConfigError(
                    f"output_dir: {p} is a file, not a folder{inside}; pick another output_dir "
                    "or move the file away"
                )
            break
    found = checkpoint.latest(out)
    if found is None:
        return
    if not cfg.train.resume and not cfg.train.overwrite:
        raise ConfigError(
            f"output_dir: {out} already holds checkpoints (newest {found.name}); "
            "continue with train.resume=true, pick another output_dir, or replace them "
            "with train.overwrite=true"
        )
    if cfg.train.resume:
        done = checkpoint.step_of(found)
        if done > cfg.train.steps:
            raise ConfigError(
                f"train.steps: {cfg.train.steps} is below the {done} steps the run in {out} has "
                f"done ({found.name}); resume with train.steps={done} or more"
            )
        changed = same_run(cfg, out, found)
        if changed:
            log(f"train.resume: continuing {out} with changed settings: {', '.join(changed)}")


def same_run(cfg: Config, out: Path, found: Path) -> list[str]:
    """The recorded config of the run in `out` agrees with `cfg` on `RESUME_KEYS` (else a
    ConfigError); returns the other settings that changed, as `key old -> new`.

    An unreadable or missing `config.yaml` (a run from before it was written) is not checked;
    a key the recorded config lacks (written by an older version) is not compared.
    """
    from ebpo_lite.config import to_dict

    try:
        recorded = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(recorded, dict):
        return []
    before, changed = _flat(recorded), []
    for key, value in _flat(to_dict(cfg)).items():
        if key not in before or before[key] == value or key in QUIET_KEYS:
            continue
        old = _flow(before[key])
        if key in RESUME_KEYS:
            raise ConfigError(
                f"{key}: {_flow(value)} differs from the run being resumed ({found} was written "
                f"with {key}={old}); resume with {key}={old}, or pick another output_dir for a "
                "new run"
            )
        changed.append(f"{key} {old} -> {_flow(value)}")
    return changed


def _flat(tree: dict) -> dict[str, Any]:
    """`{"section.key": value}` of a config dict; a top-level value (output_dir) keeps its name."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update({f"{name}.{key}": v for key, v in value.items()})
        else:
            flat[name] = value
    return flat


def _flow(value: Any) -> str:
    """A value as it is written in an override: `tiny`, `16`, `[norm]`, `null`."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


# ----------------------------------------------------------------------------- machine


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def machine(cfg: Config) -> None:
    """Device, dtype and attention (`device.py`), thread count, and the packages the chosen
    backend and quantisation need."""
    from ebpo_lite.model.device import resolve_attn, resolve_device, resolve_dtype

    t, m = cfg.train, cfg.model
    device = resolve_device(m.device)
    resolve_attn(m.attn_implementation, device, resolve_dtype(m.dtype, device))
    cores = cpu_cores()
    if t.threads > cores:
        raise ConfigError(
            f"train.threads: {t.threads} asked for, but this process may use {cores} CPU "
            f"cores; use at most train.threads={cores} (0: torch's default)"
        )
    from ebpo_lite.rollout import stack

    stack.check(cfg, device)  # GPU stack vs config: window, vLLM's bitsandbytes, NF4 reloads
    if cfg.rollout.backend == "vllm":
        if device.type == "cpu" and cores > 1 and t.threads >= cores:
            raise ConfigError(
                f"train.threads: {t.threads} with rollout.backend=vllm on this {cores}-core CPU "
                f"leaves no core for vLLM's worker (steps turn erratic); use "
                f"train.threads={cores - 1}"
            )
        from ebpo_lite.rollout.vllm import check_importable

        check_importable()
    if cfg.rollout.backend == "unsloth":  # before the data and the model load, not after
        if device.type != "cuda":
            raise ConfigError(
                "rollout.backend: unsloth needs a CUDA GPU (none is visible); use "
                "rollout.backend=hf (or vllm, where installed)"
            )
        if importlib.util.find_spec("unsloth") is None:
            raise UserError(
                "rollout.backend=unsloth: needs unsloth (pip install 'ebpo-lite[unsloth]'), or "
                "use rollout.backend=hf"
            )
    if m.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(
            "model.load_in_4bit: needs bitsandbytes (pip install 'ebpo-lite[bnb]'), "
            "or set model.load_in_4bit=false"
        )
    loggers(cfg.log)


def loggers(log: LogConfig) -> None:
    """`log.wandb` / `log.tensorboard` need their packages (the extras of the same names)."""
    for key, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(log, key) and importlib.util.find_spec(module) is None:
            raise UserError(
                f'log.{key}: needs the {module} package (pip install "ebpo-lite[{key}]"), '
                f"or set log.{key}=false"
            )


# ----------------------------------------------------------------------------- model.name
