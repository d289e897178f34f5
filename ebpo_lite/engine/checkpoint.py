"""Checkpoints: everything a run needs to continue exactly, written atomically.

`<output_dir>/checkpoints/step_<N>/` holds
- `adapter_model.safetensors` + `adapter_config.json`: the LoRA adapter in peft's format, with
  any extra trained base tensors (`model.trainable_extra`, e.g. norms) as peft `modules_to_save`,
  so `PeftModel.from_pretrained(base, path)` loads the trained model (`extra_weights.add_extra_weights`;
  `ebpo-lite export` makes the shareable folder);
- `trainable.safetensors`: every trainable tensor by its exact name (LoRA and any extra base
  tensors such as norms), used for exact resume;
- `trainer_state.pt`: optimizer, LR scheduler, RNG states (python, numpy, torch CPU / CUDA), step;
  plain tensors and Python values only, so it loads with `torch.load(weights_only=True)` (no
  pickled code runs when a checkpoint is read);
- `prior.json` (the EB prior's accumulators) and `sampler.json` (the curriculum's position).
A checkpoint is written to `.tmp_step_<N>` and renamed, so a crash never leaves a half-written
`step_<N>`; only the newest `keep` are kept. A write that fails (disk full) removes its temporary
folder and leaves the previous checkpoints as they were; a checkpoint that cannot be read names
the file and the previous one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ebpo_lite.errors import UserError

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain Python values (`weights_only` loads them)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        set_cuda_rng_states(state["cuda"])


def set_cuda_rng_states(saved: list[torch.Tensor]) -> None:
    """Each visible GPU's generator from the checkpoint's, as far as both go.

    `torch.cuda.set_rng_state_all` sets one state per GPU the checkpoint saw and raises
    IndexError on a machine with fewer (`torch/cuda/random.py`: `default_generators[idx]`), so a
    Kaggle 2 x T4 checkpoint could not resume on a Colab T4. Where the counts differ, the GPUs
    both have are restored, the rest keep their own seed, and one line says so: the run goes on,
    exact only where the GPUs match (the trainer and a colocated sampler use GPU 0).
    """
    here = torch.cuda.device_count()
    for i, s in enumerate(saved[:here]):
        torch.cuda.set_rng_state(s, i)
    if len(saved) != here:
        print(
            f"resume: the checkpoint holds the random state of {len(saved)} GPU(s), this "
            f"machine has {here}: restored GPU 0-{min(len(saved), here) - 1}'s; the others "
            "draw from their own seed (exact resume holds where the GPUs match)",
            flush=True,
        )


def save(
    output_dir: str | Path,
    step: int,
    policy,
    optimizer,
    scheduler,
    prior,
    sampler,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    root = checkpoint_dir(output_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write(tmp, step, policy, optimizer, scheduler, prior, sampler, extra)
    except OSError as e:  # disk full, quota, permissions: the previous checkpoints stay
        shutil.rmtree(tmp, ignore_errors=True)
        before = latest(output_dir)
        kept = f"the newest complete one, {before}, is intact" if before else "none was written"
        raise UserError(
            f"{final}: checkpoint not written ({e.strerror or e}); {kept}; free disk space "
            "(or lower train.keep_checkpoints) and resume with train.resume=true"
        ) from None
    old = root / f".old_step_{step}"
    if final.exists():  # re-saving a step (stopped again right after resuming): swap, then delete
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(root)
    shutil.rmtree(old, ignore_errors=True)
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write(tmp: Path, step, policy, optimizer, scheduler, prior, sampler, extra) -> None:
    """Every file of one checkpoint into `tmp`, each flushed to disk before the rename."""
    policy.export_adapter(tmp, with_extra=True)
    save_file(
        {k: v.contiguous() for k, v in policy.trainable_state().items()},
        tmp / "trainable.safetensors",
    )
    torch.save(
        {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "extra": extra or {},
        },
        tmp / "trainer_state.pt",
    )
    (tmp / "prior.json").write_text(json.dumps(prior.state_dict() if prior is not None else None))
    (tmp / "sampler.json").write_text(json.dumps(sampler.state_dict()))
    for f in tmp.iterdir():
        if f.is_file():
            _fsync(f)
    _fsync(tmp)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _STEP_DIR.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def remove_all(output_dir: str | Path) -> None:
    """Delete every checkpoint of a run (train.overwrite=true)."""
    shutil.rmtree(checkpoint_dir(output_dir), ignore_errors=True)


def latest(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


FILES = ("trainable.safetensors", "trainer_state.pt", "prior.json", "sampler.json")


def load(path: Path, policy, optimizer, scheduler, prior, sampler) -> dict[str, Any]:
    """Restore every piece of state in place; returns the trainer state (step, extra).

    Nothing executable is read: tensors through safetensors, the trainer state through
    `torch.load(weights_only=True)`, the rest as JSON. An unreadable file is a one-line
    `UserError` naming it and the previous checkpoint, and nothing has been changed yet.
    """
    read = {
        "trainable.safetensors": load_file,
        "trainer_state.pt": lambda f: torch.load(f, weights_only=True, map_location="cpu"),
        "prior.json": lambda f: json.loads(f.read_text()),
        "sampler.json": lambda f: json.loads(f.read_text()),
    }
    loaded = {}
    for name in FILES:
        try:
            loaded[name] = read[name](path / name)
        except Exception as e:  # truncated, corrupt, missing, or pickled code weights_only refuses
            raise UserError(_unreadable(path, name, e)) from None
    state = loaded["trainer_state.pt"]
    policy.load_trainable_state(loaded["trainable.safetensors"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if prior is not None and loaded["prior.json"] is not None:
        prior.load_state_dict(loaded["prior.json"])
    sampler.load_state_dict(loaded["sampler.json"])
    set_rng_state(state["rng"])
    return state


def read_tensors(path: Path, then: str) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file, or a one-line UserError naming it; `then` says what to
    do instead (export and eval read checkpoints outside `load`)."""
    try:
        return load_file(path)
    except Exception as e:  # truncated (safetensors' SafetensorError), corrupt, missing
        raise UserError(f"{path}: unreadable checkpoint file ({_why(e)}); {then}") from None


