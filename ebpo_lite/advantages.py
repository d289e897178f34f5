"""Advantage estimators: GRPO, Dr. GRPO, RLOO and EBPO (GRPO with an empirical-Bayes baseline).

Implements ../shared/ALGORITHM.md sections 1-3 (Han et al., "EBPO", arXiv:2602.05165, Alg. 1).

Notation
    B        prompts per step (rows); G completions per prompt (columns), G >= 2
    R        rewards [B, G]; M optional bool mask [B, G], True = scorable
    n_b      number of valid entries of row b (= G without a mask)
    mean_g   per-row mean over the row's valid entries            [B]
    std_g    per-row Bessel-corrected (n_b - 1) std                [B]
    "batch"  statistics over all valid entries of the step, each completion counted once

Estimators (A has the rewards' shape and dtype; everything is computed in float64)
    grpo     A = (R - mean_g) / (std_g + 1e-4)       scale="group" (default)
             A = (R - mean_g) / (std_all + 1e-4)     scale="batch": one Bessel std of all rewards
             A = R - mean_g                           scale="none"
    dr_grpo  A = R - mean_g
    rloo     A = R - (sum_g - R) / (n_b - 1) = n_b / (n_b - 1) * (R - mean_g)
    ebpo     per step, in this order (the "paper" variant, all EBPrior defaults):
        1. W_r <- every valid reward, W_mu <- every group mean (the current batch is included)
        2. mu_glob = mean(W_r), sigma2 = var(W_r), tau2 = var(W_mu), var = population M2 / n
        3. S = (sigma2 / n_b) / (sigma2 / n_b + tau2); S = 0 if the denominator <= 1e-12
        4. V = (1 - S) * mean_g + S * mu_glob
        5. A_raw = R - V
        6. A = (A_raw - mean(A_raw)) / (std(A_raw) + 1e-6), batch mean and population std
    After step 6 mu_glob cancels: A = [(R - mean_g) + S (mean_g - mean(R))] / (std(A_raw) + 1e-6);
    history enters only through S. An all-fail row gets -S mean(R) / std (GRPO gives 0).

EBPrior options beyond the paper (ALGORITHM.md section 3; each off by default)
    tau2="moments"   tau2 = max(var(W_mu) - sigma2_within * mean(W_inv_n), tau2_min). The
                     subtracted term is the pooled WITHIN-group variance (as ALGORITHM.md writes),
                     never the total one: var(group means) ~= tau2 + E[within variance / n_b], and
                     the total variance already contains tau2. mean(W_inv_n) is the running mean of
                     1 / n_b, i.e. exactly 1 / G without a mask. tau2_min applies only here.
    sigma2="within"  sigma2 = mean(W_within): a third accumulator that receives each group's
                     unbiased (n_b - 1) variance, one value per group (equal weights).
    center=False     A = A_raw / (std(A_raw) + 1e-6): no re-centring, so mu_glob and the
                     -S * mu_glob / std all-fail signal survive. std is still the centred std.
    decay=gamma      exponentially weighted accumulators: a value observed at step s has weight
                     gamma ** (t - s) at step t, all values of one step share that weight, and
                     mean / var are the weighted mean and weighted population variance
                     (sum w (x - mean)^2 / sum w). t counts observations (calls of ebpo_advantages,
                     or of EBPrior.observe) on the prior.
                     Update (Chan/Welford merge of a batch of k unit-weight values with mean m_b
                     and sum of squared deviations q_b into (w, mean, M2)):
                         w, M2 <- gamma^(t - t_last) * w, gamma^(t - t_last) * M2
                         d = m_b - mean;  w' = w + k;  mean += d k / w'
                         M2 += q_b + d^2 w k / w';  w = w'
                     gamma = None (paper) is the same merge with no down-weighting: plain Welford.
    keys             one key (str or int) per prompt: one accumulator set per key, updated with
                     that key's rows. A row uses its key's (mu_glob, sigma2, tau2) once the key has
                     >= min_count observations (= group means seen for that key, an unweighted
                     count, current batch included), else the global ones. The global set is
                     always updated with every row. S and mu_glob then differ per prompt.

Where the paper is silent (choices fixed here)
    - Population Welford variance M2 / n (ALGORITHM.md fixes it); eps 1e-4 (GRPO), 1e-6 (EBPO).
    - Masks: masked entries enter no statistic and get A = 0. A row with fewer than 2 valid
      entries gets A = 0 everywhere and enters no statistic at all (no group mean, no rewards).
      With a mask, S uses the row's own n_b (the sampling variance of its mean is sigma2 / n_b);
      without a mask n_b = G and S is one scalar per step, as in the paper.
    - A step with no valid row returns zeros and updates nothing (the step counter still moves).
    - Dynamic sampling (DAPO) trains on fewer groups than it scores: `EBPrior.observe` runs step 1
      on every drawn group (W_r receives every reward, as ALGORITHM.md says) and
      `ebpo_advantages(kept, prior, observe=False)` runs steps 2-6 on the kept ones. Observing only
      the kept (mixed-reward) groups would bias tau2 low and S high.
    - The raw tau2 (paper) can make S exceed 1/2 on a finite sample (e.g. rows [1, 0] and [0, 1]
      give tau2 = 0 and S = 1): S <= 1/2 holds exactly iff the mean within-group population
      variance is <= (G - 1) tau2, and it holds in the large-sample limit for any rewards.
    - Keys must be str or int (bool rejected) so the state stores them type-safely as "s:<str>"
      or "i:<int>"; 1 and "1" are different keys.
    - EBPrior.load_state_dict adopts the options stored in the state, so a resumed prior is
      exactly the saved one whatever it was constructed with.

Stats returned by ebpo_advantages (plain floats): shrinkage, mu_glob, sigma2, tau2 (means over the
valid prompts of the per-prompt values used; equal to the global scalars without keys), raw_std
(std(A_raw)), frac_key_prior (share of valid prompts that used their key's prior), n_keys, and
groups_seen (global group means observed). The other estimators return no stats;
`frac_zero_std_groups(rewards, mask)` gives the share of valid groups whose rewards are all equal,
for any estimator.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "ESTIMATORS",
    "EBPrior",
    "Welford",
    "compute_advantages",
    "dr_grpo_advantages",
    "ebpo_advantages",
    "frac_zero_std_groups",
    "grpo_advantages",
    "rloo_advantages",
]

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "ebpo")
GRPO_EPS = 1e-4
EBPO_EPS = 1e-6
S_DENOM_MIN = 1e-12
_F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# Input checks and per-group statistics shared by every estimator


class _Groups(NamedTuple):
    R: torch.Tensor  # [B, G] float64, zero where not active
    act: torch.Tensor  # [B, G] bool: valid entry of a row with >= 2 valid entries
    ok: torch.Tensor  # [B] bool: row has >= 2 valid entries
    n: torch.Tensor  # [B] float64: valid entries per active row (1 for inactive rows)
    mean_g: torch.Tensor  # [B] float64 (0 for inactive rows)
    var_g: torch.Tensor  # [B] float64 unbiased (n - 1) variance (0 for inactive rows)
    dtype: torch.dtype


def _groups(rewards: torch.Tensor, mask: torch.Tensor | None, fn: str) -> _Groups:
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
    R = rewards.detach().to(_F64)  # [B, G]
    bad = ~torch.isfinite(R) & M  # [B, G]
    if bool(bad.any()):
        b, g = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{fn}: rewards[{b}, {g}] is {R[b, g].item()} (must be finite)")
    n = M.sum(dim=1)  # [B]
    ok = n >= 2  # [B]
    act = M & ok[:, None]  # [B, G]
    R = torch.where(act, R, torch.zeros((), dtype=_F64, device=R.device))  # [B, G]
    nf = torch.where(ok, n, torch.ones_like(n)).to(_F64)  # [B]
    # shift by the row's first valid value: exact means (and exact zeros) for constant rows
    c = R.gather(1, act.to(torch.uint8).argmax(dim=1, keepdim=True))  # [B, 1]
    mean_g = c.squeeze(1) + ((R - c) * act).sum(dim=1) / nf  # [B]
    dev = (R - mean_g[:, None]) * act  # [B, G]
    var_g = dev.pow(2).sum(dim=1) / (nf - 1).clamp(min=1.0)  # [B]
    return _Groups(R, act, ok, nf, mean_g, var_g, rewards.dtype)


def frac_zero_std_groups(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Share of valid groups (rows with >= 2 valid entries) whose valid rewards are all equal.

    These are the groups GRPO gives zero advantage (the vanishing-gradient case). 0.0 if no row
    is valid.
    """
    g = _groups(rewards, mask, "frac_zero_std_groups")
    n_ok = int(g.ok.sum())
    if n_ok == 0:
        return 0.0
    return float(((g.var_g == 0) & g.ok).sum()) / n_ok


