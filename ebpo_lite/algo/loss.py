"""The policy loss: the TRL 1.16 loss menu, token aggregation, KL, truncated importance sampling.

Pure math on tensors: no config, no model. The trainer computes log-probs and advantages and calls
`policy_loss`; the per-token losses of each `loss_type` live in `loss_types.py`, and
docs/losses.md states every formula, its TRL name and where this code departs from TRL.

Notation
- N sequences (completions; B prompts x G in the trainer), T completion-token positions (padded).
- `logp` [N, T]: log pi_theta(y_t | ...) of the sampled tokens under the current policy (with grad).
- `old_logp` [N, T]: the same under the trainer's policy at rollout time (detached; equals
  `logp.detach()` when each rollout batch is used once, `num_iterations = 1`).
- `sampler_logp` [N, T]: the same as reported by the sampler that generated the tokens (vLLM).
- `ref_logp` [N, T]: the same under the reference (the adapter-disabled base policy).
- `adv` [N]: one advantage per sequence, broadcast over its tokens.
- `mask` [N, T]: 1 on completion tokens, 0 on padding (bool or float; a float mask weights tokens).
- r_t = exp(logp - old_logp), the PPO ratio (GSPO's sequence ratio with
  `importance_sampling_level="sequence"`); A = adv.

Per token (all detached except `logp`), for the default `loss_type="dapo"`:
    surr_t = min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)     DAPO's asymmetric clip
    w_t    = min(exp(old_logp - sampler_logp), is_cap)                   truncated IS ("TIS")
    l_t    = -w_t * surr_t * e_t       e_t: 1, or the top-entropy mask (`top_entropy_quantile`)
    kl_t   = exp(ref_logp - logp) - (ref_logp - logp) - 1                 Schulman's k3, >= 0
    loss   = agg(l) + kl_coef * agg(kl)
Other `loss_type`s replace -surr_t (loss_types.py) and pick their own `agg` (TRL's), which the
`agg` argument can override. Aggregations `agg(x)` over valid tokens:
    token_mean:     sum_{i,t} m x / sum_{i,t} m         (DAPO; long sequences weigh more)
    seq_mean:       mean_i [ sum_t m x / sum_t m ]       (GRPO paper; sequences with no valid
                                                          token count as 0 in the mean over all N,
                                                          as TRL)
    token_sum_norm: sum_{i,t} m x / (N * max_tokens)     (Dr. GRPO's constant normaliser; TRL's
                                                          loss_type="dr_grpo". `dr_grpo` names only
                                                          the advantage estimator here)
    seq_sum:        mean_i [ sum_t m x ]                 (LUSPO: each sequence weighed by length)

Sampler / trainer mismatch (`is_correction`): vLLM's log-probs differ from the trainer's, so the rollout
is slightly off-policy. Following Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training" (2025) and verl's TIS, the surrogate of each token is multiplied by the
truncated, detached ratio w. `"token"`: w per token. `"sequence"`: one w per sequence from the MEAN
of its per-token log-ratios over valid tokens, exp'd and capped, broadcast over its tokens. The
exact sequence ratio is the product (the sum of log-ratios); we use the geometric mean on purpose:
the sum shrinks or grows with length, so a long sequence's weight is driven to 0 or to the cap by
small per-token gaps (the deflation of long sequences in TRL's sequence mode). The geometric mean is
biased but comparable across lengths. `"none"`: no correction (the mismatch is still measured when
`sampler_logp` is given).

Gradient accumulation: each aggregation is a mean over the micro-batch. To get the loss of the whole
batch, scale each micro-batch's loss by `microbatch_weight(...)` (from token / sequence counts) and
sum. One exception: `top_entropy_quantile < 1` takes its entropy threshold over the micro-batch it
is given, as TRL takes it over one device's micro-batch.

Departures: the EBPO paper trains with verl and does not state the clip epsilon or the aggregation
(docs/algorithm.md section 8); both are options here, defaulting to eps 0.2 / 0.2 and token_mean.
Padding positions are zeroed before any arithmetic, so non-finite padding values are harmless.
"""

from __future__ import annotations

import torch

from ebpo_lite.algo import loss_types as lt

