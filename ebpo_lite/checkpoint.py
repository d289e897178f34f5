"""Checkpoints: everything a run needs to continue exactly, written atomically.

`<output_dir>/checkpoints/step_<N>/` holds
- `adapter_model.safetensors` + `adapter_config.json`: the LoRA adapter in peft's format
  (`PeftModel.from_pretrained(base, path)` loads it);
- `trainable.safetensors`: every trainable tensor by its exact name (LoRA and any extra base
  tensors such as norms), used for exact resume;
- `trainer_state.pt`: optimizer, LR scheduler, RNG states (python, numpy, torch CPU / CUDA), step;
- `prior.json` (the EB prior's accumulators) and `sampler.json` (the curriculum's position).
A checkpoint is written to `.tmp_step_<N>` and renamed, so a crash never leaves a half-written
`step_<N>`; only the newest `keep` are kept.
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
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    policy.export_adapter(tmp)
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
    _fsync_dir(tmp)
    old = root / f".old_step_{step}"
    if final.exists():  # re-saving a step (stopped again right after resuming): swap, then delete
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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


def load(path: Path, policy, optimizer, scheduler, prior, sampler) -> dict[str, Any]:
    """Restore every piece of state in place; returns the trainer state (step, extra)."""
    try:
        policy.load_trainable_state(load_file(path / "trainable.safetensors"))
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        prior_state = json.loads((path / "prior.json").read_text())
        sampler_state = json.loads((path / "sampler.json").read_text())
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{path}: unreadable checkpoint ({e})") from None
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if prior is not None and prior_state is not None:
        prior.load_state_dict(prior_state)
    sampler.load_state_dict(sampler_state)
    set_rng_state(state["rng"])
    return state


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
