"""Device, dtype and attention choice: every CPU path for real, the GPU logic via monkeypatch.

There is no GPU here: the CUDA branches are reached by patching `torch.cuda.is_available`,
`device_count` and `get_device_capability` only; the CPU branches must never call torch.cuda,
which `no_cuda` enforces by making every such call fail.
"""

from __future__ import annotations

import pytest
import torch

from ebpo_lite.errors import ConfigError
from ebpo_lite.model import device as dev

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)


@pytest.fixture
def no_cuda(monkeypatch):
    """Any torch.cuda call is a test failure (the CPU path must not touch CUDA)."""

    def boom(*args, **kwargs):
        raise AssertionError("torch.cuda touched on the CPU path")

    for name in (
        "is_available",
        "device_count",
        "get_device_capability",
        "mem_get_info",
        "get_device_name",
        "memory_reserved",
        "is_bf16_supported",
        "current_device",
        "reset_peak_memory_stats",
        "max_memory_allocated",
        "max_memory_reserved",
    ):
        monkeypatch.setattr(torch.cuda, name, boom)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Two visible CUDA devices; returns a setter for their compute capability."""
    cap = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap["value"])
    monkeypatch.setattr(torch.version, "hip", None)
    return lambda c: cap.update(value=c)


# ----------------------------------------------------------------------------- CPU paths (real)


def test_cpu_paths_never_touch_cuda(no_cuda):
    assert dev.resolve_device("cpu") == CPU
    assert dev.resolve_dtype("auto", CPU) == torch.float32
    assert dev.resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert dev.resolve_dtype("float16", CPU) == torch.float16
    assert dev.resolve_attn("auto", CPU, torch.float32) == "eager"
    assert dev.resolve_attn("sdpa", CPU, torch.float32) == "sdpa"
    assert dev.cuda_capability(CPU) is None
    assert dev.cuda_memory_gib(CPU) is None
    assert dev.cuda_name(CPU) is None
    assert dev.native_bf16(CPU)
    mem = dev.StepMemory(CPU)  # per-step GPU memory metrics: no keys at all on CPU
    mem.mark("rollout")
    assert mem.metrics() == {}


def test_auto_is_cpu_on_this_machine():
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        pytest.skip("a GPU is visible")
    assert dev.resolve_device("auto") == CPU
    assert dev.cuda_capability(GPU) is None  # guarded even when asked about a cuda device


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_cuda_is_a_config_error(name):
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match=r"^model.device: .* no CUDA device is visible"):
        dev.resolve_device(name)


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "gpu", ""])
def test_unknown_device_names(name, no_cuda):
    with pytest.raises(ConfigError, match=r"^rollout.device: expected"):
        dev.resolve_device(name, key="rollout.device")


def test_unknown_dtype_and_attention_names(no_cuda):
    with pytest.raises(ConfigError, match=r"^model.dtype: expected one of auto"):
        dev.resolve_dtype("float64", CPU)
    with pytest.raises(ConfigError, match=r"^model.attn_implementation: expected auto"):
        dev.resolve_attn("flex", CPU, torch.float32)
    with pytest.raises(ConfigError, match=r"flash_attention_2 needs a CUDA device"):
        dev.resolve_attn("flash_attention_2", CPU, torch.bfloat16)


# ----------------------------------------------------------------------------- GPU decision logic


def test_gpu_device_resolution(fake_gpu):
    assert dev.resolve_device("auto") == GPU
    assert dev.resolve_device("cuda") == GPU
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"^rollout.device: 'cuda:2' asked for, but only 2"):
        dev.resolve_device("cuda:2", key="rollout.device")


@pytest.mark.parametrize(
    "cap,expected",
    [
        ((9, 0), torch.bfloat16),
        ((8, 9), torch.bfloat16),
        ((8, 0), torch.bfloat16),
        ((7, 5), torch.float16),
        ((7, 0), torch.float16),
        ((6, 0), torch.float16),
    ],
)
def test_auto_dtype_follows_compute_capability(fake_gpu, cap, expected):
    fake_gpu(cap)  # H100 / L4 / A100 / T4 / V100 / P100
    assert dev.cuda_capability(GPU) == cap
    assert dev.resolve_dtype("auto", GPU) == expected
    assert dev.resolve_dtype("float32", GPU) == torch.float32


def test_bf16_on_a_t4_is_refused_with_the_capability(fake_gpu):
    fake_gpu((7, 5))
    with pytest.raises(
        ConfigError,
        match=r"^rollout.dtype: bfloat16 needs compute capability "
        r">= 8.0, this GPU has 7.5",
    ):
        dev.resolve_dtype("bfloat16", GPU, key="rollout.dtype")
    assert dev.resolve_dtype("float16", GPU) == torch.float16


def test_rocm_counts_as_native_bf16(fake_gpu, monkeypatch):
    fake_gpu((7, 5))
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert dev.resolve_dtype("auto", GPU) == torch.bfloat16


def test_attention_choice_on_gpu(fake_gpu, monkeypatch):
    assert dev.resolve_attn("auto", GPU, torch.bfloat16) == "sdpa"
    assert dev.resolve_attn("eager", GPU, torch.bfloat16) == "eager"
    with pytest.raises(ConfigError, match="float16 or bfloat16"):
        dev.resolve_attn("flash_attention_2", GPU, torch.float32)
    fake_gpu((7, 5))
    with pytest.raises(ConfigError, match="compute capability >= 8.0; use sdpa"):
        dev.resolve_attn("flash_attention_2", GPU, torch.float16)
    fake_gpu((9, 0))
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="needs the flash-attn package"):
        dev.resolve_attn("flash_attention_2", GPU, torch.bfloat16)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert dev.resolve_attn("flash_attention_2", GPU, torch.bfloat16) == "flash_attention_2"


def test_broken_cuda_install_reads_as_no_cuda(monkeypatch):
    def broken():
        raise RuntimeError("driver too old")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert dev.resolve_device("auto") == CPU
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        dev.resolve_device("cuda")


def test_step_memory_on_gpu_reads_the_driver_per_phase_and_torch_peaks(fake_gpu, monkeypatch):
    """Which counters feed which metric, in GiB (the numbers themselves: scripts/gpu_smoke.py)."""
    calls, free = [], [30 * 2**30]
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[0], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 * 2**30)
    mem = dev.StepMemory(GPU)
    assert calls == [("reset", GPU)]  # each step's peaks are its own
    mem.mark("rollout")  # vLLM awake: 50 GiB used
    free[0] = 70 * 2**30
    mem.mark("train")  # vLLM asleep: 10 GiB used
    assert mem.metrics() == {
        "memory/rollout_used_gb": 50.0,
        "memory/train_used_gb": 10.0,
        "memory/peak_allocated_gb": 3.0,
        "memory/peak_reserved_gb": 4.0,
    }
