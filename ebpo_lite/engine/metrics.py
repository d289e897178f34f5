"""Metrics: a flat, namespaced dict per step (`train/reward_mean`, `adv/shrinkage`, ...).

`<output_dir>/metrics.jsonl` is always written, one JSON object per record with `step`.
TensorBoard and W&B are optional sinks, imported only when enabled. The progress display is a
tqdm bar on a terminal and plain lines otherwise (CI logs, notebooks' captured output).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from ebpo_lite.data.jsonl import write_atomic


class Metrics:
    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        start_step: int = 0,
        progress: str = "auto",
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "ebpo_lite",
        config: dict | None = None,
    ):
        self.path = Path(output_dir) / "metrics.jsonl"
        truncate_after(self.path, start_step)
        self.file = self.path.open("a")
        self.total = total_steps
        self.last_eval: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self.start_step = start_step
        mode = progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self.bar = None  # made at the first step, so that the lines printed before stay clean
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        self.wandb = None
        if wandb:
            import wandb as wandb_mod

            self.wandb = wandb_mod.init(
                project=wandb_project, config=config or {}, dir=str(output_dir)
            )

    def log(self, step: int, record: dict[str, Any]) -> None:
        rec = {"step": step, **{k: _plain(v) for k, v in record.items()}}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(rec, step=step)
        if any(k.startswith("eval/") for k in rec):
            self.last_eval = {k: v for k, v in rec.items() if k.startswith("eval/")}

    def progress(self, step: int, record: dict[str, Any]) -> None:
        """Update the bar (or print a line every few steps) after training step `step`."""
        fields = {
            "reward": record.get("train/reward_mean"),
            "S": record.get("adv/shrinkage"),
            "eval_acc": self.last_eval.get("eval/accuracy"),
            "eval_exp_acc": self.last_eval.get("eval/expected_accuracy"),
            "turns": record.get("env/turns"),  # tool use (docs/tools.md)
            "tool_calls": record.get("env/tool_calls"),
            "tool_errors": record.get("env/tool_errors"),
        }
        shown = {k: f"{v:.3f}" for k, v in fields.items() if isinstance(v, (int, float))}
        if self.mode == "bar" and self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=self.total, initial=self.start_step, desc="train", dynamic_ncols=True
            )
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(step - self.bar.n)
        elif self.mode == "lines":
            every = max(1, self.total // 20)
            if step % every == 0 or step == self.total:
                done = step - self.start_step
                rate = (time.perf_counter() - self.t0) / max(done, 1)
                eta = rate * (self.total - step)
                text = " ".join(f"{k}={v}" for k, v in shown.items())
                print(f"step {step}/{self.total} {text} eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def truncate_after(path: Path, step: int) -> None:
    """On resume, drop records of steps after the checkpoint so the file tells one history; a
    line cut short by a crash mid-write (not JSON) is dropped too; a fresh run (`step` 0) starts
    a new file. metrics.jsonl and completions.jsonl (samples.py) both go through it."""
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        return
    keep = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= step:
            keep.append(line)
    write_atomic(path, "".join(line + "\n" for line in keep))
