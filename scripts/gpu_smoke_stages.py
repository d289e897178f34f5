"""The GPU smoke test's stages for the real recipes' shapes (scripts/gpu_smoke.py runs them).

Each stage runs in its own child process, inside the script's --budget, and writes one entry of
the result JSON (rewritten as it goes, so a stage cut short by its timeout keeps what it did):

    fp16_scaler      a few steps of the tiny model in model.dtype=float16 (ebpo_lite/model/
                     scaler.py): train/loss_scale, skipped steps, scale retries, whether the
                     gradients were finite
    sleep_wake       vLLM's same-seed tokens with the same LoRA adapter before `sleep` and after
                     `wake_up` (LoRA state intact across the sleep rollout.sleep picks: level 1
                     by default), against the base's
                                                       skipped without vllm, and on the CPU
    qwen3_8b_step    a random-weight model of Qwen3-8B's exact config (model_specs.json), built
                     on the device in 16-bit and quantised to NF4 there (no hub, no weight file,
                     no fp32 copy on the host), + LoRA as recipes/qwen3_8b_lora.yaml; one full
                     `train.train_step` (transformers sampler at a small batch, loss, backward
                     with gradient checkpointing, AdamW step): peak memory per phase against
                     `ebpo-lite plan`'s numbers for the same shape  skipped without bitsandbytes
    hf_tokens_per_s  tokens/s of the transformers sampler at the recipe's batch (prompts_per_step
                     x group_size) on that model, max_new_tokens cut (CUT_NEW_TOKENS)
                                                       skipped without bitsandbytes

The 8B model has the tiny character tokenizer padded to Qwen3's vocabulary (its special ids
replace Qwen's), so the prompts are the arithmetic task's (a few dozen tokens, where the recipe's
GSM8K chat prompts are a few hundred), a random model almost never samples a stop id (every
completion runs to max_new_tokens), and the reward is `text_parity`, not the recipe's. Its policy is built here and handed to `engine.run.build_run(policy=...)`; the
rest (data, sampler, loss, optimizer, `train_step`) is the trainer's own code.

`--cpu-rehearsal`: the same code on the CPU in float32, on a scaled-down member of the family
(REHEARSAL_SHAPE: two layers, hidden 128, Qwen3's vocabulary), each entry marked `rehearsal`;
sleep_wake is skipped there (vLLM has no sleep mode on CPU: enable_sleep_mode raises, sleep() is a
no-op, so identical tokens would prove nothing). Nothing here imports torch at module level: the
parent process of gpu_smoke.py never does.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("fp16_scaler", "sleep_wake", "qwen3_8b_step", "hf_tokens_per_s")
NEEDS = {
    "sleep_wake": ["vllm"],
    "qwen3_8b_step": ["bitsandbytes"],
    "hf_tokens_per_s": ["bitsandbytes"],
}
RECIPE_8B = REPO / "recipes" / "qwen3_8b_lora.yaml"
TINY_RECIPE = REPO / "recipes" / "tiny_cpu.yaml"
SPEC_KEY = "Qwen/Qwen3-8B"
ARCH_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings",
)  # fmt: skip
REHEARSAL_SHAPE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32,
)  # fmt: skip
# (prompts, group size, new tokens) of the one training step; the recipe's 16 x 8 x 512 is
# hf_tokens_per_s's batch, its length cut to CUT_NEW_TOKENS (the decode time grows with it)
STEP_BATCH = {"cuda": (4, 4, 128), "cpu": (2, 4, 8)}
CUT_NEW_TOKENS = {"cuda": 256, "cpu": 8}
CUT_PROMPTS = {"cuda": 1, "cpu": 4}  # the recipe's prompts per step divided by this: 16 -> 4 on CPU
PARITY = "gpu_smoke_stages:text_parity"  # the 8B stages' reward (its worker has our sys.path)
MIN_S = {"qwen3_8b_step": 90, "hf_tokens_per_s": 90}  # less left: out of time (estimates)
CPU_SLEEP = (
    "vLLM has no sleep mode on the CPU (enable_sleep_mode raises, sleep() is a no-op): "
    "same tokens would prove nothing; runs on a CUDA GPU with vllm installed"
)
PLANNED = (
    "params_total", "policy_weights_gb", "lora_params_gb", "optimizer_gb", "trainer_static_gb",
    "hf_generation_gb", "activations_gb", "logits_gb", "cuda_context_gb", "fragmentation_gb",
    "generation_phase_gb", "training_phase_gb",
)  # fmt: skip


def skip_reason(stage: str, device: str, missing: str | None = None) -> str | None:
    """Why `stage` cannot run: `missing` (a package, gpu_smoke.missing_requirements) and what
    `device` cannot do whatever is installed; None: it can run."""
    cannot = CPU_SLEEP if stage == "sleep_wake" and device != "cuda" else None
    return "; ".join(filter(None, (missing, cannot))) or None


def child_argv(stage: str, out_dir: Path, steps: int, dtype: str, device: str, overrides) -> list:
    """The recipe and `section.key=value` overrides a stage's child loads (`overrides`:
    gpu_smoke.variant_overrides, which turns the tiny recipe into a GPU variant)."""
    if stage == "fp16_scaler":  # CPU float16 matmuls are slow: a smaller batch there
        small = ["train.prompts_per_step=8", "rollout.group_size=4"] if device != "cuda" else []
        ov = overrides("hf_16bit", out_dir, steps, "float16", "tiny", device)
        return [str(TINY_RECIPE), *ov, *small]
    if stage == "sleep_wake":
        return [str(TINY_RECIPE), *overrides("vllm_16bit", out_dir, 1, dtype, "tiny", device)]
    prompts, group, new = STEP_BATCH[device]
    if stage == "hf_tokens_per_s":  # the recipe's batch, its completions cut
        recipe = _recipe_batch()
        prompts, group = recipe["prompts_per_step"], recipe["group_size"]
        prompts, new = prompts // CUT_PROMPTS[device], CUT_NEW_TOKENS[device]
    ov = {
        "output_dir": out_dir, "model.name": out_dir / "model", "model.device": device,
        "model.dtype": dtype, "rollout.backend": "hf", "rollout.max_new_tokens": new,
        "rollout.group_size": group, "train.prompts_per_step": prompts, "train.steps": 1,
        "train.checkpoint_every": 0, "train.threads": 0, "data.name": "arithmetic",
        "data.labels_path": "null", "data.num_train": 64, "data.num_eval": 16,
        "data.max_prompt_tokens": 64, "curriculum.sampler": "shuffle", "eval.every": 0,
        "eval.num_examples": 16, "log.progress": "none", "reward.functions": f"[{PARITY}]",
    }  # fmt: skip
    return [str(RECIPE_8B), *(f"{k}={v}" for k, v in ov.items())]


# ----------------------------------------------------------------------------- in the child


def run_stage(stage: str, argv: list[str], result_path: Path, device: str) -> int:
    """In the child: run `stage`, writing its entry to `result_path` as it goes; its exit code."""
    from ebpo_lite.cli import quiet_libraries

    quiet_libraries()
    entry = {"variant": stage, "rc": 1, "argv": argv, "rehearsal": device != "cuda"}
    t0 = time.perf_counter()

    def save(**fields) -> None:
        from ebpo_lite.commands.qlora_check import json_ready

        entry.update(fields, wall_s=time.perf_counter() - t0)
        result_path.write_text(json.dumps(json_ready(entry), indent=2, allow_nan=False))

    run = {"fp16_scaler": fp16_scaler, "sleep_wake": sleep_wake,
           "qwen3_8b_step": qwen3_8b_step, "hf_tokens_per_s": hf_tokens_per_s}[stage]  # fmt: skip
    save()
    rc = run(argv, device, save)
    save(rc=rc)
    return rc


def fp16_scaler(argv: list[str], device: str, save) -> int:
    """The tiny model in float16 through `train.main`: each step's loss scale, skips, retries and
    gradient norm from metrics.jsonl. Ok: every step logged, every applied step's gradients finite."""
    from ebpo_lite import config, train
    from ebpo_lite.model.scaler import INIT_SCALE

    rc = train.main(argv)
    cfg = config.load(argv[0], argv[1:])
    steps = []
    path = Path(cfg.output_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)  # Python's json reads the NaN a skipped step logs
        if "train/skipped_steps" in rec:
            keys = ("loss_scale", "skipped_steps", "scale_retries", "grad_norm")
            steps.append({"step": rec["step"], **{k: rec.get(f"train/{k}") for k in keys}})
    norms = [s["grad_norm"] for s in steps if isinstance(s["grad_norm"], (int, float))]
    finite = bool(norms) and all(math.isfinite(n) for n in norms)
    scales = [s["loss_scale"] for s in steps if s["loss_scale"] is not None]
    save(
        dtype="float16", steps=steps, init_scale=INIT_SCALE,
        loss_scale_last=scales[-1] if scales else None,
        skipped_steps=steps[-1]["skipped_steps"] if steps else None,
        gradients_finite=finite, train_rc=rc, **_memory(device),
    )  # fmt: skip
    return 0 if rc == 0 and len(steps) == cfg.train.steps and finite and scales else 1


