"""The Python API: what a notebook or a script calls, the same work as the command line.

    from ebpo_lite import load_config, train_run, evaluate, export_run

    cfg = load_config("tiny_cpu", ["train.steps=20"], data={"path": "mine.jsonl"})
    result = train_run(cfg)              # the run folder and its summary (before -> after)
    scores = evaluate(result)            # the `ebpo-lite eval` results, as a dict
    folder = export_run(result)          # the `ebpo-lite export` folder

Each function is a thin wrapper of the command's own code (`config.load`, `train.train`,
`eval.evaluate`, `export.export_run`), so the two cannot drift, with three differences a Python
caller needs: a mistake raises `ConfigError` / `UserError` (one line that names the key, file or
argument; the command line prints that line and exits 2) instead of ending the process; the
library chatter the command line silences (bitsandbytes' kernel-hub warning, transformers'
load bars and FutureWarnings) is silenced for the call only (`cli.quieted`), leaving the
caller's own logging and warning filters as they were; and results come back as values.

`train_run`, not `train`: `ebpo_lite.train` is the module `python -m ebpo_lite.train` runs, and
importing it makes the package attribute `train` that module (Python's import system sets it),
so a function of the same name would change under the caller. `export_run` likewise.

Importing this module is cheap (no torch): the work is imported inside each call.
docs/python.md documents every name, with a runnable example (examples/custom_data.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ebpo_lite import cli
from ebpo_lite.errors import ConfigError, UserError

if TYPE_CHECKING:
    from ebpo_lite.config import Config

PathLike = str | os.PathLike


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `train_run` returns: the run folder and the summary the run printed.

    `summary` is `summary.json`: `steps_done`, `seconds`, `checkpoint`, and the first and last
    evals as `before/<metric>` and `after/<metric>` (`before` and `after` give them without the
    prefix). A TrainResult is a path-like object (`os.fspath(result)` is the run folder), so
    `evaluate(result)`, `export_run(result)` and `Path(result)` take it as the run folder.
    """

    run_dir: Path
    summary: dict[str, Any]

    @property
    def before(self) -> dict[str, Any]:
        """The eval before the first step: `{"accuracy": 0.46, ...}` ({} without an eval)."""
        return _prefixed(self.summary, "before/")

    @property
    def after(self) -> dict[str, Any]:
        """The last eval of this call (after the final step, or where the run stopped)."""
        return _prefixed(self.summary, "after/")

    def metrics(self) -> list[dict[str, Any]]:
        """Every record of the run's `metrics.jsonl` (one per step and per eval), in order."""
        from ebpo_lite.engine.metrics import read_metrics

        return list(read_metrics(self.run_dir / "metrics.jsonl"))

    def __fspath__(self) -> str:
        return str(self.run_dir)


def _prefixed(summary: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in summary.items() if k.startswith(prefix)}


# ----------------------------------------------------------------------------- config


def load_config(
    recipe: PathLike | None = None, overrides: Sequence[str] = (), **sections: Any
) -> Config:
    """A validated `Config`: a recipe, then `sections`, then `overrides` (the last one wins).

    - `recipe`: a YAML file or a packaged recipe's name (`ebpo-lite recipes` lists them), or
      None for the defaults (`ebpo-lite train --help` lists every key and default).
    - `sections`: keyword per top-level key, a dict per section:
      `train={"steps": 20}, data={"path": "mine.jsonl"}, output_dir="runs/mine"`. Values are
      Python values (numbers, strings, bools, lists, None, paths).
    - `overrides`: the command line's `section.key=value` strings, e.g. `["train.steps=20"]`.

    The same parser and checks as `ebpo-lite train RECIPE ...`: an unknown key, a wrong type or
    an out-of-range value raises `ConfigError` naming the key (`train.stepz: unknown key ...;
    did you mean train.steps?`). A reward function is named `"module:function"`
    (`reward={"functions": ["my_rewards:score"]}`), importable from the script's folder; a
    function object cannot go into a config, which is written to the run folder as YAML.
    """
    from ebpo_lite import config

    if isinstance(overrides, str):
        raise ConfigError(
            f"overrides: expected a list of section.key=value strings, got the string "
            f"{overrides!r}; write [{overrides!r}]"
        )
    return config.load(recipe, [*_as_overrides(sections), *overrides])


