"""What every benchmark records next to its numbers: the machine and the exact command."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def machine(**extra) -> dict:
    """CPU model, cores, threads, torch / Python versions, load average; plus `extra`."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        # the vector ISA torch's CPU kernels use (AVX2, AVX512, ...): round-off, and so the tiny
        # model's 3000-step warm-up and every tiny-task number, differ between them
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "commit": commit(),
        **extra,
    }


def commit() -> str | None:
    """The repository's HEAD commit (with "+dirty" when the code has uncommitted changes)."""
    import subprocess

    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            # results being rewritten by this very run do not make the code dirty
            [
                "git",
                "-C",
                str(ROOT),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!benchmarks/results",
            ],  # fmt: skip
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return (head + ("+dirty" if dirty else "")) or None


def command() -> str:
    """The command line that ran this script, with paths relative to the repository."""
    exe = Path(sys.executable)
    python = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else "python"
    script = os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "-"
    return shlex.join([python, script, *sys.argv[1:]])


def write_results(results: dict, out: str) -> None:
    """`results` as indented JSON to `out` (its folder made), or to stdout for `-`."""
    text = json.dumps(results, indent=2)
    if out == "-":
        print(text)
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text + "\n")
    print(f"wrote {out}")
