"""Dynamic loss scaling, so that a policy computing in float16 (T4, V100) gets its gradients.

Why: float16's smallest normal number is 2^-14 (6.1e-5), its smallest subnormal 2^-24 (6.0e-8).
With `algo.loss_agg=token_mean` each token's log-prob enters the loss with weight A / T, T the
tokens of the mini-batch (about 20,000 for 64 completions of ~320 tokens: 5e-5), and its logit
gradient is (A / T) * (onehot(y) - softmax(z)). `policy._ChunkedLogProbs` computes that in fp32
but hands it to the fp16 lm_head as fp16: every term with softmax < ~1e-3 (most of a 152k
vocabulary, a quarter of the probability mass of an LM-like distribution) rounds to 0, the rest
are subnormals with a few significant bits, and the activation gradients below are smaller
still. Nothing raises; the LoRA gradients are simply wrong (tests/test_fp16.py, V = 151,936,
T = 20,000: the worst LoRA tensor's gradient is off by 0.47 against fp32; with the loss scaled by
2^12 to 2^24, 0.0020-0.0022, float16's rounding floor; by 2^8, 0.0032).

What (torch.amp.GradScaler's semantics and defaults, torch 2.13 `torch/amp/grad_scaler.py`):
the loss is multiplied by `scale` (2^16 at first) before backward, the gradients are divided by it
before clipping, and an update whose gradients are not finite while the loss is halves the scale
and is not applied (`faults.check_update` raises `NonFinite("scaled_gradients")`;
`faults.retry_scaled` then redoes the step's updates on the same rollout at the halved scale, and
only an overflow at a scale of 1 or below skips the step, counted as `train/skipped_steps`). After
`growth_interval` clean updates in a row the scale doubles. The scale is a power of two, so
scaling and unscaling are exact in fp32: only under- and overflow change anything.

Departures from GradScaler, each for this trainer: it takes the parameters, not the optimizer,
and no separate inf check: `check_update` already syncs once per update on the gradient norm,
which is finite exactly when every gradient is. Its state is explicit (`state_dict`), saved in
every checkpoint (`Run.save`), so a resumed run continues with the same scale.

On only when the policy computes in float16 (`Policy.dtype`, resolved by `device.resolve_dtype`):
bfloat16 has float32's exponent range and float32 needs nothing, so there `scale` returns the
loss itself and `unscale_` does nothing: those runs are bit for bit what they were. The trainable
tensors must be float32 (peft 0.21 upcasts fp16 / bf16 LoRA weights to fp32 by default,
`autocast_adapter_dtype=True`, `peft/tuners/tuners_utils.py: cast_adapter_dtype`): unscaling an
fp16 gradient would underflow again, as GradScaler's "Attempting to unscale FP16 gradients"
says, and AdamW steps of ~lr would vanish in fp16 weights.
"""

from __future__ import annotations

from typing import Any

from ebpo_lite.errors import ConfigError, UserError

INIT_SCALE = 2.0**16  # torch.amp.GradScaler's defaults
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000  # clean optimizer updates in a row before the scale doubles


def refuse_float16_extra(trainable_extra: list[str], dtype) -> None:
    """`model.trainable_extra` in float16: ConfigError (`Policy.from_config`, before the load)."""
    import torch

    if dtype == torch.float16 and trainable_extra:
        raise ConfigError(
            "model.trainable_extra: base tensors trained in float16 do not learn (AdamW's steps "
            "of ~lr vanish below float16's resolution, and loss scaling needs float32 trainable "
            "tensors); drop it, or use model.dtype=bfloat16 or float32"
        )


class LossScaler:
    """The loss scale and its clean-update count; a no-op when not `enabled`."""

    def __init__(self, enabled: bool, scale: float = INIT_SCALE):
        self.enabled = enabled
        self.scale = float(scale)
        self.clean = 0  # clean updates since the last change of scale

    @classmethod
    def for_policy(cls, policy) -> LossScaler:
        """On for a float16 policy, whose trainable tensors must then be float32."""
        import torch

        if policy.dtype != torch.float16:
            return cls(False)
        for name, p in policy.model.named_parameters():
            if p.requires_grad and p.dtype != torch.float32:
                raise UserError(
                    f"model.dtype=float16: trainable tensor {name} is {p.dtype}, not float32; "
                    "float16 training needs float32 trainable tensors (loss scaling, AdamW): "
                    "use model.dtype=bfloat16 or float32"
                )
        return cls(True)

    def scale_loss(self, loss):
        """The loss to call backward on: `loss * scale`, or `loss` itself when off."""
        return loss * self.scale if self.enabled else loss

    def unscale_(self, params) -> None:
        """Divide the gradients of `params` by the scale, in place (exact: a power of two)."""
        if not self.enabled:
            return
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def update(self, overflow: bool) -> None:
        """After an update's gradients were checked: halve on overflow, else count toward
        doubling."""
        if not self.enabled:
            return
        if overflow:
            old = self.scale
            self.scale, self.clean = self.scale * BACKOFF_FACTOR, 0
            print(
                f"float16 gradients overflowed at loss scale {old:g}: lowered to {self.scale:g}",
                flush=True,
            )
            return
        self.clean += 1
        if self.clean >= GROWTH_INTERVAL:
            self.scale, self.clean = self.scale * GROWTH_FACTOR, 0

    def metrics(self) -> dict[str, float]:
        """`train/loss_scale` when on; nothing otherwise (bf16 / fp32 records are unchanged)."""
        return {"train/loss_scale": self.scale} if self.enabled else {}

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self.clean}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state.get("scale", INIT_SCALE))
        self.clean = int(state.get("clean", 0))