def _why(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__


def _unreadable(path: Path, name: str, e: Exception) -> str:
    why = _why(e)
    older = [
        p for p in list_checkpoints(path.parent.parent) if p != path and step_of(p) < step_of(path)
    ]
    then = (
        f"the previous checkpoint is {older[-1]}: move {path.name} out of {path.parent} and "
        "resume again to continue from it"
        if older
        else "no earlier checkpoint exists: start again with train.overwrite=true"
    )
    return f"{path / name}: unreadable checkpoint file ({why}); {then}"


def step_of(p: Path) -> int:
    """N of a `step_N` checkpoint folder; -1 for any other name."""
    m = _STEP_DIR.match(Path(p).name)
    return int(m.group(1)) if m else -1


def bytes_per_checkpoint(n_trainable: int) -> int:
    """One checkpoint's size on disk for `n_trainable` fp32 parameters: the peft adapter and
    the exact-resume copy (4 B each), AdamW's two moments (8 B), plus 1 MiB of small files."""
    return n_trainable * 16 + (1 << 20)


def check_disk(cfg: Any) -> None:
    """Refuse, before the model loads, a run whose checkpoints cannot fit on `output_dir`'s
    disk: saving holds `keep + 1` of them at once (the new one before the oldest goes)."""
    from ebpo_lite.model.memory import (
        arch_for,
        extra_trainable_count,
        lora_param_count,
        lora_targets,
    )

    m = cfg.model
    try:
        arch = arch_for(m.name)
    except UserError:  # an architecture we cannot size without loading it: checked at save time
        return
    n = lora_param_count(arch, m.lora_rank, lora_targets(m.lora_target_modules))
    n += extra_trainable_count(arch, m.trainable_extra)
    each = bytes_per_checkpoint(n)
    have = len(list_checkpoints(cfg.output_dir))
    need = max(cfg.train.keep_checkpoints + 1 - have, 1) * each
    where = Path(cfg.output_dir).absolute()
    while not where.exists() and where != where.parent:  # not made yet: the disk it will be on
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        mib = 1 << 20
        raise UserError(
            f"output_dir: {cfg.output_dir} has {free / mib:.0f} MiB free, but "
            f"train.keep_checkpoints={cfg.train.keep_checkpoints} needs about {need / mib:.0f} MiB "
            f"({each / mib:.0f} MiB per checkpoint); free space, lower train.keep_checkpoints, or "
            "choose another output_dir"
        )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
