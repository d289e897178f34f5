"""Time to accuracy: from the same warm checkpoint, how long until held-out expected accuracy
reaches the start + `--gain`, for ebpo_lite and for TRL's `GRPOTrainer`, on this CPU.

    .venv-integrations/bin/python benchmarks/time_to_accuracy.py [--seeds 0,1,2 --gain 0.05]

Start: the warmed tiny model of recipes/tiny_cpu.yaml (the same weights for both). Accuracy: the
exact expected accuracy on the recipe's 256 held-out problems (`train_eval.expected_accuracies`,
no sampling noise), checked every `--check-every` steps; the clock stops while it is measured, so
each time is training time only (sampling, rewards, loss, optimizer, sampler sync).
- ebpo_lite: its best CPU settings: recipes/tiny_cpu.yaml as it ships (EBPO, LoRA r 16 plus the
  norm weights, 32 prompts x G = 8, lr 1e-3, 2 threads) with its lean decode loop
  (`rollout.hf_loop=lean`; `--loop generate` for transformers `generate`) and SDPA attention
  (`--attn`; TRL's model loads with SDPA too), train.seed.
- TRL 1.16: `GRPOTrainer` with its own defaults (loss_type "dapo", scale_rewards "group",
  beta 0, gradient checkpointing on, its sampler and shuffling) except what the task fixes or
  what TRL's defaults would make meaningless here, matched to ebpo_lite's: 32 prompts x 8
  generations per step, max_completion_length 8, LoRA r 16 / alpha 32 on all linear layers (TRL
  cannot train the norms alongside without modules_to_save), lr 1e-3 constant (TRL's 1e-6
  default is for full fine-tuning of large models: it moves this model by nothing in the
  budget), seed.
At most `--max-steps` steps each; a run that does not get there reports null.
Writes benchmarks/results/time_to_accuracy.json (per seed the seconds and steps of each, the
median ratio ours / TRL, command, machine, versions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _machine import command, machine
from step_time_vs_trl import ROOT, THREADS

RESULT = ROOT / "benchmarks" / "results" / "time_to_accuracy.json"


def recipe(out: Path, seed: int, max_steps: int, extra: list[str] = ()):
    from ebpo_lite import config

    return config.load(
        ROOT / "recipes" / "tiny_cpu.yaml",
        [
            f"output_dir={out}",
            f"train.seed={seed}",
            f"train.steps={max_steps}",
            "train.checkpoint_every=0",
            "eval.every=0",
            "log.progress=none",
            *extra,
        ],
    )


def held_out(cfg, tokenizer):
    from ebpo_lite.data import loader as data

    _, eval_ex = data.load_train_eval(cfg.data)
    eval_ex = eval_ex[: cfg.eval.num_examples]
    prompts = [data.encode_prompt(tokenizer, ex, cfg.data) for ex in eval_ex]
    return prompts, [ex.answer for ex in eval_ex]


def accuracy(policy, prompts, answers) -> float:
    from ebpo_lite.train_eval import expected_accuracies

    return statistics.mean(expected_accuracies(policy, prompts, answers))


def ours(seed: int, target: float, args) -> dict:
    from ebpo_lite.engine.run import build_run
    from ebpo_lite.train import train_step

    with tempfile.TemporaryDirectory() as tmp:
        best = [f"rollout.hf_loop={args.loop}", f"model.attn_implementation={args.attn}"]
        cfg = recipe(Path(tmp) / "ours", seed, args.max_steps, best)
        run = build_run(cfg)
        prompts, answers = held_out(cfg, run.policy.tokenizer)
        clock, acc = 0.0, accuracy(run.policy, prompts, answers)
        for step in range(1, args.max_steps + 1):
            t = time.perf_counter()
            train_step(run, step)
            clock += time.perf_counter() - t
            if step % args.check_every == 0:
                acc = accuracy(run.policy, prompts, answers)
                if acc >= target:
                    run.backend.close()
                    return {"seconds": clock, "steps": step, "accuracy": acc}
        run.backend.close()
    return {"seconds": None, "steps": None, "accuracy": acc, "seconds_spent": clock}


def trl(seed: int, target: float, args) -> dict:
    from step_time_vs_trl import trl_trainer
    from transformers import TrainerCallback

    from ebpo_lite.model.policy import Policy

    with tempfile.TemporaryDirectory() as tmp:
        cfg = recipe(Path(tmp) / "trl", seed, args.max_steps)
        state = {"clock": 0.0, "done": None, "acc": None}

        class Clock(TrainerCallback):
            def on_step_begin(self, a, s, control, **kw):
                self.t0 = time.perf_counter()

            def on_step_end(self, a, s, control, **kw):
                state["clock"] += time.perf_counter() - self.t0
                if s.global_step % args.check_every == 0:
                    state["acc"] = accuracy(policy, prompts, answers)
                    if state["acc"] >= target:
                        state["done"] = s.global_step
                        control.should_training_stop = True

        trainer = trl_trainer(
            cfg, Path(tmp) / "trl", args.max_steps, [Clock()], seed=seed, checkpointing=True
        )
        tok = trainer.processing_class
        policy = Policy(trainer.model, tok, torch.device("cpu"), "tiny", 16, [], torch.float32)
        prompts, answers = held_out(cfg, tok)
        trainer.train()
    if state["done"] is None:
        return {
            "seconds": None,
            "steps": None,
            "accuracy": state["acc"],
            "seconds_spent": state["clock"],
        }
    return {"seconds": state["clock"], "steps": state["done"], "accuracy": state["acc"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--gain", type=float, default=0.05)
    ap.add_argument("--check-every", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--loop", default="lean", help="ebpo_lite's rollout.hf_loop")
    ap.add_argument("--attn", default="sdpa", help="ebpo_lite's model.attn_implementation")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    from ebpo_lite.engine.run import build_run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = recipe(Path(tmp) / "start", 0, 1)
        run = build_run(cfg)
        start = accuracy(run.policy, *held_out(cfg, run.policy.tokenizer))
        run.backend.close()
    target = start + args.gain
    print(f"start {start:.4f}, target {target:.4f}", flush=True)
    per_seed = []
    for seed in (int(s) for s in args.seeds.split(",")):
        o, t = ours(seed, target, args), trl(seed, target, args)
        per_seed.append({"seed": seed, "ours": o, "trl": t})
        print(f"seed {seed}: ours {o}  trl {t}", flush=True)
    ratios = [
        r["ours"]["seconds"] / r["trl"]["seconds"]
        for r in per_seed
        if r["ours"]["seconds"] and r["trl"]["seconds"]
    ]
    import transformers
    import trl as trl_pkg

    result = {
        "command": command(),
        "machine": machine(threads=THREADS),
        "versions": {"trl": trl_pkg.__version__, "transformers": transformers.__version__},
        "start_expected_accuracy": start,
        "target_expected_accuracy": target,
        "check_every": args.check_every,
        "max_steps": args.max_steps,
        "ours_hf_loop": args.loop,
        "ours_attn_implementation": args.attn,
        "per_seed": per_seed,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ours_s_median": _median(per_seed, "ours"),
        "trl_s_median": _median(per_seed, "trl"),
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_seed"}, indent=2))


def _median(per_seed: list[dict], side: str) -> float | None:
    xs = [r[side]["seconds"] for r in per_seed if r[side]["seconds"] is not None]
    return statistics.median(xs) if len(xs) == len(per_seed) else None


if __name__ == "__main__":
    main()
