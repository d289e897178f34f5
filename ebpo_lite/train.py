"""`python -m ebpo_lite.train RECIPE.yaml [section.key=value ...]`: the whole RL loop.

One step: sample prompts from the curriculum -> G completions each through the sampler ->
rewards -> advantages (grpo / dr_grpo / rloo / ebpo) -> clipped-surrogate loss over micro-batches
-> optimizer step -> push the adapter to the sampler -> metrics, sample completions and warnings
(samples.py) -> maybe eval -> maybe checkpoint.

Simplifications, stated: one process, one policy; generation and training alternate (never
overlap); the reference policy for the KL term is the adapter-disabled base; a group's completions
share the prompt's advantage on every token (no token-level credit).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ebpo_lite import cli, config, rewards
from ebpo_lite.algo.advantages import frac_zero_std_groups
from ebpo_lite.data.jsonl import write_atomic
from ebpo_lite.engine import checkpoint, faults, samples
from ebpo_lite.engine.episodes import episode_metrics
from ebpo_lite.engine.metrics import Metrics, read_metrics
from ebpo_lite.engine.run import Run, build_run
from ebpo_lite.model.device import StepMemory
from ebpo_lite.train_eval import evaluate_policy


def train_step(run: Run, step: int, watch: samples.Watch | None = None) -> dict[str, Any]:
    """One RL step, top to bottom. Returns the step's metrics; `watch` shows what the model
    wrote (samples.py)."""
    policy = run.policy
    # 1. sample prompts and G completions each (prompt-major rows: i * G + g); the curriculum
    #    sees every drawn group, dynamic sampling keeps the informative ones
    t0 = time.perf_counter()
    gpu = StepMemory(policy.device)  # GPU memory per phase: nothing on CPU
    run.backend.wake()  # the sampler's memory back, once for all draws
    sample = run.sample_and_score(step)
    rollout, rewards, mask = sample.rollout, sample.rewards, sample.mask  # rewards/mask [B, G]
    gpu.mark("rollout")  # sampler awake
    run.backend.sleep()  # and freed for training
    t_rollout = time.perf_counter() - t0
    # 2. the EB prior observes every drawn group, then advantages for the kept ones. From here a
    #    NaN / inf skips the step: what it changed is undone, nothing reaches the sampler
    faults.check_rewards(sample.drawn_rewards, sample.drawn_mask)
    undo = faults.Undo(run)
    try:
        run.observe(sample)
        adv, adv_stats = run.advantages(rewards, mask, sample.idx)  # [B, G]
        faults.check_advantages(adv, mask)
        # 3. loss and gradients over micro-batches, num_iterations passes over the rollout
        t1 = time.perf_counter()
        prompts = rollout.row_prompts()  # row i * G + g: its prompt
        loss_stats = faults.retry_scaled(  # float16: an overflow redoes this, at half the scale
            lambda: run.optimize(prompts, rollout, adv.reshape(-1), mask.reshape(-1)),
            undo,
            run.scaler,
        )
        t_train = time.perf_counter() - t1
        gpu.mark("train")  # sampler asleep
    except faults.NonFinite:
        undo.restore()
        raise
    # 4. the sampler gets the new adapter (and base tensors, if any are trained)
    run.backend.sync(policy, version=step)
    t_sync = time.perf_counter() - t1 - t_train
    # 5. metrics
    #    (rewards over every drawn group: the kept ones are selected for mixed rewards)
    lengths = torch.tensor(  # tokens the model wrote (tool results are the environment's)
        [rollout.loss_tokens(i) for i in range(len(rollout.completion_ids))], dtype=torch.float
    )
    drawn, drawn_mask = sample.drawn_rewards, sample.drawn_mask  # [B_drawn, G]
    valid = drawn[drawn_mask]
    if watch is not None:  # what the model wrote: printed, written, warned about (samples.py)
        watch.observe(step, run, sample, adv)
    return {
        "train/reward_mean": valid.mean().item() if valid.numel() else float("nan"),
        "train/reward_std": valid.std().item() if valid.numel() > 1 else 0.0,
        "train/response_len": lengths.mean().item(),
        "train/truncated_frac": 1.0 - sum(rollout.finished) / max(len(rollout.finished), 1),
        "train/frac_zero_std_groups": frac_zero_std_groups(drawn, drawn_mask),
        "train/unscored_frac": 1.0 - drawn_mask.float().mean().item(),
        "train/extra_draws": sample.extra_draws,
        "train/groups_drawn": len(sample.drawn_idx),
        "train/groups_kept": len(sample.idx),
        **sample.reward_errors,
        **episode_metrics(rollout.episodes or []),  # tool use: turns, calls, errors, seconds
        **loss_stats,
        **{f"adv/{k}": v for k, v in adv_stats.items()},
        "time/rollout_s": t_rollout,
        "time/train_s": t_train,
        "time/sync_s": t_sync,
        **gpu.metrics(),
    }


def train(cfg: config.Config, env_objects: tuple | None = None) -> dict[str, Any]:
    """Run (or resume) training; returns the summary that is also printed. `env_objects`: the
    Python API's environment class and tool functions (`build_run`)."""
    run = build_run(cfg, env_objects=env_objects)
    out = Path(cfg.output_dir)
    start, resumed = run.maybe_resume()
    skips = faults.Skips(cfg.train.max_consecutive_skips)
    skips.load_state_dict(resumed.get("skips", {}))
    metrics = Metrics(
        out,
        cfg.train.steps,
        start,
        cfg.log.progress,
        cfg.log.tensorboard,
        cfg.log.wandb,
        cfg.log.wandb_project,
        config.to_dict(cfg),
    )
    watch = samples.Watch(cfg, start, samples.printer(metrics))
    stop = _StopFlag()
    t_start = time.perf_counter()
    first_eval = last_eval = None
    eval_s = 0.0  # all evals of this invocation
    last_eval_step = 0
    if start == 0:
        first_eval = evaluate_policy(run)
        eval_s += first_eval.get("time/eval_s", 0.0)
        metrics.log(0, first_eval)
        if first_eval:
            print(f"eval before step 1: {eval_words(first_eval)}", flush=True)
    else:  # a resume: the run's own first eval, so the summary keeps its before -> after
        first_eval = recorded_eval(metrics.path, 0)
    if start >= cfg.train.steps:
        last_eval, last_eval_step = recorded_eval(metrics.path, start), start
        print(
            f"training: nothing to do, {out} has done all {start} steps; raise train.steps "
            "to train further",
            flush=True,
        )
    else:
        print(f"training: steps {start + 1}-{cfg.train.steps} into {out}", flush=True)
    step, steps_here = start, 0
    try:
        while step < cfg.train.steps:
            step += 1
            try:
                record = train_step(run, step, watch)
                skips.good()
                record["train/skipped_steps"] = skips.total
            except StopIteration:  # a one-pass curriculum ran out of prompts
                print(f"curriculum exhausted after step {step - 1}", flush=True)
                step -= 1
                break
            except faults.NonFinite as fault:  # nothing of the step was applied
                record = skips.skip(step, fault.reason)
            metrics.log(step, record)
            skips.maybe_stop(step)  # too many in a row: TrainingFault, no checkpoint
            steps_here += 1
            final = step == cfg.train.steps
            if (cfg.eval.every and step % cfg.eval.every == 0) or final:
                last_eval, last_eval_step = evaluate_policy(run), step
                eval_s += last_eval.get("time/eval_s", 0.0)
                metrics.log(step, last_eval)
            metrics.progress(step, record)  # after this step's eval: the line shows it
            interrupted = stop.raised or (
                cfg.train.stop_after and steps_here >= cfg.train.stop_after
            )
            if (
                final
                or interrupted
                or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0)
            ):
                run.save(step, extra={"skips": skips.state_dict()})
            if interrupted:
                why = (
                    f"signal {stop.raised}"
                    if stop.raised
                    else f"train.stop_after={cfg.train.stop_after}"
                )
                print(
                    f"stopped cleanly after step {step} ({why}); resume with train.resume=true",
                    flush=True,
                )
                break
    finally:
        stop.restore()
        metrics.close()
        run.backend.close()
        rewards.close_contained(run.reward_fns)
        if run.tools is not None:
            run.tools.close()
    seconds = time.perf_counter() - t_start
    done = (start, step)
    return _summary(cfg, run, first_eval, last_eval, done, seconds, eval_s, last_eval_step)


