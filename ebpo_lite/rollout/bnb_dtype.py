"""The vLLM sampler's 4-bit matmuls in the engine's float16, not vllm-bnb-plugin's bfloat16
(a narrow, version-checked patch of one plugin method; the only module that imports the plugin).

Upstream, as read in vllm-bnb-plugin 0.0.3 and bitsandbytes 0.50.2:
- `vllm_bnb_plugin/quantization/linear.py`, `BitsAndBytesLinearMethod._apply_4bit_weight`
  (lines 211-240): the input is cast to bfloat16 whatever the engine dtype (line 223), the output
  buffer is bfloat16 (231), `apply_bnb_4bit` fills it (232; lines 18-35 call
  `bitsandbytes.matmul_4bit` once per fused shard) and the result is cast back (233).
- bitsandbytes computes in its input's dtype: `autograd/_functions.py` `matmul_4bit` (line 407)
  calls `torch.ops.bitsandbytes.gemm_4bit` on A as given (462, 472). On CUDA,
  `backends/cuda/ops.py` `_gemm_4bit_use_custom_cuda` (583-611): sm_75 (T4) has an fp16 MMA
  kernel only, so for bfloat16 the fused kernel is used for M < 8 rows alone (610-611), where
  float16 gets the T4 ladder (645-653, 703-709: up to 32-320 rows); past that the dispatch
  (964-967) takes `_dequant_linear_fallback` (904-916), which dequantises the whole weight to A's
  dtype and runs `F.linear` in it, a bfloat16 GEMM on a card without bfloat16 tensor cores.
So on a T4 a float16 engine ran every prefill and most batched decode steps through a full
dequantisation and a slow bf16 GEMM, with bf16's 8-bit mantissa against a float16 trainer.

The patch (`patch`): for a float16 input the same steps in float16 (input as given, a float16
output buffer, the plugin's own `apply_bnb_4bit` op); every other dtype goes to the original
method untouched, so a bfloat16 engine computes exactly as upstream, and the 8-bit path is not
touched. Only for the plugin releases read (`PATCHED_RELEASES`); any other release: no patch and
one warning that the sampler may compute in bfloat16.

Which process: vLLM runs the model in the trainer's process by default
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `engine_env` patches this process before `LLM(...)`. An
engine in its own process (`rollout.device: cuda:1`, or multiprocessing asked for) gets
`EBPO_LITE_BNB_FLOAT16=1` in its environment, and `register`, ebpo-lite's own
`vllm.general_plugins` entry point (pyproject.toml), patches there: vLLM loads general plugins in
every process it starts, the engine core and each worker (`vllm/plugins/__init__.py`). Without
that variable `register` does nothing, so other vLLM users of the machine never see it.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

PATCHED_RELEASES = ("0.0.3",)  # vllm-bnb-plugin releases whose linear.py was read (above)
ENV = "EBPO_LITE_BNB_FLOAT16"  # set by `engine_env` for an engine in its own process
ENTRY_POINT = "ebpo_lite_bnb_float16"  # the name in pyproject.toml's vllm.general_plugins
PLUGIN_GROUP = "vllm.general_plugins"


def plugin_version() -> str | None:
    """The installed vllm-bnb-plugin release, else None (read from metadata, no import)."""
    try:
        return md.version("vllm-bnb-plugin")
    except md.PackageNotFoundError:
        return None


def engine_env(dtype: torch.dtype, in_process: bool) -> dict[str, str]:
    """Make a `quantization="bitsandbytes"` engine of `dtype` run its 4-bit matmuls in float16:
    patch this process and return what the engine's own process needs in its environment."""
    if dtype != torch.float16:
        return {}  # a bfloat16 engine is what the plugin computes in already
    version = plugin_version()
    if version is None:
        return {}  # nothing to patch; `stack.check` and vLLM say what is missing
    if version not in PATCHED_RELEASES:
        warnings.warn(unpatched_warning(version), stacklevel=2)
        return {}
    patch()
    env = {ENV: "1"}
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT not in allowed.split(","):
        env["VLLM_PLUGINS"] = f"{allowed},{ENTRY_POINT}"  # an allow-list would leave it out
    if not in_process and not entry_point_installed():
        warnings.warn(
            "rollout.backend=vllm: the engine runs in its own process and ebpo-lite's "
            f"{PLUGIN_GROUP} entry point is not installed, so its 4-bit matmuls compute in "
            "bfloat16, not float16 (reinstall: pip install -e .)",
            stacklevel=2,
        )
    return env


def unpatched_warning(version: str) -> str:
    return (
        f"vllm-bnb-plugin {version}: the float16 patch is read only for "
        f"{', '.join(PATCHED_RELEASES)} and not applied; the vLLM sampler's 4-bit matmuls may "
        "compute in bfloat16"
    )


def entry_point_installed() -> bool:
    return any(ep.name == ENTRY_POINT for ep in md.entry_points(group=PLUGIN_GROUP))


def register() -> None:
    """ebpo-lite's vllm.general_plugins entry point: patch this vLLM process if asked to."""
    if os.environ.get(ENV) == "1" and plugin_version() in PATCHED_RELEASES:
        patch()


def patch() -> None:
    """Replace the plugin's `_apply_4bit_weight` by `_float16_apply` around it (once)."""
    from vllm_bnb_plugin.quantization import linear

    method = linear.BitsAndBytesLinearMethod
    if not hasattr(method._apply_4bit_weight, "upstream"):
        method._apply_4bit_weight = _float16_apply(method._apply_4bit_weight, linear.apply_bnb_4bit)


def _float16_apply(upstream: Callable[..., torch.Tensor], apply_bnb_4bit: Any):
    """The plugin's 4-bit linear in float16 for a float16 input; `upstream` for any other."""

    def _apply_4bit_weight(
        self: Any, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dtype != torch.float16:
            return upstream(self, layer, x, bias)
        weight = layer.weight  # packed NF4 of the fused shards, one QuantState each
        rows = x.reshape(-1, x.shape[-1])  # [T, in]
        n_out = sum(state.shape[0] for state in weight.bnb_quant_state.values())
        out = torch.empty(rows.shape[0], n_out, dtype=x.dtype, device=x.device)  # [T, out]
        apply_bnb_4bit(rows, weight, weight.bnb_shard_offsets, out)  # per shard, in float16
        out = out.view(*x.shape[:-1], n_out)  # [..., out]
        return out if bias is None else out + bias

    _apply_4bit_weight.upstream = upstream  # type: ignore[attr-defined]
    return _apply_4bit_weight
