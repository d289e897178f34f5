"""Input checks and per-group statistics shared by every estimator and by the EB prior.

Notation as in `advantages`: rewards R [B, G], optional bool mask M [B, G] (True = scorable),
n_b valid entries of row b, mean_g and the unbiased (n_b - 1) variance var_g per row, all in
float64. A row with fewer than 2 valid entries is inactive: it enters no statistic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

F64 = torch.float64


class Groups(NamedTuple):
    R: torch.Tensor  # [B, G] float64, zero where not active
    act: torch.Tensor  # [B, G] bool: valid entry of a row with >= 2 valid entries
    ok: torch.Tensor  # [B] bool: row has >= 2 valid entries
    n: torch.Tensor  # [B] float64: valid entries per active row (1 for inactive rows)
    mean_g: torch.Tensor  # [B] float64 (0 for inactive rows)
    var_g: torch.Tensor  # [B] float64 unbiased (n - 1) variance (0 for inactive rows)
    dtype: torch.dtype


def group_stats(rewards: torch.Tensor, mask: torch.Tensor | None, fn: str) -> Groups:
    """Validate rewards [B, G] (and mask) and compute the per-row statistics in float64."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(
            f"{fn}: rewards must be a torch.Tensor [B, G], got {type(rewards).__name__}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"{fn}: rewards must be a float tensor, got dtype {rewards.dtype}")
    if rewards.dim() != 2:
        raise ValueError(f"{fn}: rewards must have shape [B, G], got {tuple(rewards.shape)}")
    B, G = rewards.shape
    if B < 1:
        raise ValueError(f"{fn}: rewards has no rows (shape {tuple(rewards.shape)})")
    if G < 2:
        raise ValueError(f"{fn}: rewards needs G >= 2 completions per prompt, got G = {G}")
    if mask is None:
        M = torch.ones(B, G, dtype=torch.bool, device=rewards.device)  # [B, G]
    else:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError(f"{fn}: mask must be a bool tensor [B, G]")
        if mask.shape != rewards.shape:
            raise ValueError(
                f"{fn}: mask shape {tuple(mask.shape)} != rewards shape {tuple(rewards.shape)}"
            )
        M = mask.to(rewards.device)  # [B, G]
    R = rewards.detach().to(F64)  # [B, G]
    bad = ~torch.isfinite(R) & M  # [B, G]
    if bool(bad.any()):
        b, g = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{fn}: rewards[{b}, {g}] is {R[b, g].item()} (must be finite)")
    n = M.sum(dim=1)  # [B]
    ok = n >= 2  # [B]
    act = M & ok[:, None]  # [B, G]
    R = torch.where(act, R, torch.zeros((), dtype=F64, device=R.device))  # [B, G]
    nf = torch.where(ok, n, torch.ones_like(n)).to(F64)  # [B]
    # shift by the row's first valid value: exact means (and exact zeros) for constant rows
    c = R.gather(1, act.to(torch.uint8).argmax(dim=1, keepdim=True))  # [B, 1]
    mean_g = c.squeeze(1) + ((R - c) * act).sum(dim=1) / nf  # [B]
    dev = (R - mean_g[:, None]) * act  # [B, G]
    var_g = dev.pow(2).sum(dim=1) / (nf - 1).clamp(min=1.0)  # [B]
    return Groups(R, act, ok, nf, mean_g, var_g, rewards.dtype)


def frac_zero_std_groups(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Share of valid groups (rows with >= 2 valid entries) whose valid rewards are all equal.

    These are the groups GRPO gives zero advantage (the vanishing-gradient case). 0.0 if no row
    is valid.
    """
    g = group_stats(rewards, mask, "frac_zero_std_groups")
    n_ok = int(g.ok.sum())
    if n_ok == 0:
        return 0.0
    return float(((g.var_g == 0) & g.ok).sum()) / n_ok