# ----------------------------------------------------------------------------------------------
# Baselines


def grpo_advantages(
    rewards: torch.Tensor, scale: str = "group", mask: torch.Tensor | None = None
) -> torch.Tensor:
    """GRPO: A = (R - mean_g) / (std + 1e-4), std per group ("group"), of all valid rewards
    ("batch", Bessel, as TRL), or no division ("none"). rewards [B, G] -> A [B, G]."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(
            f"grpo_advantages: scale must be 'group', 'batch' or 'none', got {scale!r}"
        )
    g = _groups(rewards, mask, "grpo_advantages")
    centred = (g.R - g.mean_g[:, None]) * g.act  # [B, G]
    if scale == "group":
        A = centred / (g.var_g.sqrt()[:, None] + GRPO_EPS)  # [B, G]
    elif scale == "batch":
        N = g.act.sum().to(_F64)
        mean_all = g.R.sum() / N.clamp(min=1.0)
        var_all = ((g.R - mean_all) * g.act).pow(2).sum() / (N - 1).clamp(min=1.0)
        A = centred / (var_all.sqrt() + GRPO_EPS)  # [B, G]
    else:
        A = centred  # [B, G]
    return A.to(g.dtype)


def dr_grpo_advantages(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO: A = R - mean_g (no std division). rewards [B, G] -> A [B, G]."""
    g = _groups(rewards, mask, "dr_grpo_advantages")
    return ((g.R - g.mean_g[:, None]) * g.act).to(g.dtype)  # [B, G]