def recorded_eval(path: Path, step: int) -> dict[str, Any] | None:
    """The eval record that `metrics.jsonl` holds for `step` (a resumed run's first eval), or
    None when it has none."""
    if not path.exists():
        return None
    for rec in read_metrics(path):
        if rec.get("step") == step and any(k.startswith("eval/") for k in rec):
            return {k: v for k, v in rec.items() if k.startswith(("eval/", "time/eval"))}
    return None


def eval_words(ev: dict[str, Any]) -> str:
    """An eval's headline numbers in one line."""
    keys = ("eval/accuracy", "eval/expected_accuracy", "eval/mean/pass@1")
    shown = [f"{k.split('/', 1)[1]} {ev[k]:.3f}" for k in keys if isinstance(ev.get(k), float)]
    shown += [
        f"{k.split('/')[1]} pass@1 {v:.3f}"
        for k, v in ev.items()
        if k.endswith("/pass@1") and k != "eval/mean/pass@1"
    ]
    return ", ".join(shown) or "no eval metrics"


def _summary(cfg, run, first_eval, last_eval, done, seconds, eval_s, eval_step) -> dict[str, Any]:
    """The run's summary: printed, and written to `summary.json`. `done` is (the step this
    invocation started after, the last step done). "before" is the run's first eval (a resumed
    run's too); "after" the last eval of this invocation: the final one, unless the run stopped
    early (then its step is named)."""
    start, step = done
    summary: dict[str, Any] = {
        "steps_done": step,
        "steps_this_time": step - start,
        "seconds": round(seconds, 1),
        "eval_seconds": round(eval_s, 1),
        "output_dir": str(cfg.output_dir),
        "after_step": eval_step if last_eval else None,
    }
    for name, ev in (("before", first_eval), ("after", last_eval)):
        if ev:
            summary.update({f"{name}/{k.split('/', 1)[1]}": v for k, v in ev.items()})
    ckpt = checkpoint.latest(cfg.output_dir)
    summary["checkpoint"] = str(ckpt) if ckpt else None
    took = f"in {seconds:.0f}s (eval {eval_s:.0f}s)"
    lines = [f"done: {step} steps {took}"]
    if start:  # a resume: say what this invocation did
        lines = [f"done: steps {start + 1}-{step} ({step - start} of {step}) {took}"]
        if step == start:
            lines = [f"done: no step left to run ({step} of {step} done before)"]
    if last_eval and eval_step != step:
        lines.append(f"(the last eval ran after step {eval_step}; the run stopped at step {step})")
    lines += learned_lines(first_eval, last_eval)
    lines.append(
        f"run: {cfg.output_dir} (metrics.jsonl, checkpoints/{Path(summary['checkpoint']).name if ckpt else ''})"
    )
    print("\n".join(lines), flush=True)
    write_atomic(Path(cfg.output_dir) / "summary.json", json.dumps(summary, indent=2))
    return summary