AGGREGATIONS = ("token_mean", "seq_mean", "token_sum_norm", "seq_sum")
IS_MODES = ("none", "token", "sequence")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` (bool or float weights) is set, over `dim` (all if None).

    Entries outside the mask never enter (even if NaN); an empty mask gives 0.
    """
    m = mask.to(x.dtype)
    num = torch.where(mask.bool(), x, torch.zeros_like(x)) * m
    if dim is None:
        return num.sum() / m.sum().clamp_min(1e-8)
    return num.sum(dim) / m.sum(dim).clamp_min(1e-8)


def token_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: `[N, T, V] -> [N, T]`, computed in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, T, V]
    return -(logp.exp() * logp).sum(dim=-1)  # [N, T]


def aggregate(
    x: torch.Tensor, mask: torch.Tensor, agg: str, max_tokens: int | None = None
) -> torch.Tensor:
    """Reduce per-token values `x` [N, T] over the valid tokens of `mask` [N, T] to a scalar."""
    m = mask.to(x.dtype)  # [N, T]
    if agg == "token_mean":
        return (x * m).sum() / m.sum().clamp_min(1e-8)
    if agg == "seq_mean":
        per_seq = (x * m).sum(dim=1) / m.sum(dim=1).clamp_min(1e-8)  # [N]
        return per_seq.mean()
    if agg == "seq_sum":
        return (x * m).sum(dim=1).mean()
    if agg == "token_sum_norm":
        if max_tokens is None or max_tokens < 1:
            raise ValueError(
                f"max_tokens: token_sum_norm needs a constant normaliser >= 1, got {max_tokens}"
            )
        return (x * m).sum() / (x.shape[0] * max_tokens)
    raise ValueError(f"agg: unknown aggregation {agg!r}; expected one of {', '.join(AGGREGATIONS)}")


def drop_truncated(mask: torch.Tensor, finished: list[bool]) -> torch.Tensor:
    """DAPO's overlong filtering (TRL's `mask_truncated_completions`): `mask` [N, T] with the rows
    of completions that ended without a stop id (`finished[i]` False) zeroed, so they leave the
    loss and its token count. Their rewards still reach the advantages (docs/losses.md)."""
    done = torch.tensor([float(f) for f in finished], dtype=mask.dtype, device=mask.device)
    return mask * done[:, None]  # [N, T]


def microbatch_weight(
    agg: str, tokens: float, seqs: int, total_tokens: float, total_seqs: int
) -> float:
    """Factor for one micro-batch's loss so that the weighted sum equals the whole batch's loss.

    `tokens` (the sum of the micro-batch's mask) and `seqs` (its n) describe the micro-batch,
    `total_tokens` and `total_seqs` the whole batch; plain numbers, so the trainer can count them
    on the host without a device sync. token_mean: tokens / total_tokens; seq_mean, seq_sum and
    token_sum_norm: seqs / total_seqs.
    """
    if agg == "token_mean":
        return float(tokens) / max(float(total_tokens), 1e-8)
    if agg in ("seq_mean", "seq_sum", "token_sum_norm"):
        return seqs / max(total_seqs, 1)
    raise ValueError(f"agg: unknown aggregation {agg!r}; expected one of {', '.join(AGGREGATIONS)}")


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi || ref) per token: exp(d) - d - 1 with d = ref - logp."""
    return lt.kl_estimate(logp, ref_logp, "k3")


def truncated_is_weights(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    """Detached weights min(ratio, cap), `[N, T]`, ratio = pi_trainer / pi_sampler (module doc)."""
    log_ratio = (old_logp - sampler_logp).detach()  # [N, T]
    if mode == "token":
        w = torch.exp(log_ratio)  # [N, T]
    elif mode == "sequence":
        w = torch.exp(masked_mean(log_ratio, mask, dim=1))[:, None].expand_as(log_ratio)  # [N, T]
    else:
        raise ValueError(f"is_correction: expected 'token' or 'sequence' here, got {mode!r}")
    return w.clamp(max=cap)


def _check(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    others: dict[str, torch.Tensor | None],
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp: expected [N, T], got shape {tuple(logp.shape)}")
    for name, t in {"old_logp": old_logp, "mask": mask, **others}.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} differs from logp {tuple(logp.shape)}"
            )
    if adv.shape != logp.shape[:1]:
        raise ValueError(f"adv: expected [N] = [{logp.shape[0]}], got shape {tuple(adv.shape)}")


def _check_options(
    eps_low: float, eps_high: float, agg: str, kl_coef: float, is_correction: str, is_cap: float
) -> None:
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip_eps_low / clip_eps_high: must be >= 0, got {eps_low}, {eps_high}")
    if agg not in AGGREGATIONS:
        raise ValueError(
            f"agg: unknown aggregation {agg!r}; expected one of {', '.join(AGGREGATIONS)}"
        )
    if kl_coef < 0:
        raise ValueError(f"kl_coef: must be >= 0, got {kl_coef}")
    if is_correction not in IS_MODES:
        raise ValueError(
            f"is_correction: expected one of {', '.join(IS_MODES)}, got {is_correction!r}"
        )
    if not is_cap > 0:
        raise ValueError(f"is_cap: must be > 0, got {is_cap}")


def per_token_loss(
    loss_type: str,
    new: torch.Tensor,
    old: torch.Tensor,
    a: torch.Tensor,
    m: torch.Tensor,
    coef: torch.Tensor,
    opts: dict,
    log_is: torch.Tensor | None,
) -> torch.Tensor:
    """l_t [N, T] of `loss_type` (loss_types.py) before masks and weights; `coef` is the ratio."""
    if loss_type in lt.CLIPPED:
        return lt.clipped_surrogate(
            coef, a, opts["clip_eps_low"], opts["clip_eps_high"], opts.get("delta")
        )
    if loss_type == "cispo":  # MiniMax-M1's bound 1 + eps_high (TRL: the cap is epsilon_high)
        return lt.cispo(coef, new, a, 1.0 + opts["clip_eps_high"])
    if loss_type == "sapo":
        return lt.sapo(coef, a, opts["sapo_temperature_pos"], opts["sapo_temperature_neg"])
    if loss_type == "vespo":
        phi = lt.gamma_weights(new - old, a, m, log_is, *opts["vespo"])  # [N, 1]
        return lt.vespo(phi, new, a)
    raise ValueError(f"loss_type: expected one of {', '.join(lt.LOSS_TYPES)}, got {loss_type!r}")


DEFAULT_OPTIONS = {
    "clip_eps_low": 0.2,
    "clip_eps_high": 0.2,
    "delta": None,  # two-sided clip of the ratio (clipped losses)
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo": (2.0, 3.0, 3.0, 2.0),  # k_pos, lambda_pos, k_neg, lambda_neg (TRL's defaults)
}


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    agg: str | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    importance_sampling_level: str = "token",
    options: dict | None = None,
    entropy: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    use_bias_correction_kl: bool = False,
    sampler_logp: torch.Tensor | None = None,
    is_correction: str = "none",
    is_cap: float = 2.0,
    max_tokens: int | None = None,
    sync_stats: bool = True,
) -> tuple[torch.Tensor, dict]:
    """The policy loss (scalar, differentiable in `logp`) and plain-float stats (one device
    sync); `sync_stats=False` leaves them as 0-d tensors on `logp`'s device, for a caller that
    syncs once over many micro-batches.

    See the module docstring for the formulas. `agg` None: `loss_type`'s own aggregation
    (`loss_types.AGGREGATION`). `options`: `delta`, the SAPO temperatures and VESPO's
    (k_pos, lambda_pos, k_neg, lambda_neg), defaults `DEFAULT_OPTIONS`. `entropy` [N, T] is
    needed when `top_entropy_quantile < 1`. `use_bias_correction_kl` multiplies each token's KL
    by its ratio (TRL's option of that name). Stats: `loss`, `pg_loss`, `kl` (mean per-token
    estimate over valid tokens; 0 without `ref_logp`), `clip_frac` (= `clip_frac_low` +
    `clip_frac_high`, fraction of valid tokens whose ratio lies past the clip bound on the side
    that matters for their advantage; CISPO: past its cap), `ratio_mean` (of r_t); with
    `sampler_logp` also `is_ratio_min/mean/max` (untruncated per-token exp(old_logp -
    sampler_logp)), `is_weight_mean` (applied weights; 1 with is_correction none),
    `logp_diff_mean/max` (|sampler_logp - old_logp|). Over an empty mask ratios read 1 and
    differences 0.
    """
    _check(logp, old_logp, adv, mask, {"ref_logp": ref_logp, "sampler_logp": sampler_logp})
    agg = lt.AGGREGATION.get(loss_type, "token_mean") if agg is None else agg
    _check_options(clip_eps_low, clip_eps_high, agg, kl_coef, is_correction, is_cap)
    opts = {**DEFAULT_OPTIONS, **(options or {})}
    opts.update(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    if is_correction != "none" and sampler_logp is None:
        raise ValueError(
            f"sampler_logp: is_correction={is_correction!r} needs the sampler's log-probs"
        )
    if agg == "token_sum_norm" and (max_tokens is None or max_tokens < logp.shape[1]):
        raise ValueError(
            f"max_tokens: token_sum_norm needs a constant normaliser >= the {logp.shape[1]} token "
            f"positions (the rollout's max_new_tokens), got {max_tokens}"
        )
    if top_entropy_quantile < 1.0 and entropy is None:
        raise ValueError("entropy: top_entropy_quantile < 1 needs the per-token entropies")

    valid = mask.bool()  # [N, T]
    m = mask.float() * valid  # [N, T]

    def clean(t: torch.Tensor) -> torch.Tensor:  # zero padding, float32
        return torch.where(valid, t.float(), torch.zeros((), device=t.device))

    new = clean(logp)  # [N, T] carries the gradient
    old = clean(old_logp.detach())  # [N, T]
    a = adv.detach().float()[:, None]  # [N, 1]
    coef = torch.exp(lt.log_importance_weights(new, old, m, importance_sampling_level))  # [N, T]
    w = None  # truncated IS weights [N, T]
    if is_correction != "none":
        w = truncated_is_weights(old, clean(sampler_logp.detach()), m, is_correction, is_cap)
    log_is = torch.log(w) if (w is not None and loss_type == "vespo") else None
    per_tok = per_token_loss(loss_type, new, old, a, m, coef, opts, log_is)  # [N, T]
    if top_entropy_quantile < 1.0:
        per_tok = per_tok * lt.high_entropy_mask(clean(entropy.detach()), m, top_entropy_quantile)
    if w is not None and loss_type != "vespo":  # VESPO folds the weights into its phi (TRL)
        per_tok = per_tok * w
    pg_loss = aggregate(per_tok, m, agg, max_tokens)
    loss = pg_loss

    kl_tok = None  # [N, T]
    if ref_logp is not None:
        kl_tok = lt.kl_estimate(new, clean(ref_logp.detach()), kl_estimator)
        if use_bias_correction_kl:
            kl_tok = kl_tok * coef
    if kl_tok is not None and kl_coef > 0:
        loss = loss + kl_coef * aggregate(kl_tok, m, agg, max_tokens)

    with torch.no_grad():
        if loss_type == "cispo":
            low = torch.zeros_like(valid)
            high = valid & (a > 0) & (coef > 1.0 + clip_eps_high)  # [N, T]
        else:
            low = valid & (a < 0) & (coef < 1.0 - clip_eps_low)  # [N, T]
            high = valid & (a > 0) & (coef > 1.0 + clip_eps_high)  # [N, T]
        names = ["loss", "pg_loss", "kl", "clip_frac", "clip_frac_low", "clip_frac_high"]
        values = [
            loss.detach(),
            pg_loss.detach(),
            masked_mean(kl_tok, valid) if kl_tok is not None else torch.zeros(()),
            masked_mean((low | high).float(), valid),
            masked_mean(low.float(), valid),
            masked_mean(high.float(), valid),
        ]
        names.append("ratio_mean")
        values.append(_or_default(masked_mean(coef, valid), valid, 1.0))
        if sampler_logp is not None:
            more = _mismatch_stats(
                old, clean(sampler_logp.detach()), m, valid, is_correction, is_cap
            )
            names += list(more)
            values += list(more.values())
        flat = torch.stack([v.float().reshape(()).to(logp.device) for v in values])
        stats = dict(zip(names, flat.tolist() if sync_stats else flat.unbind()))
    return loss, stats


def _mismatch_stats(
    old: torch.Tensor,
    sampler: torch.Tensor,
    m: torch.Tensor,
    valid: torch.Tensor,
    is_correction: str,
    is_cap: float,
) -> dict[str, torch.Tensor]:
    """Importance ratios and |log-prob gaps| between trainer and sampler over valid tokens."""
    log_ratio = old - sampler  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    diff = log_ratio.abs()  # [N, T] 0 on padding
    if is_correction == "none":
        weight = torch.ones((), device=old.device)
    else:
        weight = masked_mean(truncated_is_weights(old, sampler, m, is_correction, is_cap), valid)
    inf = torch.tensor(float("inf"), device=old.device)
    return {
        "is_ratio_min": _or_default(torch.where(valid, ratio, inf).amin(), valid, 1.0),
        "is_ratio_mean": _or_default(masked_mean(ratio, valid), valid, 1.0),
        "is_ratio_max": _or_default(torch.where(valid, ratio, -inf).amax(), valid, 1.0),
        "is_weight_mean": _or_default(weight, valid, 1.0),
        "logp_diff_mean": masked_mean(diff, valid),
        "logp_diff_max": diff.amax(),
    }


def _or_default(x: torch.Tensor, valid: torch.Tensor, default: float) -> torch.Tensor:
    """`x`, or `default` when no token is valid (without a device sync)."""
    return torch.where(valid.any(), x, torch.full_like(x, default))
