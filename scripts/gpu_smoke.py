"""GPU smoke test: a few real training steps per backend on a CUDA machine, no internet.

    python scripts/gpu_smoke.py --wheels DIR [--steps 4] [--model tiny|small] [--only hf_16bit,vllm_nf4]
        [--budget 450] [--wheels-target DIR] [--cpu-rehearsal]

`--wheels DIR`: before any variant, every wheel in DIR whose distribution is not installed
(bitsandbytes, vllm and their dependencies, downloaded on a connected machine) is installed with
`pip install --no-index --no-deps --find-links DIR` into the running environment, or into
`--wheels-target` (put on sys.path and the children's PYTHONPATH); it prints what it installed
and what it skipped. `--budget` caps the whole run's wall clock (default 450 s: all variants in
under 8 minutes); a variant gets at most the time left, and once too little is left the rest are
recorded as "skipped: out of time". How to run it and what passing means: docs/gpu_check.md.

Each variant runs in its own child process (clean CUDA state, exact peak memory), and so does
every look at the GPU: this process never imports torch, so it opens no CUDA context of its own
(one would hold ~0.5 GiB of the GPU the variants measure, and vLLM's engine would have to spawn
instead of fork). The machine's facts (GPU, capability, versions) come from a `facts` child, the
`small` model from another. The first variant is
`ebpo_lite.commands.qlora_check` on the GPU; the others run `ebpo_lite.train.main(argv)` on
recipes/tiny_cpu.yaml moved to the GPU (model.device=cuda):

    nf4_grads   LoRA gradients through bitsandbytes' CUDA NF4 kernels against the dequantized
                base (fp32 and bf16/fp16), checkpointing on vs off, one layer at 1-2048 rows
                                                            skipped when bitsandbytes is missing
    hf_16bit    transformers sampler, bf16 (fp16 on GPUs without native bf16: T4, V100, P100)
    hf_nf4      + NF4 base (bitsandbytes)                 skipped when bitsandbytes is missing
    vllm_16bit  colocated vLLM sampler (adapter-only sync) skipped when vllm is missing
    vllm_nf4    + NF4 base in trainer and vLLM             skipped without vllm or bitsandbytes
    unsloth     Unsloth sampler                            skipped when unsloth is missing

Then the stages for the real recipes' shapes, each in its own child too (scripts/
gpu_smoke_stages.py): fp16_scaler (float16 loss scaling), sleep_wake (vLLM tokens across
sleep with the same adapter), qwen3_8b_step (one train_step of a random-weight Qwen3-8B in
NF4, memory per phase against the planner), hf_tokens_per_s (the transformers sampler's rate).

The model is built locally: `tiny` (0.53 M parameters, warmed up for a few hundred supervised
steps first, so rewards are not all zero) or `small` (a 8-layer, 1024-wide Qwen3 with the tiny
character tokenizer, random weights, saved to a temporary folder). Each variant records: its
status (ok / failed / skipped and why, timed_out), wall time, per-step times (time/rollout_s,
time/train_s), peak memory (torch.cuda.max_memory_allocated / max_memory_reserved), the GPU's
used memory per phase, largest over the steps (memory/rollout_used_gb with the sampler awake,
memory/train_used_gb with it asleep: from the driver, so vLLM's pools, which torch's counters
miss, are in them), the sampler / trainer log-prob gap (rollout/logp_diff_max from
<output_dir>/metrics.jsonl; none for the transformers sampler, which is the trainer itself), the
mean reward, and the memory planner's estimate for the same config (generation_phase_gb and
training_phase_gb against those two, to calibrate ebpo_lite/model/plan.py's constants). The report is
rewritten after each variant (`"complete": false` until the last), so a run cut short keeps what
finished.

Writes benchmarks/results/gpu_smoke_<gpu>.json. Exit status: 0 all that ran passed, 1 a variant
failed (or a wheel failed to install), 2 no CUDA device (this script refuses to run on CPU, and
never writes a result there).

`--cpu-rehearsal` (for tests/test_gpu_smoke.py, not a GPU result): the same variants, children
and result, on the CPU in float32, written as `cpu_rehearsal.json`, so that the orchestration
is proven before the first GPU session spends its minutes on it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, Path(__file__).resolve().parent):  # a checkout: ebpo_lite, the stages beside
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
import gpu_smoke_stages as stages  # noqa: E402 (needs the path above; imports no torch)

# Nothing here imports torch or ebpo_lite at module level: they are imported in the children.
OFFLINE_ENV = {  # no internet on the GPU machine: fail fast instead of waiting on the network
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
RECIPE = REPO / "recipes" / "tiny_cpu.yaml"
VARIANTS = ("nf4_grads", "hf_16bit", "hf_nf4", "vllm_16bit", "vllm_nf4", "unsloth")
ALL = VARIANTS + stages.STAGES  # the stages for the real recipes' shapes: gpu_smoke_stages.py
BUDGET_S = 450  # the whole run, wheels included: under 8 minutes with room to write the result
MIN_VARIANT_S = 45  # less time left than this: the remaining variants are skipped
OUT_OF_TIME = "skipped: out of time"


def missing_requirements(variant: str) -> str | None:
    """Why a variant cannot run here (the missing package), or None."""
    needs = {
        "nf4_grads": ["bitsandbytes"],
        "hf_nf4": ["bitsandbytes"],
        "vllm_16bit": ["vllm"],
        "vllm_nf4": ["vllm", "bitsandbytes"],
        "unsloth": ["unsloth"],
        **stages.NEEDS,
    }.get(variant, [])
    for pkg in needs:
        if importlib.util.find_spec(pkg) is None:
            return f"{pkg} is not installed"
    return None


# ----------------------------------------------------------------------------- offline wheels


def wheel_distribution(path: Path) -> str:
    """The normalised distribution name of a wheel file (`{name}-{version}-...-{platform}.whl`)."""
    return re.sub(r"[-_.]+", "-", path.name.split("-")[0]).lower()


def installed(dist: str, target: Path | None = None) -> bool:
    """Whether distribution `dist` is installed in this environment (or in `target`)."""
    from importlib import metadata

    paths = [str(target), *sys.path] if target else None
    return any(
        re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() == dist
        for d in metadata.distributions(**({"path": paths} if paths else {}))
    )


def install_wheels(folder: Path, target: Path | None = None) -> dict:
    """Install every wheel in `folder` whose distribution is missing, offline, without deps.

    Into the running environment, or into `target` (then put on sys.path, and on PYTHONPATH for
    the child processes). Returns {"installed": [...], "already": [...], "failed": str | None}.
    """
    if not folder.is_dir():
        raise SystemExit(f"gpu_smoke: --wheels: {folder} is not a folder")
    wheels = sorted(folder.glob("*.whl"))
    names = sorted({wheel_distribution(w) for w in wheels})
    missing = [n for n in names if not installed(n, target)]
    out = {"folder": str(folder), "installed": [], "already": sorted(set(names) - set(missing))}
    out["failed"] = None
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
        cmd += ["--find-links", str(folder), "--disable-pip-version-check", "--quiet"]
        cmd += ["--target", str(target)] if target else []
        proc = subprocess.run([*cmd, *missing], capture_output=True, text=True)
        if proc.returncode == 0:
            out["installed"] = missing
        else:
            out["failed"] = (proc.stdout + proc.stderr).strip()[-2000:] or (
                f"pip exited {proc.returncode} with no output"
            )
    if target:
        target.mkdir(parents=True, exist_ok=True)
        if str(target) not in sys.path:
            sys.path.insert(0, str(target))
        paths = [str(target), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    importlib.invalidate_caches()
    print(
        f"gpu_smoke: wheels from {folder}: installed {', '.join(out['installed']) or 'none'}; "
        f"already present {', '.join(out['already']) or 'none'}"
        + (f"; pip failed: {out['failed'].splitlines()[-1]}" if out["failed"] else ""),
        flush=True,
    )
    return out


# ----------------------------------------------------------------------------- variants


def run_within_budget(
    variants, budget_s: float, started: float, run_one, clock=time.monotonic, *, done=None
):
    """Run each variant with `run_one(variant, timeout_s)` (its entry dict) while time is left;
    `done(entries so far)` after each.

    A variant gets at most the time left of `budget_s` (counted from `started` on `clock`);
    with less than MIN_VARIANT_S (a stage: its stages.MIN_S) left it is recorded as OUT_OF_TIME
    without running.
    """
    entries = []
    for v in variants:
        left = budget_s - (clock() - started)
        if left < max(MIN_VARIANT_S, stages.MIN_S.get(v, 0)):
            entries.append(
                {"variant": v, "status": OUT_OF_TIME, "reason": f"{max(left, 0):.0f} s left"}
            )
            print(f"gpu_smoke: {v}: {OUT_OF_TIME} ({max(left, 0):.0f} s left)", flush=True)
        else:
            entries.append(run_one(v, left))
        if done is not None:
            done(entries)
    return entries


def variant_overrides(
    variant: str, out_dir: Path, steps: int, dtype: str, model: str, device: str = "cuda"
) -> list[str]:
    """The `section.key=value` overrides that turn the tiny CPU recipe into this GPU variant."""
    ov = {
        "output_dir": str(out_dir),
        "model.device": device,
        "model.dtype": dtype,
        "model.name": model,
        "model.trainable_extra": "[]",  # the flagship path: LoRA only, adapter-only sync
        "model.sft_warmup_steps": 300,
        "data.num_eval": 16,
        "eval.num_examples": 16,
        "eval.every": 0,
        "train.steps": steps,
        "train.checkpoint_every": 0,
        "train.threads": 0,
        "train.micro_batch_size": 64,
        "log.progress": "lines",
        "rollout.backend": variant.split("_")[0],
        "model.load_in_4bit": str(variant.endswith("nf4")).lower(),
    }
    if ov["rollout.backend"] in ("vllm", "unsloth"):
        ov["rollout.gpu_memory_utilization"] = 0.3
    return [f"{k}={v}" for k, v in ov.items()]


def read_metrics(path: Path) -> dict:
    """Per-step times, the largest sampler/trainer log-prob gap, rewards and the GPU's memory per
    phase (each `memory/*` key's largest value over the steps) from metrics.jsonl. Non-finite
    numbers are left out: the result stays strict JSON."""
    steps, gaps, rewards, memory = [], [], [], {}

    def number(rec: dict, key: str) -> float | None:
        v = rec.get(key)
        return v if isinstance(v, (int, float)) and math.isfinite(v) else None

    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "time/rollout_s" in rec:
                steps.append(
                    {
                        "step": rec.get("step"),
                        "rollout_s": rec["time/rollout_s"],
                        "train_s": rec.get("time/train_s"),
                    }
                )
            for key in rec:
                if key.startswith("memory/") and number(rec, key) is not None:
                    name = key.removeprefix("memory/")
                    memory[name] = max(memory.get(name, 0.0), rec[key])
            if number(rec, "rollout/logp_diff_max") is not None:
                gaps.append(rec["rollout/logp_diff_max"])
            if number(rec, "train/reward_mean") is not None:
                rewards.append(rec["train/reward_mean"])
    return {
        "step_times": steps,
        "logp_diff_max": max(gaps) if gaps else None,
        "logp_diff_max_last": gaps[-1] if gaps else None,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "memory_per_step_max": memory or None,
    }


def build_small_model(folder: Path) -> str:
    """A larger Qwen3 (8 x 1024, head size 64) with the tiny tokenizer, random weights, saved
    (by a child process: building it imports torch)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "small_model"]
    proc = subprocess.run([*cmd, "--child-result", str(folder)], capture_output=True, text=True,
                          env=child_env(), cwd=REPO)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"gpu_smoke: --model small: building it failed: {_tail(proc)}")
    return str(folder)


