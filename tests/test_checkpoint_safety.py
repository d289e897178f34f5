"""Checkpoints under faults (issue 13, part 5): loading runs no pickled code, a corrupt or
truncated file is a one-line error naming it and the previous checkpoint, a full disk never
leaves a partial checkpoint, and a disk too small for the kept checkpoints is refused up front."""

from __future__ import annotations

import collections
import errno
import pickle

import pytest
import torch

from ebpo_lite.engine import checkpoint
from ebpo_lite.train import main
from tests.conftest import REPO, TINY_RECIPE, fast_overrides


def _run(out, capsys, **extra):
    """`python -m ebpo_lite.train` in-process: (exit status, stderr lines)."""
    capsys.readouterr()
    status = main([TINY_RECIPE, *fast_overrides(out, **extra)])
    return status, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture
def two_checkpoints(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    assert _run(out, capsys, **{"train.steps": 2, "train.checkpoint_every": 1})[0] == 0
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_1", "step_2"]
    return out


class Evil:  # a pickle that would run code when loaded without weights_only
    def __reduce__(self):
        return (print, ("pickled code ran",))


@pytest.mark.parametrize(
    "name, damage",
    [
        ("trainer_state.pt", lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])),
        ("trainable.safetensors", lambda p: p.write_bytes(p.read_bytes()[:100])),
        ("prior.json", lambda p: p.write_text('{"version": 1, "step"')),
        ("sampler.json", lambda p: p.unlink()),
        ("trainer_state.pt", lambda p: torch.save({"step": 2, "x": Evil()}, p)),
    ],
)
def test_unreadable_checkpoint_names_file_and_previous(two_checkpoints, capsys, name, damage):
    out = two_checkpoints
    bad = out / "checkpoints" / "step_2" / name
    damage(bad)
    before = {p.name: _files(p) for p in checkpoint.list_checkpoints(out)}
    status, err = _run(out, capsys, **{"train.steps": 4, "train.resume": "true"})
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {bad}: unreadable checkpoint file")
    assert str(out / "checkpoints" / "step_1") in err[0] and "move step_2" in err[0]
    assert "pickled code ran" not in capsys.readouterr().out
    assert {p.name: _files(p) for p in checkpoint.list_checkpoints(out)} == before


def test_trainer_state_is_plain_data(two_checkpoints):
    """weights_only loads it, and its RNG states round-trip exactly."""
    state = torch.load(
        two_checkpoints / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True
    )
    assert state["step"] == 2 and {"python", "numpy", "torch"} <= set(state["rng"])
    import random

    import numpy as np

    saved = checkpoint.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1))
    checkpoint.set_rng_state(pickle.loads(pickle.dumps(saved)))
    assert (random.random(), np.random.rand(), torch.rand(1)) == a


def _gpus(monkeypatch, count: int) -> list:
    """`count` CUDA generators, faked (no GPU here): torch's set_rng_state indexes
    `torch.cuda.default_generators[idx]`, which raises IndexError past the GPUs there are;
    this does the same. Patched in torch.cuda and torch.cuda.random (set_rng_state_all's)."""
    import torch.cuda.random as cuda_random

    generators = [None] * count

    def set_state(state, device="cuda"):
        generators[device if isinstance(device, int) else 0] = state.clone()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(cuda_random, "set_rng_state", set_state)
    return generators


@pytest.mark.parametrize("saved_gpus, here", [(2, 1), (1, 2), (2, 2)])
def test_resume_restores_the_gpus_this_machine_has(monkeypatch, capsys, saved_gpus, here):
    """A 2 x T4 checkpoint on one T4 (it raised IndexError), and the reverse: the GPUs both
    have are restored, one line says so; with equal counts every state is set, silently."""
    saved = checkpoint.rng_state()
    saved["cuda"] = [torch.full((8,), i, dtype=torch.uint8) for i in range(saved_gpus)]
    generators = _gpus(monkeypatch, here)
    checkpoint.set_rng_state(saved)
    both = min(saved_gpus, here)
    assert [int(g[0]) for g in generators[:both]] == list(range(both))
    assert generators[both:] == [None] * (here - both)
    out = capsys.readouterr().out
    if saved_gpus == here:
        assert out == ""
    else:
        assert out.count("\n") == 1 and f"random state of {saved_gpus} GPU(s)" in out
        assert f"this machine has {here}" in out


def test_disk_full_while_saving_keeps_the_previous_checkpoint(two_checkpoints, capsys, monkeypatch):
    out = two_checkpoints
    before = {p.name: _files(p) for p in checkpoint.list_checkpoints(out)}
    calls = collections.Counter()
    real = checkpoint.save_file

    def full(tensors, path, *a, **k):
        calls["save"] += 1
        real(tensors, path, *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full)
    status, err = _run(
        out, capsys, **{"train.steps": 3, "train.resume": "true", "train.checkpoint_every": 1}
    )
    assert calls["save"] == 1
    assert status == 2 and len(err) == 1, err
    step3 = out / "checkpoints" / "step_3"
    assert err[0].startswith(f"error: {step3}: checkpoint not written (No space left on device)")
    assert f"{out / 'checkpoints' / 'step_2'}, is intact" in err[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert {p.name: _files(p) for p in checkpoint.list_checkpoints(out)} == before


def test_too_little_disk_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.chdir(REPO)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 20))
    loaded = []
    import ebpo_lite.engine.run as run_mod

    monkeypatch.setattr(run_mod, "load_policy", lambda *a, **k: loaded.append(1))
    status, err = _run(tmp_path / "run", capsys, **{"train.keep_checkpoints": 3})
    assert status == 2 and len(err) == 1 and not loaded, err
    assert err[0].startswith(f"error: output_dir: {tmp_path / 'run'} has 1 MiB free")
    assert "train.keep_checkpoints=3 needs about" in err[0]
