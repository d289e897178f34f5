"""GPU names for `--gpu` (plan, doctor): which card a name means and how much memory it has;
and the host's RAM for `--host-ram` (plan: `parse_host_ram`, this machine's by default).

`parse_gpu` looks a name up before reading a number, so `--gpu 3090` is the RTX 3090 (24 GiB),
not 3,090 GiB; a size may be written 24, 24GB or 24GiB (a card's "24GB" is 24 GiB: 24,576 MiB
on an RTX 3090); a number above `GPU_MAX_GIB`, a name that comes in two sizes (A100, V100) or an
unknown name is a one-line `UserError` listing the accepted forms. The sizes are what
`nvidia-smi` reports as the card's total memory, in GiB, approximately (ECC and the driver's
reserve make an L4's "24GB" 22.5 GiB).
"""

from __future__ import annotations

import os
import re

from ebpo_lite.errors import UserError
from ebpo_lite.model.memory import GIB

# name -> (label, GiB as nvidia-smi reports the card's memory, approximately)
GPUS = {
    "t4": ("Tesla T4 16GB", 15.0),
    "p100": ("Tesla P100 16GB", 15.9),
    "v10016gb": ("Tesla V100 16GB", 15.8),
    "v10032gb": ("Tesla V100 32GB", 31.7),
    "l4": ("NVIDIA L4 24GB", 22.5),
    "a10g": ("NVIDIA A10G 24GB", 22.5),
    "rtx3090": ("RTX 3090 24GB", 24.0),
    "rtx4090": ("RTX 4090 24GB", 24.0),
    "a10040gb": ("A100 40GB", 40.0),
    "l40s": ("NVIDIA L40S 48GB", 45.0),
    "a6000": ("RTX A6000 48GB", 48.0),
    "a10080gb": ("A100 80GB", 80.0),
    "h100": ("H100 80GB", 79.6),
    "h200": ("H200 141GB", 140.4),
}
_GPU_ALIASES = {
    "3090": "rtx3090",
    "4090": "rtx4090",
    "rtx309024gb": "rtx3090",
    "rtx409024gb": "rtx4090",
    "a10040": "a10040gb",
    "a10080": "a10080gb",
    "v10016": "v10016gb",
    "v10032": "v10032gb",
    "h10080gb": "h100",
    "h200141gb": "h200",
    "t416gb": "t4",
    "p10016gb": "p100",
    "l424gb": "l4",
    "a10g24gb": "a10g",
    "l40s48gb": "l40s",
    "rtxa6000": "a6000",
    "a600048gb": "a6000",
}
_GPU_SIZES = {"a100": ("A100-40GB", "A100-80GB"), "v100": ("V100-16GB", "V100-32GB")}
GPU_MAX_GIB = 256  # a bare number above this is no GPU's memory (the largest today: ~180 GiB)
GPU_FORMS = (
    "a GPU name (T4, P100, V100-16GB, V100-32GB, L4, A10G, 3090, 4090, A100-40GB, L40S, A6000, "
    f"A100-80GB, H100, H200) or its memory in GiB up to {GPU_MAX_GIB} (24, 24GB, 24GiB)"
)


def parse_gpu(text: str) -> tuple[str, float]:
    """(label, GiB) of `--gpu`: a GPU name (`GPUS`, `_GPU_ALIASES`: 3090, A100-40GB, H100, ...),
    looked up first so that `3090` is the card, or a size (24, 24GB, 24GiB: a card's "GB" is its
    GiB, 24 GB cards have 24,576 MiB). Anything else, a name that comes in two sizes (A100, V100)
    or a bare number larger than any GPU (`GPU_MAX_GIB`) is a one-line UserError."""
    key = re.sub(r"[^a-z0-9]", "", text.lower())
    key = _GPU_ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    if key in _GPU_SIZES:
        a, b = _GPU_SIZES[key]
        raise UserError(f"--gpu: {text!r} comes in two sizes: write {a} or {b}")
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+) *(gb|gib)?", text.strip().lower())
    if m is None:
        raise UserError(f"--gpu: unknown GPU {text!r}; expected {GPU_FORMS}")
    gib = float(m.group(1))
    if not 0 < gib <= GPU_MAX_GIB:
        raise UserError(f"--gpu: {text!r} is not a GPU's memory in GiB; expected {GPU_FORMS}")
    return f"{gib:g} GiB", gib


def machine_ram_gib() -> float:
    """This machine's physical RAM, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def parse_host_ram(text: str) -> float:
    """`--host-ram`: auto (this machine's RAM) or a size in GiB (12.7, 12.7GB, 12.7GiB)."""
    if text.strip().lower() == "auto":
        return machine_ram_gib()
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+) *(gb|gib)?", text.strip().lower())
    if m is None or float(m.group(1)) <= 0:
        raise UserError(f"--host-ram: expected auto or the host's RAM in GiB (12.7), got {text!r}")
    return float(m.group(1))