def sleep_wake(argv: list[str], device: str, save) -> int:
    """vLLM, the tiny model, a non-zero LoRA adapter: same-seed tokens before `VLLMRollout.sleep`
    (rollout.sleep's mode: level 1 by default) and after its wake. Ok: identical, and different
    from the base's (the adapter is in them)."""
    import torch

    from ebpo_lite import config
    from ebpo_lite.engine.run import build_run

    run = build_run(config.load(argv[0], argv[1:]))
    try:
        prompts, G, seed = run.prompt_ids[:8], run.cfg.rollout.group_size, 1234
        base = run.backend.generate(prompts, G, seed=seed)  # version 0: LoRA B = 0, the base
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in run.policy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        run.backend.sync(run.policy, version=1)
        before = run.backend.generate(prompts, G, seed=seed)
        used = {"awake": _used_gb(device)}
        t = time.perf_counter()
        run.backend.sleep()
        sleep_s, used["asleep"] = time.perf_counter() - t, _used_gb(device)
        t = time.perf_counter()
        run.backend.wake()
        wake_s, used["woken"] = time.perf_counter() - t, _used_gb(device)
        after = run.backend.generate(prompts, G, seed=seed)
        same = before.completion_ids == after.completion_ids
        changed = before.completion_ids != base.completion_ids
        pairs = zip(before.sampler_logprobs or [], after.sampler_logprobs or [])
        gaps = [abs(a - b) for x, y in pairs for a, b in zip(x, y)]
        save(
            tokens_identical=same, adapter_changes_tokens=changed,
            after_wake_equals_base=after.completion_ids == base.completion_ids,
            sequences=len(before.completion_ids), logprob_diff_max=max(gaps, default=None),
            sleep_on_engine=bool(run.backend.sleeps), sleep_s=sleep_s, wake_s=wake_s,
            sleep_mode=getattr(run.backend, "sleep_mode", "level 1"),  # rollout.sleep
            device_used_gb=used,
        )  # fmt: skip
    finally:
        run.backend.close()
    return 0 if same and changed else 1


