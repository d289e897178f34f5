"""Are LoRA gradients through an NF4 (bitsandbytes 4-bit) base right? The check, on any device.

    python -m ebpo_lite.commands.qlora_check [--device cpu|cuda] [--dtypes float32,bfloat16]
        [--layers 2] [--hidden 128] [--json FILE]

The reference for every NF4 computation is the same computation with each `Linear4bit` replaced
by an ordinary linear layer holding that layer's own dequantized weights (`dequantize_4bit`, on
the same device): the same function, so its outputs and gradients are what the NF4 ones must be.
Two levels (why each path exists: docs/qlora.md):

- One layer (`layer_errors`): a double-quantised NF4 `Linear4bit` at the row counts that select
  bitsandbytes' different kernels (1 and 4 rows: decode steps; 64 and 2048: training batches;
  on CUDA `gemm_4bit` runs a fused kernel up to a per-GPU row threshold and dequantize +
  `F.linear` above it), after the eval-mode no-grad forward that repacks the weight on
  AVX512-BF16 CPUs: its output, with and without grad, and d out / d x in train and eval mode.
- The policy (`policy_errors`): a random-init Qwen3 (GQA, q/k norms, untied embeddings) with
  LoRA on every linear layer, as `Policy.from_config` builds it, that has sampled (HF generate)
  and scored in eval mode without grad; then the LoRA gradients of ebpo_lite's clipped-surrogate
  loss on a fixed ragged batch, NF4 base vs its dequantized twin, and NF4 with gradient
  checkpointing on vs off. Layer 0's LoRA A tensors get their gradient through every 4-bit
  layer above them, so a base that drops its input gradient shows there first.

Bounds (relative L2 error per tensor; measured values in docs/qlora.md and tests/test_nf4.py):
- float32: 1e-5. On CPU both sides are `F.linear` on the same dequantized values: measured 0.
  On CUDA a fused kernel may sum in another order: fp32 round-off is about 1e-7 relative.
- bfloat16 / float16, policy: 3x the noise floor, measured in the same run: the distance between
  the dequantized twin's gradients in that dtype and in fp32 (the same values, exactly
  representable), i.e. what 16-bit rounding alone does to these gradients. It grows with the
  model (bf16, CPU: 0.019 at 2 x 128, 0.032 at 4 x 1024) and differs between devices' kernels,
  so a fixed number would be too loose for one and too tight for another. Measured NF4-vs-twin
  error / floor on CPU: 1.04-1.26 (bf16 and fp16, both sizes). peft's 4-bit LoRA layer rounds
  the LoRA output to 16 bits before adding it, its plain layer after: part of that ratio. A base
  that drops its input gradient puts layer 0's LoRA off by about 0.9, 15-50x the bound.
- bfloat16 / float16, one layer: 0.03. On CPU both sides are the same 16-bit `F.linear`:
  measured 0. On CUDA the fused kernel and cuBLAS may each sum in fp32 in their own order and
  round each output to 16 bits once (at most 2^-9 relative): a few 1e-3 (estimated, not measured
  on a GPU); the rest is room for a kernel that accumulates partly in 16 bits. A wrong block
  scale, a transposed weight or a dropped gradient is O(1).
- Gradient checkpointing on vs off: the recomputed forward is the same computation: 1e-6 (eager
  attention, so no attention kernel with atomic adds differs between the two runs), or 3x the
  run-to-run spread of the same backward run twice where that is larger (`run_to_run`: 0 on CPU;
  a CUDA kernel that reduces with atomic adds is not bit-reproducible). A recomputation that
  loses or changes a gradient is O(1) either way.

Runs on CPU in tests/test_nf4.py (default suite) and on CUDA as the first variant of
scripts/gpu_smoke.py. Needs bitsandbytes. Exit status 0 when every number is within its bound.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

TOL_FP32 = 1e-5  # policy LoRA gradients in fp32
FLOOR_FACTOR = 3.0  # 16-bit policy LoRA gradients: this times the measured noise floor
TOL_LAYER = {"float32": 1e-5, "bfloat16": 0.03, "float16": 0.03}  # one layer's output / d x
TOL_CKPT = 1e-6  # gradient checkpointing on vs off
LAYER_SHAPES = ((1, 1), (4, 1), (2, 32), (8, 256))  # [batch, tokens]: 1, 4, 64, 2048 rows
# The larger check (scripts/gpu_smoke.py on CUDA, benchmarks/qlora_check_cpu.py on CPU): a random
# Qwen3 and single layers wide enough to meet the weight sizes at which bitsandbytes' CUDA
# dispatch changes kernel.
LARGE_SHAPE = dict(
    num_hidden_layers=4,
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
)
LARGE_LAYERS = ((1024, 1024), (1024, 4096), (4096, 1024))  # one layer's (in, out) sizes


def rel(a: torch.Tensor | None, b: torch.Tensor) -> float:
    """Relative L2 error of `a` against the reference `b` (inf when `a` is missing)."""
    if a is None:
        return float("inf")
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------------- one layer


def nf4_layer(weight: torch.Tensor, dtype: torch.dtype, device: torch.device):
    """A double-quantised NF4 `Linear4bit` holding `weight` [out, in], kept differentiable."""
    import bitsandbytes as bnb

    from ebpo_lite.model.policy import keep_nf4_differentiable

    out_f, in_f = weight.shape
    layer = bnb.nn.Linear4bit(
        in_f, out_f, bias=False, compute_dtype=dtype, compress_statistics=True, quant_type="nf4"
    )
    layer.weight = bnb.nn.Params4bit(
        weight, requires_grad=False, compress_statistics=True, quant_type="nf4"
    )
    layer = layer.to(device)  # quantises here
    keep_nf4_differentiable(layer)
    return layer


def dequantized(layer) -> torch.Tensor:
    """The weight a `Linear4bit` computes with, as an ordinary tensor [out, in]."""
    import bitsandbytes as bnb

    return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


def layer_errors(
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    in_features: int = 1024,
    out_features: int = 1024,
    shapes=LAYER_SHAPES,
    seed: int = 0,
) -> list[dict]:
    """One NF4 layer against its dequantized weight, per input shape (module docstring).

    Per shape: `output` (no grad, eval: the sampler's call, which repacks on AVX512-BF16 CPUs),
    `output_grad` (the same input with grad, train and eval mode after it) and `input_grad`
    (d out / d x for a fixed random upstream gradient), each the worst relative error.
    """
    device, dt = torch.device(device), getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    layer = nf4_layer(w, dt, device)
    w_dq = dequantized(layer).to(dt)  # [out, in]
    rows = []
    for shape in shapes:
        x = torch.randn(*shape, in_features, generator=gen).to(device, dt)  # [B, T, in]
        g = torch.randn(*shape, out_features, generator=gen).to(device, dt)  # [B, T, out]
        want_y = torch.nn.functional.linear(x, w_dq)  # [B, T, out]
        want_dx = g @ w_dq  # [B, T, in]
        layer.eval()
        with torch.no_grad():
            y0 = layer(x)
        out_grad, in_grad = 0.0, 0.0
        for mode in (True, False):
            layer.train(mode)
            xg = x.clone().requires_grad_(True)
            y = layer(xg)
            if y.requires_grad:  # not so after a repack: gemv_4bit has no autograd kernel
                y.backward(g)
            out_grad = max(out_grad, rel(y.detach(), want_y))
            in_grad = max(in_grad, rel(xg.grad, want_dx))
        rows.append(
            {
                "shape": [*shape, in_features, out_features],
                "rows": shape[0] * shape[1],
                "output": rel(y0, want_y),
                "output_grad": out_grad,
                "input_grad": in_grad,
            }
        )
    return rows


# ----------------------------------------------------------------------------- the policy


def nf4_policy(model_dir, out_dir, device: str, dtype: str, four_bit=True, ckpt=False, log=None):
    """The policy `Policy.from_config` builds for the tiny recipe with `model_dir` as its model
    (LoRA only, on every linear layer), LoRA B set to small random values."""
    from ebpo_lite import catalog, config
    from ebpo_lite.model.policy import Policy

    cfg = config.load(
        catalog.recipe_path("tiny_cpu"),
        [
            f"output_dir={out_dir}",
            f"model.name={model_dir}",
            f"model.device={device}",
            "model.trainable_extra=[]",  # LoRA only: every trainable tensor has a 4-bit twin
            "model.attn_implementation=eager",  # deterministic backward on every device
            f"model.load_in_4bit={str(four_bit).lower()}",
            f"model.dtype={dtype}",
            f"model.gradient_checkpointing={str(ckpt).lower()}",
        ],
    )
    policy = Policy.from_config(cfg, log=log or (lambda *a: None))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at zero, which would make every LoRA A gradient zero
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return policy


def four_bit_layers(policy) -> dict[str, torch.nn.Module]:
    import bitsandbytes as bnb

    return {n: m for n, m in policy.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def dequantized_twin(policy, model_dir, out_dir, device: str, dtype: str):
    """The 16/32-bit policy with each 4-bit layer's dequantized weights and the same LoRA (in
    fp32 too: the dequantized 16-bit values are exact there)."""
    ref = nf4_policy(model_dir, out_dir, device, dtype, four_bit=False)
    mods = dict(ref.model.named_modules())
    with torch.no_grad():
        for name, mod in four_bit_layers(policy).items():
            mods[name].weight.copy_(dequantized(mod).to(mods[name].weight.dtype))
    ref.load_trainable_state(policy.trainable_state())
    return ref


def sample_and_score(policy) -> list[list[int]]:
    """What a training step does before its gradient: sample (HF generate; the decode steps run
    [N, 1, h] through every 4-bit layer) and score in eval mode, both without grad."""
    from ebpo_lite import config
    from ebpo_lite.rollout.hf import HFRollout

    roll = HFRollout(config.RolloutConfig(max_new_tokens=6), policy).generate(
        [[5, 6, 7], [9, 10]], group_size=2, seed=3
    )
    policy.token_logprobs([[5, 6, 7]] * 2 + [[9, 10]] * 2, roll.completion_ids)
    return roll.completion_ids


def rl_gradients(policy) -> dict[str, torch.Tensor]:
    """LoRA gradients of ebpo_lite's clipped-surrogate loss on a fixed ragged batch (fp32, CPU)."""
    from ebpo_lite.algo import loss
    from ebpo_lite.model.policy import completion_logprobs

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 100, (k,), generator=gen).tolist() for k in (3, 5, 6, 2)]
    completions = [torch.randint(4, 100, (k,), generator=gen).tolist() for k in (8, 4, 7, 1)]
    b = policy.batch(prompts, completions)
    policy.model.train()
    policy.model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(policy.model, b)  # [N, C]
    adv = torch.randn(logp.shape[0], generator=gen).to(logp.device)  # [N]
    noise = 0.1 * torch.randn(logp.shape, generator=gen).to(logp.device)  # [N, C]: some clipped
    value, _ = loss.policy_loss(logp, logp.detach() + noise, adv, b.completion_mask)
    value.backward()
    return {
        n: p.grad.float().cpu().clone()
        for n, p in policy.model.named_parameters()
        if p.requires_grad
    }


