"""Advantage estimators: GRPO, Dr. GRPO, RLOO and EBPO (GRPO with an empirical-Bayes baseline).

Implements docs/algorithm.md sections 2-4 (Han et al., "EBPO", arXiv:2602.05165, Alg. 1).

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

Options of ebpo beyond the paper (docs/algorithm.md section 4; EBPrior flags, each off by default;
the prior's own options - tau2, sigma2, center, decay, keys - are documented in `ebprior`)
    leave_one_out    completion i's baseline uses the OTHER valid completions of its group,
                     shrunk with the shrinkage of a group of n_b - 1:
                         mean_-i = (n_b mean_g - R_i) / (n_b - 1)
                         S' = (sigma2 / (n_b - 1)) / (sigma2 / (n_b - 1) + tau2)
                         V_i = (1 - S') mean_-i + S' mu
                     With G = 2 this is the other sample shrunk toward the prior.
                     Bias: the policy gradient (1/n) sum_i (R_i - V_i) grad log pi(y_i) is unbiased
                     iff V_i is independent of y_i given the prompt. The paper's baseline holds R_i
                     with weight (1 - S) / n, so its expected gradient is (1 - (1 - S) / n) grad J;
                     V_i leaves y_i out and gives grad J (treating mu, S and the batch whitening,
                     which see each reward with weight O(1 / (B G)), as constants).
                     What it changes, exactly: with kappa = sigma2 / spread (S = kappa / (kappa +
                     n), S' = kappa / (kappa + n - 1)), the paper's raw advantage is
                         R_i - V = c_b (R_i - V_i),   c_b = (n_b - 1 + S) / n_b,
                     because (1 - S)(n - 1) / (n - 1 + S) = 1 - S'. Leave-one-out is the paper
                     estimator with group b's weight divided by c_b, nothing else: the same
                     direction within a group, and one scalar for the batch when every group has
                     the same n_b and S (no mask, keys or prompt_prior), which the whitening of
                     step 6 then removes, so the advantages equal the paper's there (up to its eps).
                     It matters where S or n_b differ between groups (masked completions, prior_key,
                     prompt_prior): it stops the paper's up-weighting of the groups it shrinks most.
                     The same holds without shrinkage (Dr. GRPO = (n - 1) / n RLOO).
                     tests/test_ebpo_options.py checks the unbiasedness by exact enumeration and the
                     identity; benchmarks/theory_mse.py measures both by Monte Carlo.
    prompt_prior     the prompt's own earlier visits refine its prior. The prior (global or keyed)
                     says a prompt's mean reward is ~ N(mu, tau2) and a reward is that mean plus
                     noise of variance sigma2; the prompt's history (m completions scored at earlier
                     steps with reward sum s, `EBPrior.prompt_history`, decayed with `decay`) gives
                     its posterior mean and variance
                         D = sigma2 + m tau2
                         mu_p = (sigma2 mu + tau2 s) / D,   v_p = sigma2 tau2 / D   (D <= 1e-12:
                         mu_p = mu, v_p = 0)
                     and the group shrinks toward the posterior, with S from the prompt's own count:
                         S = (sigma2 / n) / (sigma2 / n + v_p),   V = (1 - S) mean_g + S mu_p
                     (n = n_b, or n_b - 1 with leave_one_out, mean_g then mean_-i). With
                     kappa = sigma2 / tau2, the prior's effective count: mu_p = (kappa mu + s) /
                     (kappa + m) and S = (kappa + m) / (kappa + m + n). For 0/1 rewards this is
                     exactly the Beta-binomial posterior mean under a Beta(kappa mu, kappa (1 - mu))
                     prior. m = 0 (a new prompt) gives the paper's S and V. Needs one prompt id per
                     row (`prompts=`); mu_p differs per prompt, so re-centring no longer cancels it.

Where the paper is silent (choices fixed here)
    - Population Welford variance M2 / n; eps 1e-4 (GRPO), 1e-6 (EBPO); docs/algorithm.md
      section 9 lists every such choice.
    - Masks: masked entries enter no statistic and get A = 0. A row with fewer than 2 valid
      entries gets A = 0 everywhere and enters no statistic at all (no group mean, no rewards).
      With a mask, S uses the row's own n_b (the sampling variance of its mean is sigma2 / n_b);
      without a mask n_b = G and S is one scalar per step, as in the paper.
    - A step with no valid row returns zeros and updates nothing (the step counter still moves).
    - Dynamic sampling (DAPO) trains on fewer groups than it scores: `EBPrior.observe` runs step 1
      on every drawn group (W_r receives every reward: docs/algorithm.md section 5) and
      `ebpo_advantages(kept, prior, observe=False)` runs steps 2-6 on the kept ones. Observing only
      the kept (mixed-reward) groups would bias tau2 low and S high.
    - The raw tau2 (paper) can make S exceed 1/2 on a finite sample (e.g. rows [1, 0] and [0, 1]
      give tau2 = 0 and S = 1): S <= 1/2 holds exactly iff the mean within-group population
      variance is <= (G - 1) tau2, and it holds in the large-sample limit for any rewards.

Stats returned by ebpo_advantages (plain floats): shrinkage, mu_glob, sigma2, tau2 (means over the
valid prompts of the per-prompt values used; equal to the global scalars without keys), raw_std
(std(A_raw)), frac_key_prior (share of valid prompts that used their key's prior), n_keys,
groups_seen (global group means observed) and, with prompt_prior, prompt_visits (mean m of the
valid prompts) and frac_prompt_seen (share with m > 0). The other estimators return no stats;
`frac_zero_std_groups(rewards, mask)` gives the share of valid groups whose rewards are all equal,
for any estimator.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ebpo_lite.algo.ebprior import EBPrior, Welford, _key_ids
from ebpo_lite.algo.groups import F64, frac_zero_std_groups, group_stats

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
    g = group_stats(rewards, mask, "grpo_advantages")
    centred = (g.R - g.mean_g[:, None]) * g.act  # [B, G]
    if scale == "group":
        A = centred / (g.var_g.sqrt()[:, None] + GRPO_EPS)  # [B, G]
    elif scale == "batch":
        N = g.act.sum().to(F64)
        mean_all = g.R.sum() / N.clamp(min=1.0)
        var_all = ((g.R - mean_all) * g.act).pow(2).sum() / (N - 1).clamp(min=1.0)
        A = centred / (var_all.sqrt() + GRPO_EPS)  # [B, G]
    else:
        A = centred  # [B, G]
    return A.to(g.dtype)


def dr_grpo_advantages(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO: A = R - mean_g (no std division). rewards [B, G] -> A [B, G]."""
    g = group_stats(rewards, mask, "dr_grpo_advantages")
    return ((g.R - g.mean_g[:, None]) * g.act).to(g.dtype)  # [B, G]