def _as_overrides(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """`section.key=value` strings for a nested mapping of Python values (YAML text values)."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _as_overrides(value, f"{dotted}.")
        else:
            yield f"{dotted}={_yaml_text(value, dotted)}"


def _yaml_text(value: Any, key: str) -> str:
    """`value` as the YAML text that `config.load` parses back to it."""
    import yaml

    if callable(value) or (isinstance(value, list) and any(callable(v) for v in value)):
        raise ConfigError(
            f"{key}: got a Python function; a config names functions as 'module:function' "
            "strings (the module importable from the script's folder), e.g. "
            "reward={'functions': ['my_rewards:score']}"
        )
    try:
        text = yaml.safe_dump(_plain(value), default_flow_style=True, width=2**31)
    except yaml.YAMLError:
        raise ConfigError(
            f"{key}: {value!r} is not a config value (a number, string, bool, list or None)"
        ) from None
    return text.strip().removesuffix("\n...")  # a lone scalar's document-end marker


def _plain(value: Any) -> Any:
    """Paths as strings and tuples as lists, the types YAML writes."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _checked(cfg: Any) -> Config:
    """`cfg` through `config.load`'s checks, when it was made in code (`Config(...)`,
    `dataclasses.replace`): the keys that differ from the defaults, parsed as overrides."""
    from ebpo_lite import config

    if not isinstance(cfg, config.Config):
        raise ConfigError(
            f"config: expected an ebpo_lite Config (load_config(...) makes one), got "
            f"{type(cfg).__name__}"
        )
    if config.origin(cfg) != (None, ()):  # made by config.load: checked already
        return cfg
    given, default = config.to_dict(cfg), config.to_dict(config.Config())
    return config.load(None, list(_differences(given, default)))


def _differences(given: Mapping, default: Mapping, prefix: str = "") -> Iterator[str]:
    for key, value in given.items():
        base = default.get(key)
        if isinstance(value, Mapping) and isinstance(base, Mapping):
            yield from _differences(value, base, f"{prefix}{key}.")
        elif key not in default or value != base:
            yield f"{prefix}{key}={_yaml_text(value, f'{prefix}{key}')}"


# ----------------------------------------------------------------------------- the commands


def train_run(cfg: Config, environment: Any = None, tools: Sequence[Callable] = ()) -> TrainResult:
    """Train (or resume, with `train={"resume": True}`) as `ebpo-lite train` does.

    Tool use (docs/tools.md): `environment` is a TRL-style environment class (or a dict of
    them by the `environment` column) and `tools` plain tool functions, given as objects instead
    of `env.factory` / `env.tools`. A class a fresh Python can import (`module:Class`) runs
    contained; one defined in a notebook runs in this process (errors contained, a hang
    abandoned, not killed).

    Prints what the command prints (start-up lines, progress, sample completions, the summary
    with its before -> after line) and writes the same run folder (`cfg.output_dir`:
    `config.yaml`, `metrics.jsonl`, `summary.json`, `checkpoints/step_N`). A config made in
    code (`Config(...)`, `dataclasses.replace`) is checked as a loaded one is. Raises
    `ConfigError` / `UserError` for a mistake (before anything is written or loaded) and
    `TrainingFault` when the run stops itself (e.g. non-finite values, step after step). A
    first Ctrl-C finishes the step and writes a checkpoint; `resume` continues from it.
    """
    cfg = _checked(cfg)
    with cli.quieted():
        from ebpo_lite.train import train

        objects = (environment, list(tools)) if environment is not None or tools else None
        summary = train(cfg, env_objects=objects)
    return TrainResult(Path(cfg.output_dir), summary)


def resume_or_new(cfg: Config, resume: bool | str = "auto", log=print) -> Config:
    """`cfg` with the run folder and `train.resume` a notebook's train cell needs when it is run
    again (Run all after changing a cell, or after a reconnect), and one line saying which.

    `resume="auto"`: continue `output_dir`'s run when it holds checkpoints and the settings let
    it go on (the keys `train.resume` refuses to change, such as model.name, are the same, and
    train.steps is not below the steps done; other changes are listed when it starts), else a
    new run in the first `<output_dir>-2`, `-3`, ... without checkpoints. `True`: continue (a
    setting that cannot change raises its one-line ConfigError, as `train.resume=true` does).
    `False`: always a new run, in a free folder when `output_dir` holds checkpoints. Nothing
    is deleted or overwritten. Without checkpoints in `output_dir` it is a new run there.
    """
    from ebpo_lite.engine import checkpoint, checks

    if resume not in (True, False, "auto"):
        raise ConfigError(f"resume: expected True, False or 'auto', got {resume!r}")
    out = Path(cfg.output_dir)
    found = checkpoint.latest(out)
    again = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True))
    if found is not None and resume is not False:
        try:
            checks.output_dir(again, log=lambda _: None)
            log(f"run folder: continuing {out} from {found.name} (resume=False starts a new run)")
            return again
        except ConfigError as e:
            if resume is True:
                raise
            why = f"it cannot continue there ({e})"
    else:
        why = "resume=False"
    fresh = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=False))
    if found is None:
        log(f"run folder: {out} (a new run)")
        return fresh
    k = 2
    while checkpoint.latest(Path(f"{out}-{k}")) is not None:
        k += 1
    log(f"run folder: a new run in {out}-{k}, since {out} holds a run and {why}")
    return dataclasses.replace(fresh, output_dir=f"{out}-{k}")