def gradient_report(got: dict, want: dict, bound: float) -> dict:
    """Worst relative error of `got` against `want`, and layer 0's LoRA A (the bottom)."""
    if got.keys() != want.keys():
        raise ValueError(f"different trainable tensors: {sorted(got.keys() ^ want.keys())[:4]}")
    errors = {n: rel(got[n], want[n]) for n in want}
    worst = max(errors, key=errors.get)
    bottom = [n for n in want if ".layers.0." in n and "lora_A" in n]
    return {
        "worst": errors[worst],
        "worst_tensor": worst,
        "bottom_worst": max(errors[n] for n in bottom),
        "bottom_min_norm": min(want[n].norm().item() for n in bottom),
        "tensors": len(errors),
        "bound": bound,
        "ok": errors[worst] <= bound,
    }


def policy_errors(model_dir, device: str = "cpu", dtype: str = "float32", log=None) -> dict:
    """NF4 vs dequantized-twin LoRA gradients, and checkpointing on vs off (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="ebpo_qlora_check_") as tmp:
        policy = nf4_policy(model_dir, tmp, device, dtype, log=log)
        ref = dequantized_twin(policy, model_dir, tmp, device, dtype)
        # what 16-bit rounding alone does: the twin in `dtype` vs in fp32 (built, like the twin,
        # before any forward: a repacked weight no longer dequantizes)
        ref32 = (
            dequantized_twin(policy, model_dir, tmp, device, "float32")
            if dtype != "float32"
            else None
        )
        sampled, ref_sampled = sample_and_score(policy), sample_and_score(ref)
        got, want = rl_gradients(policy), rl_gradients(ref)
        floor = 0.0
        if ref32 is not None:  # no 4-bit layer in it: nothing for a sampling pass to repack
            floor = gradient_report(want, rl_gradients(ref32), 1.0)["worst"]
            del ref32
        report = gradient_report(got, want, FLOOR_FACTOR * floor if floor else TOL_FP32)
        report["noise_floor"] = floor
        ckpt = nf4_policy(model_dir, tmp, device, dtype, ckpt=True, log=log)
        ckpt.load_trainable_state(policy.trainable_state())
        sample_and_score(ckpt)
        # the bound: fp32 round-off, or 3x the run-to-run spread of the same backward where the
        # device's kernels are not deterministic (a CUDA kernel may reduce with atomic adds)
        spread = gradient_report(rl_gradients(policy), got, 1.0)["worst"]
        bound = max(TOL_CKPT, FLOOR_FACTOR * spread)
        report["checkpointing"] = gradient_report(rl_gradients(ckpt), got, bound)
        report["checkpointing"]["run_to_run"] = spread
        layers = four_bit_layers(policy).values()
        report["four_bit_layers"] = len(layers)
        report["repacked_for_cpu_gemv"] = sum(
            bool(getattr(m.weight.quant_state, "packing_format_for_cpu", 0)) for m in layers
        )
        report["same_samples"] = sampled == ref_sampled  # recorded: fused decode kernels may differ
    report["ok"] = bool(
        report["ok"] and report["checkpointing"]["ok"] and not report["repacked_for_cpu_gemv"]
    )
    return report


# ----------------------------------------------------------------------------- the command


def check(device: str, dtypes: list[str], model_dir, layer_features=((1024, 1024),), log=None):
    """Every check for each dtype: {"dtypes": {dtype: {"layer": [...], "policy": {...}}}, "ok"}.

    `layer_features`: the (in, out) sizes of the single layers checked, each at every row count.
    """
    out = {"device": str(device), "model": str(model_dir), "dtypes": {}}
    for dtype in dtypes:
        layer = [r for i, o in layer_features for r in layer_errors(device, dtype, i, o)]
        worst = max(max(r["output"], r["output_grad"], r["input_grad"]) for r in layer)
        out["dtypes"][dtype] = {
            "layer": layer,
            "layer_worst": worst,
            "layer_bound": TOL_LAYER[dtype],
            "policy": policy_errors(model_dir, device, dtype, log),
        }
        out["dtypes"][dtype]["ok"] = bool(
            worst <= TOL_LAYER[dtype] and out["dtypes"][dtype]["policy"]["ok"]
        )
    out["ok"] = all(d["ok"] for d in out["dtypes"].values())
    return out


def json_ready(obj):
    """`obj` with every non-finite float (a missing gradient's inf) as a string: strict JSON."""
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def summary_lines(result: dict) -> list[str]:
    lines = []
    for dtype, d in result["dtypes"].items():
        p = d["policy"]
        lines.append(
            f"{dtype}: one layer worst {d['layer_worst']:.1e} (bound {d['layer_bound']:.0e}); "
            f"LoRA gradients NF4 vs dequantized worst {p['worst']:.1e} (bound {p['bound']:.1e}"
            + (
                f" = {FLOOR_FACTOR:g} x noise floor {p['noise_floor']:.1e}"
                if p["noise_floor"]
                else ""
            )
            + "), "
            f"layer 0 {p['bottom_worst']:.1e}; checkpointing on vs off "
            f"{p['checkpointing']['worst']:.1e} (bound {p['checkpointing']['bound']:.0e}): "
            + ("ok" if d["ok"] else "FAILED")
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ebpo_lite.commands.qlora_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated compute dtypes")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the random Qwen3")
    ap.add_argument("--hidden", type=int, default=128, help="its hidden size (head size 32)")
    ap.add_argument("--json", help="also write the full result here")
    args = ap.parse_args(argv)
    from ebpo_lite.cli import quiet_libraries
    from ebpo_lite.errors import ConfigError
    from ebpo_lite.model.device import DTYPES, resolve_device
    from ebpo_lite.model.tiny import save_random_qwen3

    quiet_libraries()  # before bitsandbytes' import, which logs its kernel-hub lookup
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        print(
            "error: qlora_check needs bitsandbytes (pip install 'ebpo-lite[bnb]')", file=sys.stderr
        )
        return 2
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    try:
        device = resolve_device(args.device, "--device")
        bad = [d for d in dtypes if d not in DTYPES]
        if bad or not dtypes:
            raise ConfigError(
                f"--dtypes: expected some of {', '.join(DTYPES)}, got {args.dtypes!r}"
            )
        if args.layers < 1:
            raise ConfigError(f"--layers: must be >= 1, got {args.layers}")
        if args.hidden < 32 or args.hidden % 32:
            raise ConfigError(f"--hidden: must be a positive multiple of 32, got {args.hidden}")
        if args.json and Path(args.json).is_dir():
            raise ConfigError(f"--json: {args.json} is a folder; give a file path")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ebpo_qlora_model_") as tmp:
        shape = {"num_hidden_layers": args.layers, "hidden_size": args.hidden}
        shape["intermediate_size"] = 4 * args.hidden
        shape["num_attention_heads"] = max(2, args.hidden // 32)
        shape["num_key_value_heads"] = max(1, shape["num_attention_heads"] // 2)
        model_dir = save_random_qwen3(Path(tmp) / "model", **shape)
        result = check(str(device), dtypes, model_dir)
    result["shape"] = shape
    for line in summary_lines(result):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(json_ready(result), indent=2, allow_nan=False) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