def qwen3_8b_step(argv: list[str], device: str, save) -> int:
    """One `train_step` of the random-weight Qwen3-8B in NF4 + LoRA (module docstring); ok: a
    finite loss and gradient norm, and LoRA B (zero at init) moved."""
    from ebpo_lite.train import train_step

    run, built = _built_run(argv, device, save)
    run.backend = peaks = PhasePeaks(run.backend, run.policy.device)
    b_before = _lora_b_abs_sum(run.policy.model)
    t = time.perf_counter()
    record = train_step(run, 1)
    step_s = time.perf_counter() - t
    peaks.mark("train")
    b_after = _lora_b_abs_sum(run.policy.model)
    loss, norm = record.get("train/loss"), record.get("train/grad_norm")
    numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    save(
        step_s=step_s, step_metrics=numbers, peak_per_phase=peaks.seen,
        lora_b_abs_sum_before=b_before, lora_b_abs_sum_after=b_after,
        sequences=run.cfg.train.prompts_per_step * run.cfg.rollout.group_size,
        **_compare(run, built, peaks.seen),
    )  # fmt: skip
    ok = all(isinstance(x, float) and math.isfinite(x) for x in (loss, norm))
    return 0 if ok and b_before == 0.0 and math.isfinite(b_after) and b_after > 0.0 else 1