def machine_facts(device: str, versions: bool = True) -> dict:
    """`gpu_facts`, read by a child process (this one never imports torch)."""
    with tempfile.TemporaryDirectory(prefix="ebpo_gpu_facts_") as tmp:
        out = Path(tmp) / "facts.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "facts"]
        cmd += ["--child-result", str(out), *(["--cpu-rehearsal"] if device == "cpu" else [])]
        cmd += [] if versions else ["--", "no-versions"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO)
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"gpu_smoke: reading the machine's facts failed: {_tail(proc)}")
        return json.loads(out.read_text())


def _tail(proc) -> str:
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}, no output"


def memory_stats(device: str) -> dict:
    """Peak torch allocations and the device's used memory (CUDA); nothing on the CPU."""
    import torch

    if device != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
        "device_used_at_end_gb": (total - free) / 2**30,
        "total_gb": total / 2**30,
    }


def run_child(variant: str, argv: list[str], result_path: Path, device: str = "cuda") -> int:
    """In the child: run the variant, then write what ran and what it cost as strict JSON."""
    import torch

    from ebpo_lite.commands.qlora_check import json_ready

    if variant == "facts":
        facts = gpu_facts(device, with_versions=argv != ["no-versions"])
        result_path.write_text(json.dumps(json_ready(facts), allow_nan=False))
        return 0
    if variant == "small_model":
        from ebpo_lite.commands.qlora_check import LARGE_SHAPE
        from ebpo_lite.model.tiny import save_random_qwen3

        save_random_qwen3(result_path, **{**LARGE_SHAPE, "num_hidden_layers": 8})
        return 0
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
    if variant == "nf4_grads":
        return run_check_child(argv, result_path, device)
    if variant in stages.STAGES:
        return stages.run_stage(variant, argv, result_path, device)
    from ebpo_lite import config, train
    from ebpo_lite.model import plan

    t0 = time.perf_counter()
    rc = train.main(argv)
    wall = time.perf_counter() - t0
    cfg = config.load(argv[0], argv[1:])
    mem = memory_stats(device)
    res = {
        "variant": variant,
        "rc": rc,
        "wall_s": wall,
        "argv": argv,
        **mem,
        **read_metrics(Path(cfg.output_dir) / "metrics.jsonl"),
    }
    try:
        gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU rehearsal)"
        p = plan.plan(cfg, mem.get("total_gb", 80.0), gpu)
        res["planned"] = {
            k: p[k]
            for k in (
                "trainer_static_gb",
                "activations_gb",
                "logits_gb",
                "training_phase_gb",
                "generation_phase_gb",
                "vllm_need_gb",
                "total_gb",
            )
        }
    except Exception as e:  # the plan is a by-product here, never a failure
        res["planned"] = f"no plan: {e}"
    result_path.write_text(json.dumps(json_ready(res), indent=2, allow_nan=False))
    return rc