def evaluate(
    target: PathLike,
    benchmark: str | None = None,
    *,
    overrides: Sequence[str] = (),
    k: int = 1,
    temperature: float | None = None,
    top_p: float = 0.95,
    max_new_tokens: int = 0,
    limit: int = 0,
    out: PathLike | None = None,
    backend: str = "auto",
    batch_size: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """`ebpo-lite eval TARGET --benchmark ...` from Python; returns the results it writes.

    `target`: a run folder (or a `TrainResult`), `RUN/checkpoints/step_N`, a model folder or hub
    id. `benchmark`: a comma list of benchmarks (`arithmetic`, `math500`, `gsm8k`, ...), or a
    .jsonl / .json / .parquet file read and scored as the run's own data; None: the command's
    default. The keywords are the command's flags (`top_p` is `--top-p`); `overrides` are
    `section.key=value` strings applied to the run's config. Returns the JSON written to `out`
    (default `RUN/eval.json`): `{"settings": ..., "benchmarks": {name: {"pass@1": ...}},
    "mean": ...}`. A bad argument raises `UserError` naming it (in the command's spelling).
    """
    import argparse

    from ebpo_lite import eval as eval_command

    whole = dict(k=k, max_new_tokens=max_new_tokens, limit=limit, batch_size=batch_size, seed=seed)
    for name, value in whole.items():  # argparse's type=int, for a Python caller
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserError(f"evaluate: {name} must be an integer, got {value!r}")
    if isinstance(overrides, str):
        raise UserError(
            f"overrides: expected a list of section.key=value strings, got {overrides!r}"
        )
    args = argparse.Namespace(
        target=os.fspath(target),
        overrides=list(overrides),
        benchmark=None if benchmark is None else os.fspath(benchmark),
        k=k,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        limit=limit,
        out=None if out is None else os.fspath(out),
        backend=backend,
        batch_size=batch_size,
        seed=seed,
    )
    with cli.quieted():
        return eval_command.evaluate(args)


def export_run(
    run: PathLike,
    out: PathLike | None = None,
    *,
    checkpoint: str | None = None,
    merge: bool = False,
    gguf: bool | str = False,
    push_to_hub: str | None = None,
) -> Path:
    """`ebpo-lite export RUN` from Python; returns the export folder.

    `run`: a run folder (or a `TrainResult`). `out`: the folder to write (default `RUN/export`;
    an earlier export there is replaced once the new one is complete). `checkpoint`: `step_N`
    (default: the newest). `merge`: also `merged/`, base and adapter as full weights.
    `gguf`: also `model-<type>.gguf` for llama.cpp / Ollama and a `Modelfile` (True: f16; or a
    type: "f16", "q8_0", "bf16", "f32").
    `push_to_hub`: a hub repo id to upload the finished folder to. The folder holds the complete
    adapter (`PeftModel.from_pretrained(base, folder)` loads it), the tokenizer, the run's config
    and a model card; docs of `ebpo_lite.commands.export` say more. Raises `UserError` for a mistake.
    """
    from ebpo_lite.commands.export import export_run as export_folder

    with cli.quieted():
        qtype = ("f16" if gguf is True else gguf) or None
        return export_folder(os.fspath(run), out, checkpoint, merge, push_to_hub, qtype)