def rloo_advantages(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: A = R - (sum_g - R) / (n_b - 1) = n_b / (n_b - 1) * (R - mean_g). [B, G] -> [B, G]."""
    g = _groups(rewards, mask, "rloo_advantages")
    # computed as the scaled form: exact zeros for constant rows
    scale = g.n / (g.n - 1).clamp(min=1.0)  # [B]
    return (scale[:, None] * (g.R - g.mean_g[:, None]) * g.act).to(g.dtype)  # [B, G]


# ----------------------------------------------------------------------------------------------
# Running statistics


class Welford:
    """Running (optionally exponentially weighted) mean and population variance.

    State: n (unweighted count), w (sum of weights), mean, m2 (weighted sum of squared
    deviations from mean). var = m2 / w. Batches are merged with Chan's parallel formula; see the
    module docstring for the decayed update.
    """

    __slots__ = ("n", "w", "mean", "m2")

    def __init__(self) -> None:
        self.n, self.w, self.mean, self.m2 = 0, 0.0, 0.0, 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.w if self.w > 0 else 0.0

    def decay(self, factor: float) -> None:
        """Multiply the weight of everything seen so far by factor (mean and var unchanged)."""
        self.w *= factor
        self.m2 *= factor

    def merge(self, k: int, mean: float, m2: float) -> None:
        """Add k unit-weight values with mean `mean` and sum of squared deviations `m2`."""
        if k == 0:
            return
        w_new = self.w + k
        delta = mean - self.mean
        self.mean += delta * k / w_new
        self.m2 += m2 + delta * delta * self.w * k / w_new
        self.w = w_new
        self.n += k

    def update(self, x: torch.Tensor) -> None:
        """Add the values of x (any shape) with unit weight each."""
        x = x.detach().reshape(-1).to(_F64)  # [k]
        if x.numel() == 0:
            return
        m = float(x.mean())
        self.merge(x.numel(), m, float((x - m).pow(2).sum()))

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "w": self.w, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            n, w, mean, m2 = (
                int(state["n"]),
                float(state["w"]),
                float(state["mean"]),
                float(state["m2"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Welford.load_state_dict: bad state {state!r} ({e})") from None
        self.n, self.w, self.mean, self.m2 = n, w, mean, m2


_FIELDS = ("r", "mu", "within", "inv_n")  # rewards, group means, group variances, 1 / n_b


class _AccSet:
    """One set of accumulators (global, or one per key) and the step it was last updated."""

    def __init__(self) -> None:
        self.acc = {f: Welford() for f in _FIELDS}
        self.last_step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, **{f: self.acc[f].state_dict() for f in _FIELDS}}

    def load_state_dict(self, state: dict[str, Any], where: str) -> None:
        if not isinstance(state, dict) or any(f not in state for f in (*_FIELDS, "last_step")):
            raise ValueError(f"EBPrior.load_state_dict: {where} needs keys last_step, {_FIELDS}")
        self.last_step = int(state["last_step"])
        for f in _FIELDS:
            self.acc[f].load_state_dict(state[f])


def _segment_moments(
    x: torch.Tensor, seg: torch.Tensor, nseg: int
) -> tuple[list[int], list[float], list[float]]:
    """Per-segment count, mean and sum of squared deviations of x [k] with ids seg [k]."""
    cnt = torch.zeros(nseg, dtype=_F64, device=x.device).index_add_(0, seg, torch.ones_like(x))
    tot = torch.zeros(nseg, dtype=_F64, device=x.device).index_add_(0, seg, x)
    mean = tot / cnt.clamp(min=1.0)  # [nseg]
    m2 = torch.zeros(nseg, dtype=_F64, device=x.device).index_add_(0, seg, (x - mean[seg]).pow(2))
    return [int(c) for c in cnt.tolist()], mean.tolist(), m2.tolist()


def _key_tag(key: Any, i: int) -> str:
    if isinstance(key, str):
        return "s:" + key
    if not isinstance(key, bool):
        try:
            return "i:" + str(operator.index(key))
        except TypeError:
            pass
    raise ValueError(f"ebpo_advantages: keys[{i}] must be a str or int, got {type(key).__name__}")


class _KeyIds(NamedTuple):
    tags: list[str]  # distinct key tags, in order of first appearance
    ids: torch.Tensor  # [B] long: index of each row's key in tags


def _key_ids(keys: Sequence[Hashable], B: int, device: torch.device) -> _KeyIds:
    if isinstance(keys, (str, bytes)) or len(keys) != B:
        raise ValueError(f"ebpo_advantages: keys must be a sequence of B = {B} keys")
    seen: dict[tuple[type, Hashable], int] = {}  # (type, key) -> id; type keeps 1 and 1.0 apart
    tag_id: dict[str, int] = {}
    ids = []
    for i, k in enumerate(keys):
        try:
            j = seen.get((type(k), k))
        except TypeError:  # unhashable: neither str nor int
            j = None
        if j is None:
            j = tag_id.setdefault(_key_tag(k, i), len(tag_id))
            seen[(type(k), k)] = j
        ids.append(j)
    return _KeyIds(list(tag_id), torch.tensor(ids, dtype=torch.long, device=device))


def _untag(tag: str) -> str | int:
    return tag[2:] if tag.startswith("s:") else int(tag[2:])


class EBPrior:
    """The running empirical-Bayes prior of EBPO (see the module docstring for each option).

    Defaults are the paper's variant. Updated in place by `ebpo_advantages`; `state_dict()` is
    plain Python (str keys, floats, ints, dicts) for torch.save or json, and round-trips exactly.
    """

    def __init__(
        self,
        tau2: str = "raw",
        sigma2: str = "total",
        center: bool = True,
        decay: float | None = None,
        min_count: int = 8,
        tau2_min: float = 1e-6,
    ) -> None:
        if tau2 not in ("raw", "moments"):
            raise ValueError(f"EBPrior.tau2: expected 'raw' or 'moments', got {tau2!r}")
        if sigma2 not in ("total", "within"):
            raise ValueError(f"EBPrior.sigma2: expected 'total' or 'within', got {sigma2!r}")
        if not isinstance(center, bool):
            raise ValueError(f"EBPrior.center: expected a bool, got {center!r}")
        if decay is not None and (
            isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1
        ):
            raise ValueError(f"EBPrior.decay: expected None or a float in (0, 1), got {decay!r}")
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"EBPrior.min_count: expected an int >= 1, got {min_count!r}")
        if (
            isinstance(tau2_min, bool)
            or not isinstance(tau2_min, (int, float))
            or not (0 <= tau2_min < math.inf)
        ):
            raise ValueError(f"EBPrior.tau2_min: expected a finite float >= 0, got {tau2_min!r}")
        self.tau2, self.sigma2, self.center = tau2, sigma2, center
        self.decay = None if decay is None else float(decay)
        self.min_count, self.tau2_min = min_count, float(tau2_min)
        self.step = 0
        self.glob = _AccSet()
        self.by_key: dict[str, _AccSet] = {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"EBPrior({opts}; step={self.step}, keys={len(self.by_key)})"

    def options(self) -> dict[str, Any]:
        return {
            "tau2": self.tau2,
            "sigma2": self.sigma2,
            "center": self.center,
            "decay": self.decay,
            "min_count": self.min_count,
            "tau2_min": self.tau2_min,
        }

    def key_counts(self) -> dict[str | int, int]:
        """Observations (group means seen) per key, keys as given (str or int)."""
        return {_untag(t): s.acc["mu"].n for t, s in self.by_key.items()}

    def estimates(self, key: Hashable | None = None) -> tuple[float, float, float]:
        """(mu_glob, sigma2, tau2) a prompt with this key would use now (None: the global ones)."""
        return self._estimates_of(self._set_for(None if key is None else _key_tag(key, 0)))

    def _set_for(self, tag: str | None) -> _AccSet:
        s = self.by_key.get(tag) if tag is not None else None
        return s if s is not None and s.acc["mu"].n >= self.min_count else self.glob

    def _estimates_of(self, s: _AccSet) -> tuple[float, float, float]:
        r, mu, within, inv_n = (s.acc[f] for f in _FIELDS)
        sigma2 = r.var if self.sigma2 == "total" else within.mean
        if self.tau2 == "raw":
            tau2 = mu.var
        else:
            tau2 = max(mu.var - within.mean * inv_n.mean, self.tau2_min)
        return r.mean, sigma2, tau2

    def observe(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> None:
        """Step 1 alone: add rewards [B, G] (mask, keys as in `ebpo_advantages`) to the prior.

        For a trainer that scores more groups than it trains on (dynamic sampling): observe every
        drawn group, then `ebpo_advantages(kept, prior, observe=False)` reads the statistics.
        One call is one step of the decay clock.
        """
        g = _groups(rewards, mask, "EBPrior.observe")
        self._observe(g, None if keys is None else _key_ids(keys, g.R.shape[0], g.R.device))

    def _observe(self, g: _Groups, keys: _KeyIds | None) -> None:
        """Step 1 of the algorithm: add this step's rewards and group statistics."""
        self.step += 1
        if not bool(g.ok.any()):
            return
        ok_rows = g.ok.nonzero().squeeze(1)  # [B_ok]
        seg = torch.zeros_like(g.ok, dtype=torch.long)  # [B] 0 = no key, j + 1 = keys.tags[j]
        if keys is not None:
            seg = keys.ids + 1  # [B]
        per_field = {
            "r": (g.R[g.act], seg[:, None].expand_as(g.act)[g.act]),  # [N]
            "mu": (g.mean_g[ok_rows], seg[ok_rows]),  # [B_ok]
            "within": (g.var_g[ok_rows], seg[ok_rows]),  # [B_ok]
            "inv_n": (1.0 / g.n[ok_rows], seg[ok_rows]),  # [B_ok]
        }
        updated: dict[int, _AccSet] = {0: self.glob}  # segment -> accumulator set
        if keys is not None:
            for j in sorted(set(seg[ok_rows].tolist())):
                updated[j] = self.by_key.setdefault(keys.tags[j - 1], _AccSet())
        for s in updated.values():
            if self.decay is not None and s.last_step > 0:
                factor = self.decay ** (self.step - s.last_step)
                for a in s.acc.values():
                    a.decay(factor)
            s.last_step = self.step
        for f, (x, segs) in per_field.items():
            self.glob.acc[f].merge(*_moments_all(x))
            if keys is not None:
                cnt, mean, m2 = _segment_moments(x, segs, len(keys.tags) + 1)
                for j, s in updated.items():
                    if j > 0:
                        s.acc[f].merge(cnt[j], mean[j], m2[j])

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "options": self.options(),
            "step": self.step,
            "global": self.glob.state_dict(),
            "keys": {t: s.state_dict() for t, s in self.by_key.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state_dict exactly, options included (they travel with the state)."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("EBPrior.load_state_dict: expected a dict with version 1")
        for k in ("options", "step", "global", "keys"):
            if k not in state:
                raise ValueError(f"EBPrior.load_state_dict: state is missing {k!r}")
        fresh = EBPrior(**state["options"])
        fresh.step = int(state["step"])
        fresh.glob.load_state_dict(state["global"], "global")
        for t, s in state["keys"].items():
            if not (isinstance(t, str) and t[:2] in ("s:", "i:")):
                raise ValueError(f"EBPrior.load_state_dict: bad key tag {t!r}")
            fresh.by_key[t] = _AccSet()
            fresh.by_key[t].load_state_dict(s, f"keys[{t!r}]")
        self.__dict__.update(copy.deepcopy(fresh.__dict__))


def _moments_all(x: torch.Tensor) -> tuple[int, float, float]:
    """Count, mean and sum of squared deviations of x [k], k >= 1."""
    m = float(x.mean())
    return x.numel(), m, float((x - m).pow(2).sum())


# ----------------------------------------------------------------------------------------------
# EBPO


def ebpo_advantages(
    rewards: torch.Tensor,
    prior: EBPrior,
    mask: torch.Tensor | None = None,
    keys: Sequence[Hashable] | None = None,
    observe: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EBPO advantages (ALGORITHM.md section 2, options of section 3). Updates `prior` in place.

    rewards [B, G] float, mask [B, G] bool (True = scorable), keys: one str/int per prompt.
    `observe=False` skips step 1: the caller has already given this step's rewards (a superset
    of these rows) to `prior.observe`. Returns A [B, G] in the rewards' dtype and plain-float stats.
    """
    if not isinstance(prior, EBPrior):
        raise ValueError(f"ebpo_advantages: prior must be an EBPrior, got {type(prior).__name__}")
    g = _groups(rewards, mask, "ebpo_advantages")
    B = g.R.shape[0]
    kid = None if keys is None else _key_ids(keys, B, g.R.device)
    if observe:
        prior._observe(g, kid)  # step 1

    # step 2: per-row (mu_glob, sigma2, tau2) from the row's key set (if it has min_count
    # observations) or the global one; row 0 of the table is the global set
    sets = [prior.glob] + ([prior._set_for(tg) for tg in kid.tags] if kid is not None else [])
    table = torch.tensor([prior._estimates_of(s) for s in sets], dtype=_F64, device=g.R.device)
    row = kid.ids + 1 if kid is not None else torch.zeros(B, dtype=torch.long, device=g.R.device)
    mu, sigma2, tau2 = table[row].unbind(dim=1)  # [B] each
    keyed = torch.tensor([s is not prior.glob for s in sets], device=g.R.device)[row]  # [B]

    # step 3: shrinkage per row (one scalar without mask or keys)
    noise = sigma2 / g.n  # [B]
    denom = noise + tau2  # [B]
    big = denom > S_DENOM_MIN  # [B]
    S = torch.where(big, noise / torch.where(big, denom, torch.ones_like(denom)), 0.0)  # [B]

    # steps 4-6: baseline, raw advantage, batch whitening over the valid entries
    V = (1 - S) * g.mean_g + S * mu  # [B]
    A_raw = (g.R - V[:, None]) * g.act  # [B, G]
    N = g.act.sum().to(_F64).clamp(min=1.0)
    m = A_raw.sum() / N
    std = ((A_raw - m) * g.act).pow(2).sum().div(N).sqrt()
    top = (A_raw - m) * g.act if prior.center else A_raw  # [B, G]
    A = top / (std + EBPO_EPS)  # [B, G]

    ok = g.ok
    n_ok = int(ok.sum())

    def avg(x: torch.Tensor, fallback: float) -> float:
        return float(x[ok].mean()) if n_ok else fallback

    glob = prior._estimates_of(prior.glob)
    stats = {
        "shrinkage": avg(S, 0.0),
        "mu_glob": avg(mu, glob[0]),
        "sigma2": avg(sigma2, glob[1]),
        "tau2": avg(tau2, glob[2]),
        "raw_std": float(std),
        "frac_key_prior": avg(keyed.to(_F64), 0.0),
        "n_keys": float(len(prior.by_key)),
        "groups_seen": float(prior.glob.acc["mu"].n),
    }
    return A.to(g.dtype), stats


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    prior: EBPrior | None = None,
    mask: torch.Tensor | None = None,
    keys: Sequence[Hashable] | None = None,
    grpo_scale: str = "group",
    observe: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One switch for the trainer and the integrations: name in ESTIMATORS -> (A [B, G], stats).

    "ebpo" needs `prior` (updated in place unless `observe=False`, see ebpo_advantages) and uses
    `keys`; the others ignore prior, keys and observe and return stats = {}. `grpo_scale` is
    passed to grpo_advantages as `scale`.
    """
    if name == "grpo":
        return grpo_advantages(rewards, scale=grpo_scale, mask=mask), {}
    if name == "dr_grpo":
        return dr_grpo_advantages(rewards, mask=mask), {}
    if name == "rloo":
        return rloo_advantages(rewards, mask=mask), {}
    if name == "ebpo":
        if prior is None:
            raise ValueError("compute_advantages: name='ebpo' needs prior=EBPrior(...)")
        return ebpo_advantages(rewards, prior, mask=mask, keys=keys, observe=observe)
    raise ValueError(f"compute_advantages: name must be one of {ESTIMATORS}, got {name!r}")