def rloo_advantages(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: A = R - (sum_g - R) / (n_b - 1) = n_b / (n_b - 1) * (R - mean_g). [B, G] -> [B, G]."""
    g = group_stats(rewards, mask, "rloo_advantages")
    # computed as the scaled form: exact zeros for constant rows
    scale = g.n / (g.n - 1).clamp(min=1.0)  # [B]
    return (scale[:, None] * (g.R - g.mean_g[:, None]) * g.act).to(g.dtype)  # [B, G]


# ----------------------------------------------------------------------------------------------
# EBPO


def ebpo_advantages(
    rewards: torch.Tensor,
    prior: EBPrior,
    mask: torch.Tensor | None = None,
    keys: Sequence[Hashable] | None = None,
    observe: bool = True,
    prompts: Sequence[Hashable] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EBPO advantages (docs/algorithm.md section 3, options of section 4). Updates `prior`.

    rewards [B, G] float, mask [B, G] bool (True = scorable), keys: one str/int per prompt (the
    prior_key), prompts: one str/int id per prompt (needed, and only read, with prompt_prior).
    `observe=False` skips step 1: the caller has already given this step's rewards (a superset
    of these rows) to `prior.observe`. Returns A [B, G] in the rewards' dtype and plain-float stats.
    """
    if not isinstance(prior, EBPrior):
        raise ValueError(f"ebpo_advantages: prior must be an EBPrior, got {type(prior).__name__}")
    g = group_stats(rewards, mask, "ebpo_advantages")
    B = g.R.shape[0]
    kid = None if keys is None else _key_ids(keys, B, g.R.device)
    pid = prior._prompt_ids(prompts, B, g.R.device)
    if observe:
        prior._observe(g, kid, pid)  # step 1

    # step 2: per-row (mu_glob, sigma2, tau2) from the row's key set (if it has min_count
    # observations) or the global one; row 0 of the table is the global set
    sets = [prior.glob] + ([prior._set_for(tg) for tg in kid.tags] if kid is not None else [])
    table = torch.tensor([prior._estimates_of(s) for s in sets], dtype=F64, device=g.R.device)
    row = kid.ids + 1 if kid is not None else torch.zeros(B, dtype=torch.long, device=g.R.device)
    mu, sigma2, tau2 = table[row].unbind(dim=1)  # [B] each
    keyed = torch.tensor([s is not prior.glob for s in sets], device=g.R.device)[row]  # [B]

    # prompt_prior: each prompt's posterior (centre, variance) from its earlier visits
    centre, spread = mu, tau2  # [B] each: what the group mean is shrunk toward, and its variance
    visits = torch.zeros(B, dtype=F64, device=g.R.device)  # [B]
    if pid is not None:
        history = prior.prompts.read(prior.step, [pid.tags[i] for i in pid.ids.tolist()])
        m, s = (torch.tensor(x, dtype=F64, device=g.R.device) for x in history)  # [B] each
        D = sigma2 + m * tau2  # [B]
        okD = D > S_DENOM_MIN  # [B]
        Dsafe = torch.where(okD, D, torch.ones_like(D))  # [B]
        centre = torch.where(okD, (sigma2 * mu + tau2 * s) / Dsafe, mu)  # [B]
        spread = torch.where(okD, sigma2 * tau2 / Dsafe, 0.0)  # [B]
        visits = m

    # step 3: shrinkage per row (one scalar without mask, keys or prompt history)
    n = (g.n - 1).clamp(min=1.0) if prior.leave_one_out else g.n  # [B] samples in the estimate
    noise = sigma2 / n  # [B]
    denom = noise + spread  # [B]
    big = denom > S_DENOM_MIN  # [B]
    S = torch.where(big, noise / torch.where(big, denom, torch.ones_like(denom)), 0.0)  # [B]

    # steps 4-6: baseline, raw advantage, batch whitening over the valid entries
    if prior.leave_one_out:
        mean_out = (g.n[:, None] * g.mean_g[:, None] - g.R) / n[:, None]  # [B, G] mean_-i
        V = (1 - S[:, None]) * mean_out + (S * centre)[:, None]  # [B, G]
    else:
        V = ((1 - S) * g.mean_g + S * centre)[:, None]  # [B, 1]
    A_raw = (g.R - V) * g.act  # [B, G]
    N = g.act.sum().to(F64).clamp(min=1.0)
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
        "frac_key_prior": avg(keyed.to(F64), 0.0),
        "n_keys": float(len(prior.by_key)),
        "groups_seen": float(prior.glob.acc["mu"].n),
    }
    if pid is not None:
        stats["prompt_visits"] = avg(visits, 0.0)
        stats["frac_prompt_seen"] = avg((visits > 0).to(F64), 0.0)
    return A.to(g.dtype), stats


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    prior: EBPrior | None = None,
    mask: torch.Tensor | None = None,
    keys: Sequence[Hashable] | None = None,
    grpo_scale: str = "group",
    observe: bool = True,
    prompts: Sequence[Hashable] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One switch for the trainer and the integrations: name in ESTIMATORS -> (A [B, G], stats).

    "ebpo" needs `prior` (updated in place unless `observe=False`, see ebpo_advantages) and uses
    `keys` and `prompts`; the others ignore prior, keys, prompts and observe and return
    stats = {}. `grpo_scale` is passed to grpo_advantages as `scale`.
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
        return ebpo_advantages(
            rewards, prior, mask=mask, keys=keys, observe=observe, prompts=prompts
        )
    raise ValueError(f"compute_advantages: name must be one of {ESTIMATORS}, got {name!r}")
