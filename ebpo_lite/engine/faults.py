"""Numerical faults: a step that meets NaN / inf is skipped, and nothing it computed is applied.

Checked, in the order a step computes them: the rewards of every drawn group (before the EB prior
sees them), the advantages, then at every optimizer update the loss and the gradient norm (before
`optimizer.step()`). A fault raises `NonFinite(reason)` with reason `rewards`, `advantages`, `loss`
or `gradients`; `Undo` puts back what the step had already changed: the EB prior (its accumulators
and prompt histories) and, when a step takes several updates (`train.mini_batches` or
`algo.num_iterations` > 1), the trainable tensors and optimizer state from a host copy taken before
the first update (a device-to-host copy every such step: 12 B per trainable parameter, about
0.5 GB for Qwen3-8B's rank-16 LoRA on all linear layers, 43.6 M parameters). The LR scheduler
is not stepped and the sampler is not synced, so after a skip the trainer and the sampler hold
exactly the pre-fault weights. The curriculum has moved on (its
prompts were drawn; non-finite rewards reach it as unscorable).

With float16 compute, loss scaling (`scaler.LossScaler`) expects an occasional overflow: non-finite
gradients of a finite loss halve the scale and raise `NonFinite("scaled_gradients")`. That is the
scale's search, not a fault of the step: `retry_scaled` puts back what the attempt's updates
changed (`Undo.restore_updates`: weights and optimizer state; the EB prior keeps its observation)
and redoes the optimisation of the same rollout at the halved scale, so minutes of T4 sampling
are not thrown away and the search (2^16 down to a run's 2^11: five halvings) never counts toward
`train.max_consecutive_skips`. Only gradients that overflow at a scale of 1 or below (unscaled
float16 itself) skip the step, as every other fault does (the scale's change is kept).

`Skips` counts skipped steps (`train/skipped_steps`, in checkpoints) and stops the run with a
one-line `TrainingFault` (exit status 3) naming the likely cause after
`train.max_consecutive_skips` in a row, without writing a checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ebpo_lite.errors import TrainingFault

CAUSES = {
    "rewards": "a reward function returned NaN or inf (check reward.functions; return a finite "
    "float, or None for a completion it cannot judge)",
    "advantages": "the advantages are not finite with finite rewards: the EB prior's statistics "
    "broke (report it, with algo.* and the run's metrics.jsonl)",
    "loss": "the loss overflowed: lower train.lr or algo.is_cap, or use model.dtype=bfloat16 / "
    "float32 instead of float16",
    "gradients": "the gradients overflowed: lower train.lr or train.max_grad_norm, or use "
    "model.dtype=bfloat16 / float32 instead of float16",
    "scaled_gradients": "the float16 gradients overflowed at every loss scale tried, down to 1 "
    "(unscaled): lower train.lr, or use model.dtype=bfloat16 / float32 on a GPU that has it",
}


class NonFinite(Exception):
    """A NaN / inf met in this step; `reason` is one of `CAUSES`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def check_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise `NonFinite("rewards")` if a scorable reward [B, G] is NaN or inf."""
    if not bool(torch.isfinite(rewards[mask]).all()):
        raise NonFinite("rewards")


def check_advantages(adv: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise `NonFinite("advantages")` if a trained row's advantage [B, G] is NaN or inf."""
    if not bool(torch.isfinite(adv[mask]).all()):
        raise NonFinite("advantages")


def check_update(loss: torch.Tensor, grad_norm: torch.Tensor, scaler=None) -> None:
    """Before `optimizer.step()`: the loss accumulated so far and this update's gradient norm
    are finite. One host sync per optimizer update. With an enabled `scaler` (float16), a finite
    loss with non-finite gradients is the loss scale's overflow: the scale is halved
    (`LossScaler.update`) and the reason is `scaled_gradients`; a clean update counts toward
    the scale's growth."""
    ok_loss, ok_grad = torch.stack([torch.isfinite(loss), torch.isfinite(grad_norm)]).tolist()
    if not ok_loss:
        raise NonFinite("loss")
    scaled = scaler is not None and scaler.enabled
    if scaled:
        scaler.update(overflow=not ok_grad)
    if not ok_grad:
        raise NonFinite("scaled_gradients" if scaled else "gradients")


class Undo:
    """What a step may change before a fault is found, copied so `restore()` puts it back."""

    def __init__(self, run: Any):
        self.run = run
        self.prior = run.prior.snapshot() if run.prior is not None else None
        cfg = run.cfg
        self.weights = None
        if cfg.train.mini_batches > 1 or cfg.algo.num_iterations > 1:  # updates before a fault
            self.weights = run.policy.trainable_state()  # host copies
            self.optim = _to_host(run.optimizer.state_dict())

    def restore(self) -> None:
        """Everything: the step is skipped."""
        self.restore_updates()
        if self.prior is not None:
            self.run.prior.restore(self.prior)

    def restore_updates(self) -> None:
        """What optimizer updates changed (trainable tensors, optimizer state, gradients), so the
        same rollout can be optimised again (`retry_scaled`). A one-update step needs only the
        gradients cleared: its update is checked before `optimizer.step()`."""
        run = self.run
        run.optimizer.zero_grad(set_to_none=True)
        if self.weights is not None:
            run.policy.load_trainable_state(self.weights)
            run.optimizer.load_state_dict(self.optim)


def retry_scaled(optimize: Callable[[], dict[str, Any]], undo: Undo, scaler) -> dict[str, Any]:
    """`optimize()` (a step's updates over one rollout), redone on the same rollout after each
    float16 overflow, which has halved the loss scale, until it passes: at most log2(scale) + 1
    tries. An overflow at a scale of 1 or below re-raises (the step is then skipped and counted),
    as does every other fault. With float16 the stats carry `train/scale_retries`."""
    retries = 0
    while True:
        try:
            stats = optimize()
        except NonFinite as fault:
            if fault.reason != "scaled_gradients" or scaler.scale < 1.0:
                raise
            undo.restore_updates()
            retries += 1
            print(
                f"redoing this step's updates on the same rollout at {scaler.scale:g}", flush=True
            )
            continue
        if scaler.enabled:
            stats["train/scale_retries"] = retries
        return stats


class Skips:
    """Skipped-step counts: the total (logged, checkpointed) and the current run of them."""

    def __init__(self, limit: int):
        self.limit, self.total, self.in_a_row, self.reason = limit, 0, 0, ""

    def good(self) -> None:
        self.in_a_row = 0

    def skip(self, step: int, reason: str) -> dict[str, Any]:
        """Count a skipped step; returns its metrics record."""
        self.total += 1
        self.in_a_row += 1
        self.reason = reason
        print(f"step {step}: skipped, non-finite {reason}", flush=True)
        return {"train/skipped_steps": self.total, "train/skip_reason": reason}

    def maybe_stop(self, step: int) -> None:
        """`TrainingFault` once `limit` steps in a row were skipped."""
        if self.in_a_row >= self.limit:
            raise TrainingFault(
                f"step {step}: {self.in_a_row} steps in a row skipped on non-finite {self.reason} "
                f"(train.max_consecutive_skips={self.limit}); likely cause: {CAUSES[self.reason]}; "
                "the checkpoints are as they were before the faults"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "in_a_row": self.in_a_row, "reason": self.reason}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total, self.in_a_row = int(state.get("total", 0)), int(state.get("in_a_row", 0))
        self.reason = str(state.get("reason", ""))


def _to_host(obj: Any) -> Any:
    """A deep copy with every tensor cloned to the host (optimizer state off the GPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)
