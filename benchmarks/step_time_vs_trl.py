"""One ebpo_lite step against one TRL `GRPOTrainer` step, same model and work, on CPU.

    .venv-integrations/bin/python benchmarks/step_time_vs_trl.py [--steps 10 --warmup 2]

(the integrations environment of .ci/tier_integrations.sh: TRL 1.16 next to ebpo_lite.)
Both sides: the warmed tiny model of recipes/tiny_cpu.yaml, LoRA r 16 / alpha 32 / no dropout on
every linear layer and nothing else trained (the recipe's trained norms are off, TRL has no
such option), the recipe's arithmetic prompts, 32 prompts x G = 8 = 256 completions per step of
at most 8 new tokens at temperature 1, AdamW at lr 1e-3, one optimisation pass per batch, no KL,
token-mean loss (TRL's loss_type "dapo"), transformers `generate` as the sampler (TRL
use_vllm=False, ebpo_lite rollout.backend=hf), no gradient checkpointing (TRL's default is on),
2 threads, float32.

ebpo_lite runs three times: `ours` with its best CPU settings for a small model, the lean decode
loop (`rollout.hf_loop=lean`), SDPA attention (`model.attn_implementation=sdpa`, as TRL's model
loads by default) and shared prompt forwards (`train.share_prompts`, the default: each of the 32
prompts runs forward once for its 8 completions); `ours_full_batch`, the same without sharing
(every row's prompt forwarded); and `ours_generate` with its defaults: transformers `generate`,
as TRL, and eager attention (what `auto` picks on CPU).
Alternation in one process: TRL's own training loop runs; a callback times each TRL step
(on_step_begin -> on_step_end: generation, rewards, loss, backward, optimizer) and then runs one
ebpo_lite `train_step` of each (sampling, rewards, advantages, loss, optimizer, sampler sync),
timed on its own. So both see the same machine state, step for step. Medians over `--steps`
steps of each after `--warmup`, in each of `--repeats` whole runs (the spread between runs,
about +-10% on 2 cores, is larger than between steps); the reported ratio is the median of the
runs' ratios. Peak RSS: each side again in its own fresh process (`--only ours|trl`), VmHWM.
Writes benchmarks/results/step_time_vs_trl.json (ours_s, trl_s, ratio = ours / TRL, the same
for ours_generate and ours_full_batch, ebpo_lite's sampling and update seconds from its own `time/*` metrics,
per-step times, peak RSS, versions, command, machine).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _machine import command, machine

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "step_time_vs_trl.json"
PROMPTS, G, NEW_TOKENS, LR, THREADS = 32, 8, 8, 1e-3, 2
OURS = ("ours", "ours_generate", "ours_full_batch")  # ebpo_lite's sides, one step each per TRL's


def ours_config(out: Path, steps: int, loop: str = "lean", share: bool = True):
    from ebpo_lite import config

    return config.load(
        ROOT / "recipes" / "tiny_cpu.yaml",
        [
            f"output_dir={out}",
            "model.trainable_extra=[]",
            "model.lora_dropout=0.0",
            "rollout.backend=hf",
            f"rollout.hf_loop={loop}",
            # best CPU settings with the lean loop; with generate, the defaults (eager on CPU)
            f"model.attn_implementation={'sdpa' if loop == 'lean' else 'auto'}",
            f"rollout.group_size={G}",
            f"rollout.max_new_tokens={NEW_TOKENS}",
            f"train.prompts_per_step={PROMPTS}",
            f"train.lr={LR}",
            f"train.steps={steps}",
            f"train.threads={THREADS}",
            "train.checkpoint_every=0",
            "eval.every=0",
            "log.progress=none",
            f"train.share_prompts={str(share).lower()}",
        ],
    )


def ours_run(out: Path, steps: int, loop: str = "lean", share: bool = True):
    from ebpo_lite.engine.run import build_run

    cfg = ours_config(out, steps, loop, share)
    return cfg, build_run(cfg)


def trl_trainer(
    cfg, out: Path, steps: int, callbacks: list, seed: int = 0, checkpointing: bool = False
):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from ebpo_lite.data import loader as data
    from ebpo_lite.model.tiny import warm_tiny_model
    from ebpo_lite.rewards.functions import arithmetic_answer

    m = cfg.model
    path = str(warm_tiny_model(m.sft_warmup_steps, m.sft_seed, cfg.data.seed))
    train_ex, _ = data.load_train_eval(cfg.data)
    ds = Dataset.from_list([{"prompt": ex.prompt, "answer": ex.answer} for ex in train_ex])
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=PROMPTS * G,
        num_generations=G,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=seed,
        gradient_checkpointing=checkpointing,  # TRL's default is True; ebpo_lite's False
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=0.0, target_modules="all-linear"
    )
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=[arithmetic_answer],
        args=args,
        train_dataset=ds,
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=lora,
        callbacks=callbacks,
    )


def alternate(n: int) -> dict:
    """TRL's loop with one ebpo_lite step after every TRL step; per-step seconds of each."""
    from transformers import TrainerCallback

    from ebpo_lite.train import train_step

    torch.set_num_threads(THREADS)
    times: dict[str, list[float]] = {k: [] for k in ("trl", *OURS)}
    phases: dict[str, list[dict]] = {k: [] for k in OURS}  # train_step's time/*
    with tempfile.TemporaryDirectory() as tmp:
        cfg, run = ours_run(Path(tmp) / "ours", n, "lean")
        _, run_generate = ours_run(Path(tmp) / "ours_generate", n, "generate")
        _, run_full = ours_run(Path(tmp) / "ours_full_batch", n, "lean", share=False)
        runs = {"ours": run, "ours_generate": run_generate, "ours_full_batch": run_full}

        class Alternate(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                times["trl"].append(time.perf_counter() - self.t0)
                for name, r in runs.items():
                    t = time.perf_counter()
                    rec = train_step(r, len(times[name]) + 1)
                    times[name].append(time.perf_counter() - t)
                    phases[name].append({k: v for k, v in rec.items() if k.startswith("time/")})

        trainer = trl_trainer(cfg, Path(tmp) / "trl", n, [Alternate()])
        trainer.train()
        for r in runs.values():
            r.backend.close()
    return times, phases


def only(side: str, n: int) -> None:
    """One side alone for `n` steps; prints its peak RSS in MiB (a fresh process each)."""
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        if side == "ours":
            from ebpo_lite.train import train_step

            _, run = ours_run(Path(tmp) / "ours", n)
            for step in range(1, n + 1):
                train_step(run, step)
        else:
            trl_trainer(ours_config(Path(tmp) / "ours", n), Path(tmp) / "trl", n, []).train()
    print(json.dumps({"peak_rss_mib": peak_rss_mib()}))


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM of its own memory map. (ru_maxrss would not do: after
    fork + exec it starts from the parent's peak.)"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="whole alternating runs")
    ap.add_argument("--only", choices=["ours", "trl"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.warmup + args.steps
    if args.only:
        only(args.only, n)
        return
    reps = [alternate(n) for _ in range(args.repeats)]  # whole runs vary more than steps do

    def median_of(name: str) -> list[float]:  # per repeat: median step seconds after warm-up
        return [statistics.median(t[name][args.warmup :]) for t, _ in reps]

    def phase(name: str, key: str) -> float:  # median seconds of one phase of ebpo_lite's step
        return statistics.median(
            p[f"time/{key}_s"] for _, ph in reps for p in ph[name][args.warmup :]
        )

    per = {name: median_of(name) for name in (*OURS, "trl")}
    ratios = [o / t for o, t in zip(per["ours"], per["trl"])]
    ratios_generate = [o / t for o, t in zip(per["ours_generate"], per["trl"])]
    ratios_full = [o / t for o, t in zip(per["ours_full_batch"], per["trl"])]
    ours, ours_generate, ours_full, trl_s = (statistics.median(per[k]) for k in per)
    rss = {}
    for side in ("ours", "trl"):
        out = subprocess.run(
            [sys.executable, __file__, "--only", side, "--steps", str(args.steps),
             "--warmup", str(args.warmup)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rss[side] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    import transformers
    import trl

    result = {
        "command": command(),
        "machine": machine(threads=THREADS),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
        "work": {"prompts": PROMPTS, "group_size": G, "max_new_tokens": NEW_TOKENS, "lr": LR},
        "warmup_steps": args.warmup,
        "ours_s": ours,
        "trl_s": trl_s,
        "ratio": statistics.median(ratios),
        "ratio_per_repeat": ratios,
        "ours_generate_s": ours_generate,
        "ratio_generate": statistics.median(ratios_generate),
        "ratio_generate_per_repeat": ratios_generate,
        "ours_full_batch_s": ours_full,
        "ratio_full_batch": statistics.median(ratios_full),
        "ratio_full_batch_per_repeat": ratios_full,
        "repeats": args.repeats,
        # where ebpo_lite's step goes: sampling (with rewards) and the update, per sampler loop
        "ours_rollout_s": phase("ours", "rollout"),
        "ours_train_s": phase("ours", "train"),
        "ours_generate_rollout_s": phase("ours_generate", "rollout"),
        "ours_generate_train_s": phase("ours_generate", "train"),
        "ours_full_batch_rollout_s": phase("ours_full_batch", "rollout"),
        "ours_full_batch_train_s": phase("ours_full_batch", "train"),
        "ours_peak_rss_mib": rss["ours"],
        "trl_peak_rss_mib": rss["trl"],
        **{f"{k}_steps_s": [t[k] for t, _ in reps] for k in (*OURS, "trl")},
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("steps_s")}, indent=2))


if __name__ == "__main__":
    main()