def learned_lines(before: dict | None, after: dict | None) -> list[str]:
    """What the run learned, in words: before -> after on the eval metrics, then per type."""
    before, after = before or {}, after or {}
    lines = []
    for key, label in (
        ("eval/accuracy", "greedy"),
        ("eval/expected_accuracy", "exact"),
        ("eval/reward", "all reward functions"),
    ):
        if key not in after:
            continue
        if key in before:
            delta = after[key] - before[key]
            lines.append(f"{key} ({label}): {before[key]:.3f} -> {after[key]:.3f} ({delta:+.3f})")
        else:
            lines.append(f"{key} ({label}): {after[key]:.3f}")
    for kind in ("topic", "difficulty"):
        prefix = f"eval/accuracy/{kind}="
        parts = [
            f"{k[len(prefix) :]} {before[k]:.2f} -> {v:.2f}"
            if k in before
            else f"{k[len(prefix) :]} {v:.2f}"
            for k, v in sorted(after.items())
            if k.startswith(prefix)
        ]
        if parts:
            lines.append(f"  by {kind} (greedy): " + " | ".join(parts))
    return lines


class _StopFlag:
    """First SIGINT / SIGTERM: finish the step, checkpoint, exit 0. Second: stop at once."""

    def __init__(self):
        self.raised: str | None = None
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a notebook worker)
                pass

    def _handle(self, signum, frame):
        if self.raised:
            self.restore()
            raise KeyboardInterrupt
        self.raised = signal.Signals(signum).name
        print(
            f"\n{self.raised}: finishing this step and writing a checkpoint "
            "(send again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        from ebpo_lite.commands.confighelp import train_help

        print(train_help())  # every config key with its type, default and note
        return 0
    if not argv:
        from ebpo_lite.commands.confighelp import USAGE

        print(f"{USAGE}\n--help lists every config key.", file=sys.stderr)
        return 2
    return cli.run(lambda: train(config.load(argv[0], argv[1:])))


if __name__ == "__main__":
    sys.exit(main())