def hf_tokens_per_s(argv: list[str], device: str, save) -> int:
    """The transformers sampler (`rollout/hf.py`) on the random Qwen3-8B in NF4: one warm-up
    call, then the recipe's prompts x G at CUT_NEW_TOKENS, timed. Ok: tokens came out."""
    run, built = _built_run(argv, device, save)
    cfg, backend = run.cfg, run.backend
    recipe = _recipe_batch()
    backend.generate(run.prompt_ids[:1], 1, seed=0, max_new_tokens=4)  # kernels, allocator
    peaks = PhasePeaks(backend, run.policy.device)
    peaks.wake()
    prompts = run.prompt_ids[: cfg.train.prompts_per_step]
    t = time.perf_counter()
    roll = backend.generate(prompts, cfg.rollout.group_size, seed=1)
    seconds = time.perf_counter() - t
    peaks.mark("rollout")
    tokens = sum(len(c) for c in roll.completion_ids)
    save(
        sequences=len(roll.completion_ids), new_tokens_per_sequence=cfg.rollout.max_new_tokens,
        tokens=tokens, generate_s=seconds, tokens_per_s=tokens / seconds,
        sequences_finished=sum(roll.finished),
        cut=f"max_new_tokens {recipe['max_new_tokens']} -> {cfg.rollout.max_new_tokens}, "
        f"prompts per step {recipe['prompts_per_step']} -> {cfg.train.prompts_per_step} "
        f"(group size {cfg.rollout.group_size}, the recipe's); arithmetic prompts of the tiny "
        "tokenizer, not GSM8K's chat prompts",
        hf_loop=cfg.rollout.hf_loop, peak_per_phase=peaks.seen, **_compare(run, built, peaks.seen),
    )  # fmt: skip
    return 0 if tokens > 0 else 1


# ----------------------------------------------------------------------------- the 8B model


def text_parity(completions, **columns) -> list[float]:
    """1 for a completion of odd length in characters, else 0: the random model's rewards vary
    within a group, so its advantages and LoRA gradients are not all zero (the recipe's GSM8K
    reward would give 0 to every completion of a random model, and a step that learns nothing)."""
    return [float(len(str(c)) % 2) for c in completions]


