"""The NVIDIA driver against torch's and vLLM's CUDA builds (ebpo_lite/model/driver.py).

No GPU here: the driver's facts are given as the texts and numbers the machine would give
(/proc/driver/nvidia/version's line, cuDriverGetVersion's integer). Only that stands in for the
hardware; the parsing, the rule and the messages are the real code's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ebpo_lite.errors import ConfigError
from ebpo_lite.model import driver
from ebpo_lite.model.device import resolve_device

R550 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
)
R580_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 06:54:38 UTC 2025\n"
)


def test_parses_both_kernel_module_lines():
    assert driver.parse_proc_version(R550) == "550.54.15"
    assert driver.parse_proc_version(R580_OPEN) == "580.65.06"
    assert driver.parse_proc_version("no driver here") is None
    assert driver.parse_cuda_version(12040) == (12, 4)
    assert driver.parse_cuda_version(13000) == (13, 0)


def test_minor_version_compatibility_within_a_major_only():
    old = driver.Driver("550.54.15", (12, 4))
    assert old.runs("12.8") and old.runs("12.9")  # a newer 12.x build runs on a 12.4 driver
    assert old.runs("13.0") is False
    # without cuDriverGetVersion's answer, the driver's own version against NVIDIA's floors
    assert driver.Driver("550.54.15", None).runs("13.0") is False
    assert driver.Driver("580.82.07", None).runs("13.0") is True
    assert driver.Driver("525.60.13", None).runs("12.1") is True
    assert driver.Driver(None, None).runs("13.0") is None


def test_problem_names_the_driver_the_build_and_the_floor():
    old = driver.Driver("550.54.15", (12, 4))
    why = driver.problem(old, [("torch 2.13.0+cu128", "12.8"), ("vllm 0.32.0", "13.0")])
    assert why is not None and "\n" not in why
    for words in ("550.54.15", "12.4", "vllm 0.32.0", "CUDA 13.0", "580.65.06", "CUDA 12"):
        assert words in why, (words, why)
    assert driver.problem(old, [("torch 2.13.0+cu128", "12.8")]) is None
    assert driver.problem(driver.Driver("580.65.06", (13, 0)), [("vllm 0.34.0", "13.0")]) is None


def test_vllm_cuda_from_its_label_or_its_envs_default():
    assert driver.vllm_cuda("0.32.0+cu129", None) == "12.9"
    assert driver.vllm_cuda("0.32.0+cpu", 'VLLM_MAIN_CUDA_VERSION: str = "13.0"') is None
    envs = 'x = 1\n    VLLM_MAIN_CUDA_VERSION: str = "13.0"\n'
    assert driver.vllm_cuda("0.34.0", envs) == "13.0"
    assert driver.vllm_cuda("0.34.0", "nothing") is None


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm's envs.py")
def test_the_installed_vllm_sources_say_which_cuda_a_default_wheel_targets():
    spec = importlib.util.find_spec("vllm")
    text = (Path(next(iter(spec.submodule_search_locations))) / "envs.py").read_text()
    assert driver.vllm_cuda("0.32.0", text) == "13.0"  # PyPI's default wheels: CUDA 13


def test_read_without_a_driver_and_with_one(tmp_path):
    assert driver.read(tmp_path / "absent", libcuda="libcuda-absent.so") == driver.Driver(
        None, None
    )
    proc = tmp_path / "version"
    proc.write_text(R550)
    assert driver.read(proc, libcuda="libcuda-absent.so") == driver.Driver("550.54.15", None)


def test_no_gpu_names_the_driver_when_there_is_one(tmp_path, monkeypatch):
    """model.device=cuda on a machine whose driver torch cannot use: the message names the
    driver (it said only "no CUDA device is visible")."""
    if driver.read().version is not None:
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        resolve_device("cuda")
    proc = tmp_path / "version"
    proc.write_text(R550)
    monkeypatch.setattr(driver, "PROC_VERSION", proc)
    with pytest.raises(ConfigError) as e:
        resolve_device("cuda")
    text = str(e.value)
    assert text.startswith("model.device: ") and "\n" not in text
    assert "no CUDA device is usable: NVIDIA driver 550.54.15" in text, text


def _old_driver_with_vllm_13(tmp_path, monkeypatch):
    if driver.read().version is not None:
        pytest.skip("this machine has an NVIDIA driver")
    proc = tmp_path / "version"
    proc.write_text(R550)
    monkeypatch.setattr(driver, "PROC_VERSION", proc)
    # what an installed PyPI vLLM of the window reads as (test above: its envs.py says 13.0)
    monkeypatch.setattr(driver, "vllm_build", lambda: ("vllm 0.32.0", "13.0"))


def test_a_gpu_run_on_vllm_is_refused_before_loading_on_an_old_driver(tmp_path, monkeypatch):
    import torch

    from ebpo_lite import config
    from ebpo_lite.rollout import stack

    _old_driver_with_vllm_13(tmp_path, monkeypatch)
    cfg = config.load(None, ["rollout.backend=vllm"])
    found = [str(e) for e in stack.refusals(cfg, torch.device("cuda", 0), stack.Stack.read())]
    why = [f for f in found if "driver" in f]
    assert len(why) == 1 and why[0].startswith("rollout.backend=vllm: NVIDIA driver 550.54.15")
    assert "vllm 0.32.0, built for CUDA 13.0" in why[0]
    hf = config.load(None, ["rollout.backend=hf"])  # torch runs, so the hf sampler is not refused
    assert not [e for e in stack.refusals(hf, torch.device("cuda", 0)) if "driver" in str(e)]


def test_doctor_names_the_driver(tmp_path, monkeypatch):
    from ebpo_lite.commands.doctor import gpu_lines

    assert any(line.startswith("driver       ") for line in gpu_lines())
    _old_driver_with_vllm_13(tmp_path, monkeypatch)
    lines = gpu_lines()
    assert "driver       NVIDIA driver 550.54.15" in lines
    assert any(
        line.strip().startswith("x NVIDIA driver 550.54.15 is too old for vllm") for line in lines
    )
