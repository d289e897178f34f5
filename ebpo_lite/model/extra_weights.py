"""Trained base tensors beside a LoRA adapter (`model.trainable_extra`, e.g. norm weights):
written into the peft adapter folder as `modules_to_save`, so `PeftModel.from_pretrained(base,
folder)` is the trained model. Used by `Policy.export_adapter` and the export command."""

from __future__ import annotations

from pathlib import Path

import torch

from ebpo_lite.errors import UserError


def unsaveable_extra(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The trained non-LoRA tensors (peft names) that peft's `modules_to_save` cannot hold: those
    inside a LoRA-wrapped layer (`.base_layer.`), which only a merge can carry."""
    return [n for n in tensors if "lora_" not in n and ".base_layer." in n]


def add_extra_weights(adapter_dir: str | Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Add trained non-LoRA tensors to a peft adapter folder as `modules_to_save`; returns the
    module names.

    `tensors` maps peft parameter names (`base_model.model.<module>.<param>`, as in
    `trainable_state`) to values; LoRA tensors among them are ignored. peft 0.21 loads a
    `modules_to_save` entry by wrapping every module whose name ends with it in a
    `ModulesToSaveWrapper` (a copy of the base module) and filling the copy from the adapter
    file's `base_model.model.<module>.<param>` tensors, the names written here; parameters of
    such a module that are absent keep the base's values. Full module names, so that
    `model.layers.1.input_layernorm` never matches layer 11's.
    """
    import json

    from safetensors.torch import load_file, save_file

    extra = {n: v for n, v in tensors.items() if "lora_" not in n}
    if not extra:
        return []
    if bad := unsaveable_extra(extra):
        raise UserError(
            f"model.trainable_extra: {bad[0]} is inside a LoRA layer; a peft adapter cannot "
            "hold it (export a merged model instead)"
        )
    out = Path(adapter_dir)
    weights = load_file(out / "adapter_model.safetensors")
    weights.update({n: v.detach().cpu().contiguous() for n, v in extra.items()})
    save_file(weights, out / "adapter_model.safetensors", metadata={"format": "pt"})
    modules = sorted({n.removeprefix("base_model.model.").rsplit(".", 1)[0] for n in extra})
    cfg_path = out / "adapter_config.json"
    adapter_cfg = json.loads(cfg_path.read_text())
    adapter_cfg["modules_to_save"] = sorted(
        set(adapter_cfg.get("modules_to_save") or []) | set(modules)
    )
    cfg_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")
    return modules
