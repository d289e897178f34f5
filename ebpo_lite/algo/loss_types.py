"""The loss menu: TRL 1.16's `loss_type`s as pure per-token functions (docs/losses.md).

`loss.policy_loss` composes these; each takes tensors and the scalars it needs, never a config.
Written from TRL 1.16.0 `trl/trainer/grpo_trainer.py` (`GRPOTrainer._compute_loss`,
`get_gamma_weights`, `get_high_entropy_mask`) and `grpo_config.py` (the options' meaning), and
from the papers those cite. `tests/test_trl_loss_parity.py` checks each against TRL's own code.

Notation (as `loss.py`)
- N sequences, T completion positions; `m` [N, T] float 1 on valid tokens, 0 on padding.
- `logp`, `old` [N, T]: log-probs of the sampled tokens now (with grad) and at rollout.
- `a` [N, 1]: the sequence's advantage, broadcast over its tokens.
- `coef` [N, T]: the importance ratio pi_theta / pi_old; per token (`token`), or one per
  sequence broadcast over its tokens (`sequence`, GSPO: exp of the mean log-ratio).

Per-token losses l_t (the sign makes them losses; `aggregate` reduces them):
    grpo / dr_grpo / dapo / bnpo / luspo   -min(c A, clip(r, 1 - eps_low, 1 + eps_high) A),
        c = min(r, delta) when `delta` is set (INTELLECT-2's two-sided clip), else r
    cispo   -sg(min(r, cap)) A logp                              MiniMax-M1, arXiv:2506.13585
    sapo    -(4 / tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else tau_neg
                                                                   SAPO, arXiv:2511.20347
    vespo   -sg(phi(w)) A logp, w = exp(sum_t log r_t), phi(w) = exp(lambda + k log w - lambda w),
            (k, lambda) by the sign of A                           VESPO, arXiv:2602.10693
The aggregation each `loss_type` uses in TRL is `loss_keys.AGGREGATION[loss_type]`.
"""

from __future__ import annotations

import math

import torch

from ebpo_lite.algo.loss_keys import AGGREGATION, CLIPPED, KL_ESTIMATORS, LOSS_TYPES

IS_LEVELS = ("token", "sequence")
LOG_EPS = math.log(1e-8)  # VESPO's clamp of log w (TRL: "matching the original implementation")


def log_importance_weights(
    logp: torch.Tensor, old: torch.Tensor, m: torch.Tensor, level: str
) -> torch.Tensor:
    """log r [N, T]: per token `logp - old`; `sequence` (GSPO, arXiv:2507.18071): the mean of a
    sequence's valid log-ratios, broadcast over its tokens (gradient to every valid token)."""
    log_ratio = logp - old  # [N, T]
    if level == "token":
        return log_ratio
    if level == "sequence":
        seq = (log_ratio * m).sum(1) / m.sum(1).clamp_min(1.0)  # [N]
        return seq[:, None].expand_as(log_ratio)  # [N, T]
    raise ValueError(f"importance_sampling_level: expected token or sequence, got {level!r}")


def clipped_surrogate(
    coef: torch.Tensor, a: torch.Tensor, eps_low: float, eps_high: float, delta: float | None
) -> torch.Tensor:
    """PPO's clipped loss [N, T]; `delta` caps the unclipped ratio too (two-sided, so a negative
    advantage cannot push a large ratio without bound; INTELLECT-2, arXiv:2505.07291)."""
    clipped = coef.clamp(1.0 - eps_low, 1.0 + eps_high)  # [N, T]
    if delta is not None:
        coef = coef.clamp(max=delta)
    return -torch.minimum(coef * a, clipped * a)


def cispo(coef: torch.Tensor, logp: torch.Tensor, a: torch.Tensor, cap: float) -> torch.Tensor:
    """CISPO [N, T]: REINFORCE weighted by the detached ratio capped at `cap`; every token keeps
    a gradient (no clip zeroes it), only its weight is bounded."""
    return -coef.clamp(max=cap).detach() * a * logp


def sapo(coef: torch.Tensor, a: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO [N, T]: a soft gate in place of the clip; d/dr at r = 1 is A (as PPO's), decaying
    smoothly as r leaves 1, faster for negative advantages (tau_neg > tau_pos)."""
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))  # [N, 1]
    return -torch.sigmoid(tau * (coef - 1.0)) * (4.0 / tau) * a


@torch.no_grad()
def gamma_weights(
    log_ratio: torch.Tensor,
    a: torch.Tensor,
    m: torch.Tensor,
    log_is: torch.Tensor | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """VESPO's phi(w) [N, 1], detached. log w = sum of the sequence's per-token log-ratios
    (each clamped to +-20), plus the sampler correction's log-weights `log_is` [N, T] if given,
    clamped to [log 1e-8, 20]; (k, lambda) = (k_pos, lambda_pos) where A >= 0, else the _neg
    pair. phi(1) = 1; phi peaks at w = k / lambda and decays for very small or large w."""
    seq = (log_ratio.clamp(-20.0, 20.0) * m).sum(1, keepdim=True)  # [N, 1]
    if log_is is not None:
        seq = seq + (log_is.clamp(LOG_EPS, 20.0) * m).sum(1, keepdim=True)
    log_w = seq.clamp(LOG_EPS, 20.0)  # [N, 1]
    pos = a >= 0  # [N, 1]
    k = torch.where(pos, torch.full_like(a, k_pos), torch.full_like(a, k_neg))
    lam = torch.where(pos, torch.full_like(a, lambda_pos), torch.full_like(a, lambda_neg))
    lam = lam.clamp_min(1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # [N, 1]
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(phi: torch.Tensor, logp: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """VESPO [N, T]: REINFORCE weighted by the sequence's detached gamma weight `phi` [N, 1]."""
    return -phi * a * logp


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, m: torch.Tensor, quantile: float) -> torch.Tensor:
    """Bool [N, T]: valid tokens whose entropy is in the top `quantile` of the valid tokens'
    (Wang et al., "Beyond the 80/20 rule", arXiv:2506.01939; TRL's `top_entropy_quantile`):
    entropy >= the (1 - quantile) quantile, linear interpolation as torch.quantile. 0 keeps the
    highest-entropy token(s) only; callers skip the mask at 1."""
    valid = m > 0  # [N, T]
    values = entropy[valid].float()  # [n_valid]
    if values.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy >= threshold) & valid


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled tokens [N, T]
    (Schulman, "Approximating KL divergence", 2020), with d = log pi_ref - log pi_theta:
    k1 = -d (unbiased, high variance, can be negative), k2 = d^2 / 2 (biased, low variance),
    k3 = exp(d) - d - 1 (unbiased, >= 0; TRL's and verl's `low_var_kl`)."""
    d = ref - logp  # [N, T]
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl_estimator: expected one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


__all__ = ["AGGREGATION", "CLIPPED", "KL_ESTIMATORS", "LOSS_TYPES"]  # re-exported names
