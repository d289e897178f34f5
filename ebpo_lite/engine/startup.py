"""What a run says before its first step, one line each (`run.build_run` prints them): the data,
the memory plan on this GPU, the model about to load (and whether it downloads first: the hub's
progress bars follow), the sampler."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ebpo_lite.data import loader as data
from ebpo_lite.errors import UserError

if TYPE_CHECKING:
    from ebpo_lite.config import Config, DataConfig, ModelConfig, RolloutConfig, TrainConfig


def data_line(d: DataConfig, train: list, held: list) -> str:
    source, whence = data.describe_source(d, train), data.describe_held(held)
    line = f"data: {len(train)} training prompts from {source}, {len(held)} held out for the eval"
    return line + (f" ({whence})" if whence else "")


def memory_line(cfg: Config) -> str:
    """The memory plan on this GPU in one line (`plan.plan`), or why there is none."""
    from ebpo_lite.model.device import cuda_memory_gib, cuda_name, resolve_device
    from ebpo_lite.model.plan import plan

    dev = resolve_device(cfg.model.device)
    mem = cuda_memory_gib(dev)
    if mem is None:
        return "memory: no GPU, so no GPU memory plan (ebpo-lite plan RECIPE --gpu 24)"
    try:
        p = plan(cfg, mem[1], cuda_name(dev))
    except UserError as e:  # a model whose shape the planner does not know
        return f"memory: no plan ({e})"
    peak = max(p["per_device_gb"].values())
    line = (
        f"memory plan: weights {p['policy_weights_gb']:.1f} GiB, training phase "
        f"{p['training_phase_gb']:.1f}, peak {peak:.1f} of {p['gpu_gb']:.1f} GiB ({p['gpu_name']})"
    )
    if p["vllm_reserved_gb"]:
        line += (
            f"; vLLM reserves {p['vllm_reserved_gb']:.1f} GiB: "
            f"{p['vllm_concurrent_sequences']} of {p['sequences_per_step']} sequences at once"
        )
    return line


def model_line(m: ModelConfig) -> str:
    """What is about to load: name, dtype, 4-bit, device, and whether it downloads first."""
    from ebpo_lite.model.base_model import is_gguf_name
    from ebpo_lite.model.device import resolve_device, resolve_dtype

    device = resolve_device(m.device)
    dtype = str(resolve_dtype(m.dtype, device)).removeprefix("torch.")
    parts = [dtype, "4-bit NF4" if m.load_in_4bit else "", f"on {device}", f"LoRA r {m.lora_rank}"]
    where = ""
    if m.name == "tiny":
        where = " (built in)"
    elif is_gguf_name(m.name):
        where = " (GGUF, dequantized to an fp32 folder once and cached: ebpo_lite.model.base_model)"
    elif not Path(m.name).expanduser().exists():
        from huggingface_hub import try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(m.name, "config.json"), str)
        where = (
            " (from the Hugging Face cache)"
            if cached
            else " (not in the Hugging Face cache yet: downloading it first, progress below)"
        )
    return f"model: {m.name}{where}, {', '.join(p for p in parts if p)}"


def sampler_line(r: RolloutConfig, t: TrainConfig) -> str:
    """The sampler and how much it samples per step."""
    name = {
        "hf": f"transformers ({'lean decode loop' if r.hf_loop == 'lean' else 'generate'}, "
        "the trainer's own model)",
        "vllm": f"vLLM (gpu_memory_utilization {r.gpu_memory_utilization}, adapter-only sync)",
        "unsloth": "Unsloth's vLLM (shares the trainer's base)",
    }[r.backend]
    return (
        f"sampler: {name}; {t.prompts_per_step} prompts x {r.group_size} completions "
        f"per step, up to {r.max_new_tokens} new tokens"
    )