def model_shape(device: str) -> tuple[dict, str]:
    """Qwen3-8B's architecture from ebpo_lite/model/model_specs.json (scaled down off CUDA) with
    the tiny tokenizer's special ids, and where the numbers came from."""
    from ebpo_lite.model.memory import load_specs
    from ebpo_lite.model.tiny import tiny_config_kwargs

    spec = load_specs()[SPEC_KEY]
    shape = {k: spec[k] for k in ARCH_KEYS}
    source = f"ebpo_lite/model/model_specs.json[{SPEC_KEY}] ({spec['_source']})"
    if device != "cuda":
        shape.update(REHEARSAL_SHAPE)
        source = (
            f"rehearsal: {SPEC_KEY}'s config scaled down ({REHEARSAL_SHAPE}), its vocabulary kept"
        )
    ids = {k: tiny_config_kwargs()[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {"model_type": "qwen3", **shape, **ids}, source


def _built_run(argv: list[str], device: str, save):
    """The model folder (config.json + tokenizer, no weights), the policy built in place, and
    `build_run` around it; `built` holds what building cost."""
    import torch

    from ebpo_lite import config
    from ebpo_lite.engine.run import build_run
    from ebpo_lite.model.tiny import build_tokenizer

    cfg = config.load(argv[0], argv[1:])
    shape, source = model_shape(device)
    folder = Path(cfg.model.name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape, indent=2))
    build_tokenizer(shape["vocab_size"]).save_pretrained(folder)  # every id has a text
    t = time.perf_counter()
    policy, built = random_nf4_policy(cfg, shape)
    built.update(build_s=time.perf_counter() - t, shape=shape, shape_source=source)
    built["scaled_down"] = device != "cuda"
    save(model=built)
    run = build_run(cfg, policy=policy)
    if policy.device.type == "cuda":
        built["static_allocated_gb"] = torch.cuda.memory_allocated(policy.device) / 2**30
    return run, built


def random_nf4_policy(cfg, shape: dict):
    """A `Policy` of random weights: the model made on `model.device` in `model.dtype` (no host
    copy), every linear layer but lm_head quantised there to bitsandbytes NF4 with the settings
    `Policy.from_config` loads with (`policy._nf4_config`: the code transformers' bitsandbytes
    quantizer runs per weight, `integrations/bitsandbytes.py` Bnb4bitQuantize), then what
    `from_config` does after the load: LoRA, gradient checkpointing."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from ebpo_lite.model import policy as pol
    from ebpo_lite.model.device import resolve_attn, resolve_device, resolve_dtype

    m = cfg.model
    device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, device)
    attn = resolve_attn(m.attn_implementation, device, dtype)
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen3Config(**shape), dtype=dtype, attn_implementation=attn
        )
    built = {"params_built": sum(p.numel() for p in model.parameters()), "dtype": str(dtype)}
    if device.type == "cuda":
        built["build_peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    q, head = pol._nf4_config(dtype), model.get_output_embeddings()
    names = [
        n for n, mod in model.named_modules() if type(mod) is torch.nn.Linear and mod is not head
    ]
    for name in names:
        old = model.get_submodule(name)
        with torch.device("meta"):
            new = bnb.nn.Linear4bit(
                old.in_features, old.out_features, old.bias is not None, q.bnb_4bit_compute_dtype,
                compress_statistics=q.bnb_4bit_use_double_quant, quant_type=q.bnb_4bit_quant_type,
                quant_storage=q.bnb_4bit_quant_storage,
            )  # fmt: skip
        new.weight = bnb.nn.Params4bit(
            old.weight.data, requires_grad=False, **new.weight.__dict__
        ).to(device)
        new.requires_grad_(False)
        model.set_submodule(name, new)
        del old  # its 16-bit weight goes now, not after the loop
    model.is_loaded_in_4bit = True  # as transformers' quantizer marks it (peft reads it)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the 16-bit weights' blocks back to the driver
    built["nf4_layers"] = pol.keep_nf4_differentiable(model)
    tokenizer = AutoTokenizer.from_pretrained(m.name)
    torch.manual_seed(cfg.train.seed)  # LoRA A's init, as from_config
    model = pol._add_lora(model, m)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    built["lora_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    built["gradient_checkpointing"] = m.gradient_checkpointing
    policy = pol.Policy(model, tokenizer, device, m.name, m.lora_rank, m.trainable_extra, dtype)
    return policy, built


class PhasePeaks:
    """The sampler with torch's peak memory read at the phase boundaries `train_step` marks:
    `wake()` starts the rollout, `sleep()` ends it; `mark(phase)` ends any phase by hand. Nothing
    on the CPU (no device counters): `seen[phase]` is then None."""

    def __init__(self, backend, device):
        self.inner, self.device, self.seen = backend, device, {}

    def __getattr__(self, name):  # generate, sync, close: the sampler's own
        return getattr(self.inner, name)

    def wake(self) -> None:
        self._reset()
        self.inner.wake()

    def sleep(self) -> None:
        self.inner.sleep()
        self.mark("rollout")

    def mark(self, phase: str) -> None:
        import torch

        if self.device.type != "cuda":
            self.seen[phase] = None
            return
        free, total = torch.cuda.mem_get_info(self.device)
        self.seen[phase] = {
            "peak_allocated_gb": torch.cuda.max_memory_allocated(self.device) / 2**30,
            "peak_reserved_gb": torch.cuda.max_memory_reserved(self.device) / 2**30,
            "device_used_gb": (total - free) / 2**30,
        }
        self._reset()

    def _reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def _compare(run, built: dict, seen: dict) -> dict:
    """`ebpo-lite plan` for the shape as run (the longest prompt drawn as data.max_prompt_tokens,
    the plan's worst case) beside what was measured; on the CPU the plan alone (still a GPU plan)."""
    import torch

    from ebpo_lite.model import plan

    cfg, dev = run.cfg, run.policy.device
    longest = max(len(p) for p in run.prompt_ids)
    as_run = replace(cfg, data=replace(cfg.data, max_prompt_tokens=longest))
    total = torch.cuda.mem_get_info(dev)[1] / 2**30 if dev.type == "cuda" else 80.0
    p = plan.plan(as_run, total, torch.cuda.get_device_name(dev) if dev.type == "cuda" else None)
    planned = {k: p[k] for k in PLANNED}
    out = {"planned": planned, "planned_prompt_tokens": longest}
    out["same_params_as_plan"] = built["params_built"] == p["params_total"]
    if dev.type == "cuda":
        measured = {ph: v["device_used_gb"] for ph, v in seen.items() if v}
        out["measured_minus_planned_gb"] = {
            ph: measured[ph]
            - planned[f"{'generation' if ph == 'rollout' else 'training'}_phase_gb"]
            for ph in measured
        }
    return out


def _recipe_batch() -> dict:
    """The recipe's prompts per step, group size and completion length (config reads YAML only:
    no torch, so the parent may call this)."""
    from ebpo_lite import config

    cfg = config.load(RECIPE_8B)
    r = cfg.rollout
    return {"prompts_per_step": cfg.train.prompts_per_step, "group_size": r.group_size,
            "max_new_tokens": r.max_new_tokens}  # fmt: skip


def _lora_b_abs_sum(model) -> float:
    """Sum of |LoRA B| (zero at peft's init: above zero once an optimizer step moved it)."""
    import torch

    with torch.no_grad():
        return float(
            sum(p.abs().sum().item() for n, p in model.named_parameters() if "lora_B" in n)
        )


def _used_gb(device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _memory(device: str) -> dict:
    import torch

    if device != "cuda":
        return {}
    return {"peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30}


def summary(e: dict) -> str:
    """One line for the script's log."""
    if e["status"] != "ok":
        return f"(rc {e.get('returncode')}): {e.get('log_tail', '')[-300:]}"
    v, text = e["variant"], f"{e['wall_s']:.1f}s"
    if v == "fp16_scaler":
        return text + f", loss scale {e['loss_scale_last']:g}, skipped {e['skipped_steps']}"
    if v == "sleep_wake":
        return text + f", tokens identical across sleep: {e['tokens_identical']}"
    if v == "hf_tokens_per_s":
        return text + f", {e['tokens_per_s']:.0f} tokens/s ({e['sequences']} sequences)"
    return (
        text
        + f", loss {e['step_metrics'].get('train/loss')}, {e['model']['params_built']:,} params"
    )
