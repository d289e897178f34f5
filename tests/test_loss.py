"""Tests of ebpo_lite.algo.loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from ebpo_lite.algo.loss import (
    aggregate,
    k3_kl,
    masked_mean,
    microbatch_weight,
    policy_loss,
    token_entropy_from_logits,
    truncated_is_weights,
)

torch.set_num_threads(1)

# Two sequences of unequal length: 3 valid tokens and 2 valid tokens (T = 3).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([1.0, -2.0])


def on_policy(n: int = 2, t: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    logp = (-torch.rand(n, t, generator=torch.Generator().manual_seed(seed))).requires_grad_()
    return logp, logp.detach().clone()


def test_ratio_one_equal_lengths_gives_minus_mean_advantage():
    # ratio = 1 everywhere, so surr_t = A_i; token_mean with equal lengths = -mean(A)
    # A = [1, -2, 4] over 2 tokens each: -(2*1 + 2*(-2) + 2*4) / 6 = -(6/6) = -1 = -mean(A)
    logp, old = on_policy(3, 2)
    adv = torch.tensor([1.0, -2.0, 4.0])
    loss, stats = policy_loss(logp, old, adv, torch.ones(3, 2))
    assert loss.item() == pytest.approx(-adv.mean().item()) == pytest.approx(-1.0)
    assert stats["loss"] == pytest.approx(-1.0) and stats["pg_loss"] == pytest.approx(-1.0)
    assert stats["clip_frac"] == 0.0 and stats["kl"] == 0.0 and stats["ratio_mean"] == 1.0
    assert "is_ratio_mean" not in stats


@pytest.mark.parametrize(
    "agg, max_tokens, expected",
    [
        # per-token loss -A: seq 0 has 3 tokens of -1, seq 1 has 2 tokens of +2
        ("token_mean", None, (-3 + 4) / 5),  # = 0.2: tokens weighed equally
        ("seq_mean", None, (-1 + 2) / 2),  # = 0.5: per-seq means -1 and 2
        ("token_sum_norm", 4, (-3 + 4) / (2 * 4)),  # = 0.125: N * max_tokens = 8
        ("token_sum_norm", 3, (-3 + 4) / (2 * 3)),
    ],
)
def test_aggregations_on_unequal_lengths(agg, max_tokens, expected):
    logp, old = on_policy()
    loss, _ = policy_loss(logp, old, ADV, MASK, agg=agg, max_tokens=max_tokens)
    assert loss.item() == pytest.approx(expected)
    # gradient wrt logp at ratio 1 is -A_i * (aggregation weight of the token)
    loss.backward()
    weights = {
        "token_mean": torch.tensor([[1 / 5] * 3, [1 / 5, 1 / 5, 0]]),
        "seq_mean": torch.tensor([[1 / 6] * 3, [1 / 4, 1 / 4, 0]]),
        "token_sum_norm": torch.tensor([[1.0] * 3, [1.0, 1.0, 0]]) / (2 * (max_tokens or 1)),
    }[agg]
    torch.testing.assert_close(logp.grad, -ADV[:, None] * weights)


def ratios_case(eps_low: float, eps_high: float):
    """Six one-token sequences with chosen ratios and advantage signs."""
    ratio = torch.tensor([1.5, 1.2, 0.8, 0.8, 1.5, 0.95])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    old = torch.full((6, 1), -1.0)
    logp = (old + ratio.log()[:, None]).requires_grad_()
    loss, stats = policy_loss(
        logp, old, adv, torch.ones(6, 1), clip_eps_low=eps_low, clip_eps_high=eps_high
    )
    return ratio, adv, logp, loss, stats


def test_clipping_both_sides_asymmetric_values_and_zero_gradients():
    # eps_low = 0.1 -> lower bound 0.9; eps_high = 0.3 -> upper bound 1.3
    # A>0: r=1.5 clipped to 1.3 (active); r=1.2 inside; r=0.8 below -> min picks r*A (inactive)
    # A<0: r=0.8 -> min(-0.8, -0.9) = -0.9 (active); r=1.5 -> min(-1.5, -1.3) = -1.5; r=0.95 inside
    ratio, adv, logp, loss, stats = ratios_case(0.1, 0.3)
    surr = torch.tensor([1.3, 1.2, 0.8, -0.9, -1.5, -0.95])
    assert loss.item() == pytest.approx(-surr.mean().item(), abs=1e-6)  # = 0.008333
    assert stats["clip_frac_high"] == pytest.approx(1 / 6)
    assert stats["clip_frac_low"] == pytest.approx(1 / 6)
    assert stats["clip_frac"] == pytest.approx(2 / 6)
    loss.backward()
    # unclipped: d(-r*A/6)/dlogp = -A*r/6; clipped tokens: exactly 0
    active = torch.tensor([True, False, False, True, False, False])
    expected = torch.where(active, torch.zeros(6), -adv * ratio / 6)
    torch.testing.assert_close(logp.grad[:, 0], expected)
    assert (logp.grad[active] == 0).all() and (logp.grad[~active] != 0).all()


def test_clipping_symmetric_eps_changes_which_tokens_clip():
    # with eps 0.3 / 0.3: lower bound 0.7, so A<0, r=0.8 is no longer clipped; 1.5 > 1.3 still is
    _, _, _, _, stats = ratios_case(0.3, 0.3)
    assert stats["clip_frac_low"] == 0.0 and stats["clip_frac_high"] == pytest.approx(1 / 6)
    # with eps 0.1 / 0.1: upper bound 1.1 also clips A>0, r=1.2
    _, _, logp, loss, stats = ratios_case(0.1, 0.1)
    assert stats["clip_frac_high"] == pytest.approx(2 / 6)
    loss.backward()
    assert logp.grad[1, 0] == 0.0


def test_kl_k3_value_gradient_and_zero_at_reference():
    # d = ref - logp = ln 2: k3 = 2 - ln 2 - 1 = 0.306853; d = -ln 2: 0.5 + ln 2 - 1 = 0.193147
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[math.log(2), -math.log(2)]])
    k = k3_kl(logp, ref)
    torch.testing.assert_close(k, torch.tensor([[1 - math.log(2), math.log(2) - 0.5]]))
    adv = torch.zeros(1)  # no policy-gradient term: the loss is the KL term alone
    loss, stats = policy_loss(logp, logp.detach(), adv, torch.ones(1, 2), ref_logp=ref, kl_coef=0.5)
    assert stats["kl"] == pytest.approx(0.25)  # mean of the two k3 values = (0.30685+0.19315)/2
    assert loss.item() == pytest.approx(0.5 * 0.25)
    loss.backward()
    # d k3 / d logp = 1 - exp(d), times kl_coef / 2 tokens
    torch.testing.assert_close(logp.grad, 0.25 * torch.tensor([[1 - 2.0, 1 - 0.5]]))
    # at the reference the KL and its term vanish; with kl_coef 0 the stat is kept, the term is not
    logp2, old2 = on_policy()
    _, s0 = policy_loss(logp2, old2, ADV, MASK, ref_logp=old2, kl_coef=1.0)
    assert s0["kl"] == 0.0
    l1, s1 = policy_loss(logp2, old2, ADV, MASK, ref_logp=old2 + 1.0, kl_coef=0.0)
    assert s1["kl"] == pytest.approx(math.e - 2) and l1.item() == pytest.approx(0.2)


def test_sequence_is_weight_uses_the_mean_log_ratio():
    # per-token log-ratio old - sampler = 0.1 on a 4-token and a 2-token sequence: both get exp(0.1)
    # (the sum would give exp(0.4) and exp(0.2))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    old = torch.full((2, 4), -1.0)
    sampler = old - 0.1
    sampler[1, 2:] = float("nan")  # padding garbage never enters
    w = truncated_is_weights(old, torch.where(mask, sampler, 0.0), mask.float(), "sequence", 5.0)
    torch.testing.assert_close(w[:, 0], torch.full((2,), math.exp(0.1)))
    logp = old.clone().requires_grad_()
    loss, stats = policy_loss(
        logp,
        old,
        torch.ones(2),
        mask,
        agg="seq_mean",
        sampler_logp=sampler,
        is_correction="sequence",
    )
    assert loss.item() == pytest.approx(-math.exp(0.1))  # both sequences weighed exp(0.1)
    assert stats["is_weight_mean"] == pytest.approx(math.exp(0.1))
    assert stats["logp_diff_mean"] == pytest.approx(0.1)
    assert stats["logp_diff_max"] == pytest.approx(0.1)
    assert stats["is_ratio_min"] == pytest.approx(math.exp(0.1))


def test_token_is_weights_cap_and_stats():
    # log-ratios per token: 0, ln 1.5, ln 3 (capped to 2), -ln 2 -> weights 1, 1.5, 2, 0.5
    old = torch.zeros(1, 4)
    sampler = -torch.tensor([[0.0, math.log(1.5), math.log(3.0), -math.log(2.0)]])
    logp = old.clone().requires_grad_()
    loss, stats = policy_loss(
        logp, old, torch.ones(1), torch.ones(1, 4), sampler_logp=sampler, is_correction="token"
    )
    assert loss.item() == pytest.approx(-(1 + 1.5 + 2 + 0.5) / 4)
    assert stats["is_ratio_min"] == pytest.approx(0.5)
    assert stats["is_ratio_max"] == pytest.approx(3.0)  # untruncated
    assert stats["is_ratio_mean"] == pytest.approx((1 + 1.5 + 3 + 0.5) / 4)
    assert stats["is_weight_mean"] == pytest.approx((1 + 1.5 + 2 + 0.5) / 4)
    assert stats["logp_diff_max"] == pytest.approx(math.log(3.0))
    loss.backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([[1.0, 1.5, 2.0, 0.5]]) / 4)
    # sequence cap: mean log-ratio ln 3 -> exp = 3, capped at 2
    w = truncated_is_weights(old, old - math.log(3.0), torch.ones(1, 4), "sequence", 2.0)
    assert (w == 2.0).all()


def test_is_mode_none_measures_but_does_not_reweight():
    logp, old = on_policy()
    base, _ = policy_loss(logp, old, ADV, MASK)
    loss, stats = policy_loss(logp, old, ADV, MASK, sampler_logp=old - 1.0)
    assert loss.item() == pytest.approx(base.item())
    assert stats["is_weight_mean"] == 1.0 and stats["is_ratio_mean"] == pytest.approx(math.e)


def test_padding_values_are_ignored_and_empty_mask_is_harmless():
    logp, old = on_policy()
    junk = logp.detach().clone()
    junk[1, 2] = float("-inf")  # a padding position
    loss, stats = policy_loss(logp, old, ADV, MASK, ref_logp=junk, sampler_logp=junk, kl_coef=0.1)
    assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in stats.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1, 2] == 0.0
    empty = torch.zeros(2, 3, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, ADV, empty, sampler_logp=old, is_correction="token")
    assert loss.item() == 0.0
    assert stats["is_ratio_min"] == stats["is_ratio_max"] == stats["ratio_mean"] == 1.0
    assert stats["logp_diff_max"] == 0.0 and stats["clip_frac"] == 0.0


def test_microbatch_weights_recover_the_full_batch_loss():
    torch.manual_seed(0)
    n, t = 6, 5
    logp = torch.randn(n, t) * 0.1 - 1
    old = logp + torch.randn(n, t) * 0.05
    adv = torch.randn(n)
    mask = torch.arange(t)[None, :] < torch.tensor([5, 1, 3, 4, 2, 5])[:, None]
    for agg in ("token_mean", "seq_mean", "token_sum_norm"):
        full, _ = policy_loss(logp, old, adv, mask, agg=agg, max_tokens=t)
        parts = 0.0
        for sl in (slice(0, 2), slice(2, 6)):
            part, _ = policy_loss(logp[sl], old[sl], adv[sl], mask[sl], agg=agg, max_tokens=t)
            k_tokens, k_seqs = mask[sl].sum().item(), mask[sl].shape[0]
            parts += part.item() * microbatch_weight(agg, k_tokens, k_seqs, mask.sum().item(), n)
        assert parts == pytest.approx(full.item(), rel=1e-5), agg
    with pytest.raises(ValueError, match="agg"):
        microbatch_weight("sum", 1, 1, 1, 1)


def test_helpers_masked_mean_entropy_aggregate():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 5 + 7) / 4)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 6.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    # uniform over 4 -> ln 4; one-hot (large logit gap) -> ~0; two equal + two -inf -> ln 2
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    expected = torch.tensor([[math.log(4), 0.0]])
    torch.testing.assert_close(token_entropy_from_logits(logits), expected)
    h = token_entropy_from_logits(torch.tensor([[[1.0, 1.0, -1e9, -1e9]]], dtype=torch.bfloat16))
    assert h.dtype == torch.float32 and h.item() == pytest.approx(math.log(2), abs=1e-6)
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(x, mask, "token_sum_norm")
    with pytest.raises(ValueError, match="agg"):
        aggregate(x, mask, "sum")
    with pytest.raises(ValueError, match="is_correction"):
        truncated_is_weights(x, x, mask, "none", 2.0)


def test_bf16_inputs_are_computed_in_float32():
    logp, old = on_policy()
    loss, _ = policy_loss(logp.bfloat16(), old.bfloat16(), ADV, MASK)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(0.2)


def test_errors_name_the_argument():
    logp, old = on_policy()
    cases = [
        ({"logp": logp[0]}, "logp"),
        ({"old_logp": old[:, :2]}, "old_logp"),
        ({"mask": MASK[:1]}, "mask"),
        ({"adv": ADV[:, None]}, "adv"),
        ({"ref_logp": old.T}, "ref_logp"),
        ({"sampler_logp": old[:1]}, "sampler_logp"),
        ({"clip_eps_low": -0.1}, "clip_eps_low"),
        ({"agg": "sum"}, "agg"),
        ({"agg": "token_sum_norm"}, "max_tokens"),
        ({"agg": "token_sum_norm", "max_tokens": 2}, "max_tokens"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"is_correction": "seq"}, "is_correction"),
        ({"is_correction": "token"}, "sampler_logp"),
        ({"is_cap": 0.0}, "is_cap"),
    ]
    for override, name in cases:
        args = {"logp": logp, "old_logp": old, "adv": ADV, "mask": MASK, **override}
        with pytest.raises(ValueError, match=name):
            policy_loss(**args)