def run_check_child(argv: list[str], result_path: Path, device: str) -> int:
    """nf4_grads in the child: `ebpo_lite.commands.qlora_check` on CHECK_SHAPE for the dtypes in argv."""
    import torch

    from ebpo_lite.cli import quiet_libraries
    from ebpo_lite.commands import qlora_check
    from ebpo_lite.commands.qlora_check import LARGE_LAYERS as CHECK_LAYERS
    from ebpo_lite.commands.qlora_check import LARGE_SHAPE as CHECK_SHAPE
    from ebpo_lite.commands.qlora_check import json_ready
    from ebpo_lite.model.tiny import save_random_qwen3

    quiet_libraries()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (torch's default too)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ebpo_nf4_check_") as tmp:
        model = save_random_qwen3(Path(tmp) / "model", **CHECK_SHAPE)
        res = qlora_check.check(device, argv, model, CHECK_LAYERS)
    for line in qlora_check.summary_lines(res):
        print(f"nf4_grads: {line}", flush=True)
    res = json_ready(res)
    res.update(variant="nf4_grads", rc=0 if res["ok"] else 1, argv=argv, shape=CHECK_SHAPE)
    res["model"] = "random Qwen3 of `shape` with the tiny tokenizer (ebpo_lite.model.tiny)"
    res.update(wall_s=time.perf_counter() - t0, **memory_stats(device))
    result_path.write_text(json.dumps(res, indent=2, allow_nan=False))
    return res["rc"]


def gpu_facts(device: str = "cuda", with_versions: bool = True) -> dict:
    """In the `facts` child: versions (each package imported, so a broken one says so; not
    with `with_versions=False`), and on CUDA the GPU, its capability and memory and whether it
    computes bf16 natively (`no_cuda` when torch sees no CUDA device)."""
    import torch

    versions = {}
    packages = ("torch", "transformers", "peft", "bitsandbytes", "vllm", "unsloth")
    for pkg in packages if with_versions else ():
        try:
            versions[pkg] = __import__(pkg).__version__ if importlib.util.find_spec(pkg) else None
        except Exception as e:  # an installed but broken package: say so
            versions[pkg] = f"import failed: {type(e).__name__}"
    if device != "cuda":
        return {
            "gpu": None,
            "rehearsal": "cpu",
            "python": platform.python_version(),
            "versions": versions,
        }
    if not torch.cuda.is_available():
        return {"no_cuda": True, "torch": torch.__version__, "cuda_build": torch.version.cuda}
    from ebpo_lite.model.device import native_bf16

    props = torch.cuda.get_device_properties(0)
    cap = torch.cuda.get_device_capability(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "capability": f"{cap[0]}.{cap[1]}",
        "memory_gb": props.total_memory / 2**30,
        "cuda": torch.version.cuda,
        "bf16": native_bf16(torch.device("cuda", 0)),
        "python": platform.python_version(),
        "versions": versions,
    }


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    ap.add_argument("--wheels", help="folder of wheels to install offline when missing")
    ap.add_argument("--wheels-target", help="install them here (on sys.path) instead of the env")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per variant at most")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="run the variants on the CPU (float32) into cpu_rehearsal.json: tests only",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-result", help=argparse.SUPPRESS)
    ap.add_argument("child_argv", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = sorted(set(filter(None, args.only.split(","))) - set(ALL))
    if unknown:
        print(f"gpu_smoke: --only: no variant {', '.join(unknown)} (have {', '.join(ALL)})",
              file=sys.stderr)  # fmt: skip
        return 2

    device = "cpu" if args.cpu_rehearsal else "cuda"
    for key, value in OFFLINE_ENV.items():  # the children too: importing bitsandbytes asks the
        os.environ.setdefault(key, value)  # hub for kernels unless told it is offline
    if args.child:
        return run_child(args.child, args.child_argv, Path(args.child_result), device)
    facts = machine_facts(device, versions=not args.wheels)  # in a child: never CUDA here
    if facts.get("no_cuda"):
        print(
            f"gpu_smoke: no CUDA device visible (torch {facts['torch']}, CUDA build "
            f"{facts['cuda_build'] or 'none'}); this script only runs on a GPU machine",
            file=sys.stderr,
        )
        return 2
    wheels = None
    if args.wheels:
        target = Path(args.wheels_target).resolve() if args.wheels_target else None
        wheels = install_wheels(Path(args.wheels).resolve(), target)
        facts = machine_facts(device)  # with the versions of what is now installed
    # the CPU rehearsal proves the plumbing, not 16-bit numerics
    dtype = "float32" if device == "cpu" else ("bfloat16" if facts.pop("bf16") else "float16")
    chosen = [v for v in ALL if not args.only or v in args.only.split(",")]
    report = {
        **facts,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "dtype": dtype,
        "model": args.model,
        "steps": args.steps,
        "budget_s": args.budget,
        "wheels": wheels,
        "variants": [],
    }
    name = re.sub(r"[^A-Za-z0-9]+", "_", facts["gpu"] or "").strip("_")
    out = Path(args.out) / (f"gpu_smoke_{name}.json" if device == "cuda" else "cpu_rehearsal.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(entries: list[dict], complete: bool = False) -> None:
        """The report so far; rewritten after each variant, so a run cut short keeps its results."""
        report.update(variants=entries, complete=complete, wall_s=time.monotonic() - started)
        report["not_run"] = {e["variant"]: e.get("reason") for e in entries if "reason" in e}
        # strict JSON: the children's results are (json_ready), and this process adds times only
        out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")

    with tempfile.TemporaryDirectory(prefix="ebpo_gpu_smoke_") as tmp:
        model = build_small_model(Path(tmp) / "small") if args.model == "small" else "tiny"

        def run_one(v: str, left: float) -> dict:
            reason = stages.skip_reason(v, device, missing_requirements(v))
            if reason:
                print(f"gpu_smoke: {v}: skipped ({reason})", flush=True)
                return {"variant": v, "status": "skipped", "reason": reason}
            timeout = min(args.timeout, left)
            entry = run_variant(v, Path(tmp), args, dtype, model, timeout, device)
            print(f"gpu_smoke: {v}: {entry['status']} {summary(entry)}", flush=True)
            return entry

        entries = run_within_budget(chosen, args.budget, started, run_one, done=save)
    save(entries, complete=True)
    print(f"gpu_smoke: wrote {out} ({report['wall_s']:.0f} s)")
    failed = any(e["status"] == "failed" for e in report["variants"])
    return 1 if failed or (wheels and wheels["failed"]) else 0


def run_variant(
    v: str, tmp: Path, args, dtype: str, model: str, timeout: float, device: str = "cuda"
) -> dict:
    """Run one variant in a child process; its JSON result, or the failure and its output."""
    out_dir, result = tmp / v, tmp / f"{v}.json"
    if v == "nf4_grads":
        child_argv = list(dict.fromkeys(["float32", dtype]))  # the dtypes to check
    elif v in stages.STAGES:
        child_argv = stages.child_argv(v, out_dir, args.steps, dtype, device, variant_overrides)
    else:
        child_argv = [str(RECIPE), *variant_overrides(v, out_dir, args.steps, dtype, model, device)]
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        v,
        "--child-result",
        str(result),
        *(["--cpu-rehearsal"] if device == "cpu" else []),
        "--",
        *child_argv,
    ]
    env = child_env()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
        )
        rc, log, timed_out = proc.returncode, proc.stdout + proc.stderr, False
    except subprocess.TimeoutExpired as e:
        rc, log = -1, f"timed out after {timeout:.0f}s\n{_text(e.stdout)}{_text(e.stderr)}"
        timed_out = True
    entry = json.loads(result.read_text()) if result.is_file() else {"variant": v}
    entry["timed_out"] = timed_out
    entry["status"] = "ok" if rc == 0 and entry.get("rc") == 0 else "failed"
    entry["process_wall_s"] = time.perf_counter() - t0
    if entry["status"] == "failed":
        entry["returncode"] = rc
        entry["log_tail"] = log[-4000:] if isinstance(log, str) else str(log)[-4000:]
    return entry


def child_env() -> dict[str, str]:
    """A variant's environment: offline settings (unless already set), this checkout first on
    PYTHONPATH (then any --wheels-target), unbuffered output."""
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**OFFLINE_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return env


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def summary(e: dict) -> str:
    if e["variant"] in stages.STAGES or e["status"] != "ok":
        return stages.summary(e)  # a failure's line too
    peak = e.get("peak_allocated_gb")
    text = f"{e['wall_s']:.1f}s" + (f", peak {peak:.2f} GiB allocated" if peak is not None else "")
    if e["variant"] == "nf4_grads":
        worst = {d: v["policy"]["worst"] for d, v in e["dtypes"].items()}
        return text + ", LoRA gradient error " + ", ".join(f"{d} {w:.1e}" for d, w in worst.items())
    gap = e.get("logp_diff_max")
    return text + f", logp gap {gap if gap is None else round(gap, 4)}"


if __name__ == "__main__":
    sys.exit(main())
