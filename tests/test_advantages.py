"""Tests of ebpo_lite.algo.advantages against hand-computed values, a brute-force reference and the
properties of docs/algorithm.md sections 2-4."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ebpo_lite.algo.advantages import (
    ESTIMATORS,
    EBPrior,
    Welford,
    compute_advantages,
    dr_grpo_advantages,
    ebpo_advantages,
    frac_zero_std_groups,
    grpo_advantages,
    rloo_advantages,
)

torch.set_num_threads(1)
F64 = torch.float64
SETTINGS = settings(max_examples=40, deadline=None)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ---------------------------------------------------------------------------------------------
# Strategies


@st.composite
def reward_matrix(draw, binary=None, min_b=1, max_b=6, min_g=2, max_g=6, g=None):
    B = draw(st.integers(min_b, max_b))
    G = g if g is not None else draw(st.integers(min_g, max_g))
    is_bin = draw(st.booleans()) if binary is None else binary
    vals = st.sampled_from([0.0, 1.0]) if is_bin else st.floats(-3, 3, allow_nan=False, width=32)
    return t(draw(st.lists(st.lists(vals, min_size=G, max_size=G), min_size=B, max_size=B)))


@st.composite
def masked_matrix(draw):
    R = draw(reward_matrix())
    B, G = R.shape
    bits = draw(st.lists(st.booleans(), min_size=B * G, max_size=B * G))
    return R, torch.tensor(bits, dtype=torch.bool).reshape(B, G)


# ---------------------------------------------------------------------------------------------
# Baselines: hand-computed


def test_grpo_group_hand():
    # row [1, 0, 0, 1]: mean 1/2, Bessel var = 4 * (1/4) / 3 = 1/3, std = sqrt(1/3)
    # row [2, 2, 2, 2]: centred 0 -> A = 0
    A = grpo_advantages(t([[1, 0, 0, 1], [2, 2, 2, 2]]))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert torch.allclose(A, t([[a, -a, -a, a], [0, 0, 0, 0]]), atol=1e-12)


def test_grpo_batch_and_none_hand():
    # R = [[1, 0], [1, 1]]: group means 1/2, 1; batch mean 3/4, Bessel var over 4 values =
    # (3 * 1/16 + 9/16) / 3 = 1/4, std 1/2 -> A = [[0.5, -0.5], [0, 0]] / (0.5 + 1e-4)
    R = t([[1, 0], [1, 1]])
    A = grpo_advantages(R, scale="batch")
    a = 0.5 / (0.5 + 1e-4)
    assert torch.allclose(A, t([[a, -a], [0, 0]]), atol=1e-12)
    assert torch.allclose(grpo_advantages(R, scale="none"), t([[0.5, -0.5], [0, 0]]))


def test_dr_grpo_and_rloo_hand():
    # row [3, 0, 0]: mean 1 -> Dr. GRPO [2, -1, -1]; RLOO: 3 - 0 = 3, 0 - 3/2 = -1.5 (x2)
    R = t([[3, 0, 0]])
    assert torch.allclose(dr_grpo_advantages(R), t([[2, -1, -1]]))
    assert torch.allclose(rloo_advantages(R), t([[3, -1.5, -1.5]]))


@SETTINGS
@given(masked_matrix())
def test_rloo_is_scaled_dr_grpo(Rm):
    R, M = Rm
    n = M.sum(1, keepdim=True).to(F64)  # [B, 1]
    scale = torch.where(n >= 2, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    assert torch.allclose(rloo_advantages(R, mask=M), scale * dr_grpo_advantages(R, mask=M))
    G = R.shape[1]
    assert torch.allclose(rloo_advantages(R), G / (G - 1) * dr_grpo_advantages(R))


@SETTINGS
@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=5), st.integers(2, 6))
def test_constant_rows_give_zero(levels, G):
    R = t([[v] * G for v in levels])
    for scale in ("group", "batch", "none"):
        assert torch.equal(grpo_advantages(R, scale=scale), torch.zeros_like(R))
    assert torch.equal(dr_grpo_advantages(R), torch.zeros_like(R))
    assert torch.equal(rloo_advantages(R), torch.zeros_like(R))
    assert frac_zero_std_groups(R) == 1.0


def test_frac_zero_std_groups():
    R = t([[1, 1, 1], [0, 1, 0], [0, 0, 5], [2, 2, 9]])
    M = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    # valid rows: 0 (all 1), 1 (mixed), 3 ([2, 2] after mask); row 2 has one entry
    assert frac_zero_std_groups(R, M) == pytest.approx(2 / 3)
    assert frac_zero_std_groups(R, torch.zeros(4, 3, dtype=torch.bool)) == 0.0


# ---------------------------------------------------------------------------------------------
# EBPO: hand-computed


def test_ebpo_paper_two_steps_hand():
    p = EBPrior()
    # step 1, R = [[1, 0], [1, 1]]: W_r {1,0,1,1}: mean 3/4, var 3/16; W_mu {1/2, 1}: var 1/16
    # S = (3/16 / 2) / (3/32 + 1/16) = 0.6; V = [.4*.5 + .6*.75, .4 + .45] = [.65, .85]
    # A_raw = [[.35, -.65], [.15, .15]], mean 0, pop std sqrt(.59 / 4)
    A, s = ebpo_advantages(t([[1, 0], [1, 1]]), p)
    std = math.sqrt(0.59 / 4)
    assert s["shrinkage"] == pytest.approx(0.6)
    assert (s["mu_glob"], s["sigma2"], s["tau2"]) == pytest.approx((0.75, 3 / 16, 1 / 16))
    assert s["raw_std"] == pytest.approx(std)
    assert torch.allclose(A, t([[0.35, -0.65], [0.15, 0.15]]) / (std + 1e-6), atol=1e-12)
    # step 2, R = [[0, 0], [0, 1]]: W_r 8 values, mean 1/2, var 1/4; W_mu {.5, 1, 0, .5}: var 1/8
    # S = (1/8) / (1/8 + 1/8) = 1/2; V = [.25, .5]; A_raw = [[-.25, -.25], [-.5, .5]]
    # mean -1/8; centred [[-1/8, -1/8], [-3/8, 5/8]]; pop std sqrt(.5625 / 4) = 3/8
    A, s = ebpo_advantages(t([[0, 0], [0, 1]]), p)
    assert (s["shrinkage"], s["mu_glob"], s["sigma2"], s["tau2"]) == pytest.approx(
        (0.5, 0.5, 0.25, 0.125)
    )
    assert torch.allclose(A, t([[-1 / 8, -1 / 8], [-3 / 8, 5 / 8]]) / (3 / 8 + 1e-6), atol=1e-12)
    assert s["groups_seen"] == 4.0


def test_ebpo_center_false_hand():
    p = EBPrior(center=False)
    ebpo_advantages(t([[1, 0], [1, 1]]), p)
    # same step 2 as above: A = A_raw / (3/8 + 1e-6); the all-fail row gets -S mu / std = -2/3
    A, s = ebpo_advantages(t([[0, 0], [0, 1]]), p)
    assert torch.allclose(A, t([[-0.25, -0.25], [-0.5, 0.5]]) / (3 / 8 + 1e-6), atol=1e-12)
    assert A[0, 0].item() == pytest.approx(-0.5 * 0.5 / 0.375, rel=1e-5)


def test_ebpo_moments_and_within_hand():
    R = t([[1, 1], [0, 0], [1, 0]])
    # W_mu {1, 0, 1/2}: var 1/6; within (unbiased) {0, 0, 1/2}: mean 1/6; 1/n = 1/2
    # moments: tau2 = 1/6 - (1/6)(1/2) = 1/12; W_r: mean 1/2, var 1/4
    # total: S = (1/8) / (1/8 + 1/12) = 0.6; within: S = (1/12) / (1/12 + 1/12) = 0.5
    _, s = ebpo_advantages(R, EBPrior(tau2="moments"))
    assert (s["tau2"], s["sigma2"], s["shrinkage"]) == pytest.approx((1 / 12, 0.25, 0.6))
    _, s = ebpo_advantages(R, EBPrior(tau2="moments", sigma2="within"))
    assert (s["tau2"], s["sigma2"], s["shrinkage"]) == pytest.approx((1 / 12, 1 / 6, 0.5))
    # raw tau2 with sigma2 within: S = (1/12) / (1/12 + 1/6) = 1/3
    _, s = ebpo_advantages(R, EBPrior(sigma2="within"))
    assert s["shrinkage"] == pytest.approx(1 / 3)
    # moments clamps at tau2_min: R = [[1, 0], [1, 1]] gives 1/16 - (1/4)(1/2) < 0
    _, s = ebpo_advantages(t([[1, 0], [1, 1]]), EBPrior(tau2="moments", tau2_min=1e-3))
    assert s["tau2"] == 1e-3
    assert s["shrinkage"] == pytest.approx((3 / 32) / (3 / 32 + 1e-3))


def test_ebpo_decay_hand():
    # gamma = 1/2: step 1 [[0, 0]] (weight 1/2 each), step 2 [[1, 1]] (weight 1 each)
    # W_r: mean (2 * 1) / 3 = 2/3, var (1 * 4/9 + 2 * 1/9) / 3 = 2/9
    # W_mu: {0 (w 1/2), 1 (w 1)}: mean 2/3, var (1/2 * 4/9 + 1/9) / (3/2) = 2/9
    # S = (2/9 / 2) / (1/9 + 2/9) = 1/3
    p = EBPrior(decay=0.5)
    ebpo_advantages(t([[0, 0]]), p)
    _, s = ebpo_advantages(t([[1, 1]]), p)
    assert (s["mu_glob"], s["sigma2"], s["tau2"], s["shrinkage"]) == pytest.approx(
        (2 / 3, 2 / 9, 2 / 9, 1 / 3)
    )
    # a step with no valid row moves the clock: the old weights then decay by 1/2 twice
    p = EBPrior(decay=0.5)
    ebpo_advantages(t([[0, 0]]), p)
    A, _ = ebpo_advantages(t([[5, 5]]), p, mask=torch.tensor([[True, False]]))
    assert torch.equal(A, torch.zeros(1, 2, dtype=F64)) and p.step == 2
    _, s = ebpo_advantages(t([[1, 1]]), p)  # weights 1/4 (x2) and 1 (x2): mean 2 / 2.5 = 0.8
    assert s["mu_glob"] == pytest.approx(0.8)


def test_ebpo_keys_fallback_hand():
    p = EBPrior(min_count=2)
    # step 1: keys "a" and 1 have one group each (< 2): both rows use the global prior
    _, s = ebpo_advantages(t([[0, 1], [1, 1]]), p, keys=["a", 1])
    assert s["frac_key_prior"] == 0.0 and s["mu_glob"] == pytest.approx(0.75)
    # step 2: both rows "a"; key a has 3 groups -> its own prior
    # key a rewards {0,1,0,1,1,1}: mean 2/3, var 2/9; group means {.5,.5,1}: var 1/18
    _, s = ebpo_advantages(t([[0, 1], [1, 1]]), p, keys=["a", "a"])
    assert s["frac_key_prior"] == 1.0
    assert (s["mu_glob"], s["sigma2"], s["tau2"]) == pytest.approx((2 / 3, 2 / 9, 1 / 18))
    assert s["shrinkage"] == pytest.approx((1 / 9) / (1 / 9 + 1 / 18))
    assert p.key_counts() == {"a": 3, 1: 1}
    # global always updated: 4 groups; key 1 still falls back to the global estimates
    assert s["groups_seen"] == 4.0 and s["n_keys"] == 2.0
    assert p.estimates(1) == p.estimates(None) != p.estimates("a")


def test_keys_type_safe_and_mixed_rows():
    p = EBPrior(min_count=1)
    R = t([[1, 0], [1, 1], [0, 0]])
    _, s = ebpo_advantages(R, p, keys=[1, "1", 1])
    assert p.key_counts() == {1: 2, "1": 1}
    # key 1: rows [1, 0] and [0, 0] -> mean 1/4; key "1": row [1, 1] -> mean 1
    assert p.estimates(1)[0] == pytest.approx(0.25) and p.estimates("1")[0] == pytest.approx(1.0)
    # per-prompt values: mu for rows (1, "1", 1) = (1/4, 1, 1/4) -> mean 1/2
    assert s["mu_glob"] == pytest.approx(0.5)


def test_keyed_prior_equals_prior_fed_only_that_key():
    g = torch.Generator().manual_seed(0)
    keyed, alone = EBPrior(min_count=3), EBPrior()
    for _ in range(4):
        R = torch.bernoulli(torch.full((4, 4), 0.4, dtype=F64), generator=g)
        ebpo_advantages(R, keyed, keys=["a", "b", "a", "b"])
        ebpo_advantages(R[[0, 2]], alone)
    R = torch.bernoulli(torch.full((3, 4), 0.7, dtype=F64), generator=g)
    A1, s1 = ebpo_advantages(R, keyed, keys=["a"] * 3)
    A2, s2 = ebpo_advantages(R, alone)
    assert torch.allclose(A1, A2, atol=1e-12)
    assert s1["shrinkage"] == pytest.approx(s2["shrinkage"])


# ---------------------------------------------------------------------------------------------
# EBPO: properties of docs/algorithm.md section 3


def _closed_form(R: torch.Tensor, S: float) -> torch.Tensor:
    top = (R - R.mean(1, keepdim=True)) + S * (R.mean(1, keepdim=True) - R.mean())  # [B, G]
    return top / (top.pow(2).mean().sqrt() + 1e-6)


@SETTINGS
@given(st.lists(reward_matrix(g=4), min_size=1, max_size=4))
def test_ebpo_matches_closed_form(batches):
    p = EBPrior()
    for R in batches:
        A, s = ebpo_advantages(R, p)
        assert torch.allclose(A, _closed_form(R, s["shrinkage"]), atol=1e-8)


def _state(mean: float, var_r: float, var_mu: float, w: float, G: int) -> dict:
    acc = lambda n, mu, v: {"n": n, "w": float(n), "mean": mu, "m2": v * n}  # noqa: E731
    glob = {
        "last_step": 1,
        "r": acc(int(w) * G, mean, var_r),
        "mu": acc(int(w), mean, var_mu),
        "within": acc(int(w), 0.0, 0.0),
        "inv_n": acc(int(w), 1 / G, 0.0),
    }
    return {"version": 1, "options": EBPrior().options(), "step": 1, "global": glob, "keys": {}}


@SETTINGS
@given(reward_matrix(min_b=2, g=4), st.floats(0.05, 3.0), st.integers(1, 30))
def test_mu_glob_cancels(R, d, w):
    # Two histories with the same weight and spread, means m + d and m - d around the batch mean m:
    # the merged variances are equal (delta^2 is the same), so S is equal, but mu_glob differs.
    m = R.mean().item()
    p1, p2 = EBPrior(), EBPrior()
    p1.load_state_dict(_state(m + d, 0.3, 0.1, w, 4))
    p2.load_state_dict(_state(m - d, 0.3, 0.1, w, 4))
    A1, s1 = ebpo_advantages(R, p1)
    A2, s2 = ebpo_advantages(R, p2)
    assert s1["shrinkage"] == pytest.approx(s2["shrinkage"], rel=1e-9)
    assert s1["mu_glob"] - s2["mu_glob"] > 0.01
    assert torch.allclose(A1, A2, atol=1e-8)
    assert torch.allclose(A1, _closed_form(R, s1["shrinkage"]), atol=1e-8)


@SETTINGS
@given(st.lists(reward_matrix(binary=True, min_b=2, g=4), min_size=1, max_size=3))
def test_center_false_all_fail_row(batches):
    p = EBPrior(center=False)
    R0 = batches[-1].clone()
    R0[0] = 0.0  # an all-fail row
    for R in [*batches[:-1], R0]:
        A, s = ebpo_advantages(R, p)
    expected = -s["shrinkage"] * s["mu_glob"] / (s["raw_std"] + 1e-6)
    assert torch.allclose(A[0], torch.full((4,), expected, dtype=F64), atol=1e-9)
    if s["shrinkage"] > 0 and s["mu_glob"] > 0:
        assert A[0, 0] < 0


@SETTINGS
@given(st.lists(reward_matrix(binary=True), min_size=1, max_size=3))
def test_shrinkage_half_iff_within_le_g_minus_1_tau2(batches):
    # Paper variant, 0/1 rewards (equal group sizes): sigma2 = w_pop + tau2 with w_pop the mean
    # within-group population variance, so S <= 1/2 <=> w_pop <= (G - 1) tau2. S is always in [0, 1].
    G = batches[0].shape[1]
    batches = [R[:, :G] for R in batches if R.shape[1] >= G]
    p = EBPrior()
    for R in batches:
        _, s = ebpo_advantages(R, p)
    allR = torch.cat(batches)
    tau2 = allR.mean(1).var(unbiased=False).item()
    w_pop = allR.var(1, unbiased=False).mean().item()
    assert 0.0 <= s["shrinkage"] <= 1.0
    assert s["tau2"] == pytest.approx(tau2, abs=1e-12)
    gap = w_pop - (G - 1) * tau2
    assume(abs(gap) > 1e-9)
    assert (s["shrinkage"] <= 0.5) == (gap < 0)


def test_shrinkage_can_exceed_half_on_a_finite_sample():
    # rows [1, 0], [0, 1]: tau2 = 0, sigma2 = 1/4 -> S = 1
    # (docs/algorithm.md section 3: "S <= 1/2" holds in the large-sample limit only)
    _, s = ebpo_advantages(t([[1, 0], [0, 1]]), EBPrior())
    assert s["shrinkage"] == 1.0


@pytest.mark.parametrize("a,b,G", [(1, 1, 4), (2, 5, 8), (0.5, 0.5, 4)])
def test_shrinkage_large_sample_limit(a, b, G):
    # theta ~ Beta(a, b), 0/1 rewards: tau_t = Var(theta), Ew = E[theta(1 - theta)]
    # var(W_r) -> Ew + tau_t, var(W_mu) -> tau_t + Ew / G, so S -> (Ew + tau_t) / (2 Ew + (G+1) tau_t)
    # which is <= 1/2. Beta(1, 1), G = 4: tau_t = 1/12, Ew = 1/6 -> S = 1/3.
    gen = torch.Generator().manual_seed(1)
    mu = a / (a + b)
    tau_t = a * b / ((a + b) ** 2 * (a + b + 1))
    ew = mu * (1 - mu) - tau_t
    limit = (ew + tau_t) / (2 * ew + (G + 1) * tau_t)
    p = EBPrior()
    beta = torch.distributions.Beta(torch.tensor(float(a)), torch.tensor(float(b)))
    torch.manual_seed(2)
    for _ in range(20):
        theta = beta.sample((1000,)).to(F64)
        R = torch.bernoulli(theta[:, None].expand(1000, G), generator=gen)
        _, s = ebpo_advantages(R, p)
    assert limit <= 0.5
    assert s["shrinkage"] == pytest.approx(limit, abs=0.01)


# ---------------------------------------------------------------------------------------------
# Brute-force reference (recomputes every statistic from the whole history, no Welford)


def _wstats(items, t_now, gamma):
    """Weighted mean and population variance of (step, value) items at step t_now."""
    w = [1.0 if gamma is None else gamma ** (t_now - s) for s, _ in items]
    tot = sum(w)
    if tot == 0:
        return 0.0, 0.0
    m = sum(wi * x for wi, (_, x) in zip(w, items)) / tot
    return m, sum(wi * (x - m) ** 2 for wi, (_, x) in zip(w, items)) / tot


def _ref_estimates(hist, key, t_now, opts):
    """(mu_glob, sigma2, tau2) from the history items of `key` (None: all items)."""

    def sel(kind):
        return [(s, x) for s, k, kd, x in hist if kd == kind and (key is None or k == key)]

    gamma = opts["decay"]
    mu, var_r = _wstats(sel("r"), t_now, gamma)
    _, var_mu = _wstats(sel("mu"), t_now, gamma)
    within = _wstats(sel("within"), t_now, gamma)[0]
    inv_n = _wstats(sel("inv_n"), t_now, gamma)[0]
    sigma2 = var_r if opts["sigma2"] == "total" else within
    if opts["tau2"] == "raw":
        return mu, sigma2, var_mu
    return mu, sigma2, max(var_mu - within * inv_n, opts["tau2_min"])


def _reference(steps, opts):
    """Yield A for each (R, M, keys) step, straight from the formulas of the module docstring."""
    hist = []  # (step, key, kind, value)
    for t_now, (R, M, keys) in enumerate(steps, start=1):
        B, G = len(R), len(R[0])
        rows = [[R[b][j] for j in range(G) if M[b][j]] for b in range(B)]
        for b, vals in enumerate(rows):
            if len(vals) >= 2:
                k = keys[b] if keys else None
                m = sum(vals) / len(vals)
                hist += [(t_now, k, "r", x) for x in vals]
                hist += [(t_now, k, "mu", m), (t_now, k, "inv_n", 1 / len(vals))]
                hist.append((t_now, k, "within", sum((x - m) ** 2 for x in vals) / (len(vals) - 1)))

        raw = [[0.0] * G for _ in range(B)]
        for b, vals in enumerate(rows):
            if len(vals) < 2:
                continue
            key = keys[b] if keys else None
            count = sum(1 for _, k, kd, _ in hist if kd == "mu" and k == key)
            use = key if key is not None and count >= opts["min_count"] else None
            mu, sigma2, tau2 = _ref_estimates(hist, use, t_now, opts)
            noise = sigma2 / len(vals)
            S = noise / (noise + tau2) if noise + tau2 > 1e-12 else 0.0
            V = (1 - S) * sum(vals) / len(vals) + S * mu
            raw[b] = [R[b][j] - V if M[b][j] else 0.0 for j in range(G)]
        valid = [(b, j) for b in range(B) for j in range(G) if M[b][j] and len(rows[b]) >= 2]
        A = [[0.0] * G for _ in range(B)]
        if valid:
            m = sum(raw[b][j] for b, j in valid) / len(valid)
            std = math.sqrt(sum((raw[b][j] - m) ** 2 for b, j in valid) / len(valid))
            for b, j in valid:
                A[b][j] = ((raw[b][j] - m) if opts["center"] else raw[b][j]) / (std + 1e-6)
        yield A


@st.composite
def stream(draw):
    G = draw(st.integers(2, 4))
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        B = draw(st.integers(1, 4))
        R = draw(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=G, max_size=G),
                          min_size=B, max_size=B))  # fmt: skip
        M = draw(st.lists(st.lists(st.booleans() | st.just(True), min_size=G, max_size=G),
                          min_size=B, max_size=B))  # fmt: skip
        keys = draw(st.none() | st.lists(st.sampled_from(["a", "b", 7]), min_size=B, max_size=B))
        steps.append((R, M, keys))
    opts = {
        "tau2": draw(st.sampled_from(["raw", "moments"])),
        "sigma2": draw(st.sampled_from(["total", "within"])),
        "center": draw(st.booleans()),
        "decay": draw(st.sampled_from([None, 0.5, 0.9])),
        "min_count": draw(st.integers(1, 3)),
        "tau2_min": draw(st.sampled_from([0.0, 1e-6, 0.01])),
    }
    return steps, opts


@settings(max_examples=80, deadline=None)
@given(stream())
def test_ebpo_agrees_with_brute_force_reference(case):
    steps, opts = case
    p = EBPrior(**opts)
    for (R, M, keys), A_ref in zip(steps, _reference(steps, opts)):
        A, _ = ebpo_advantages(t(R), p, mask=torch.tensor(M), keys=keys)
        assert torch.allclose(A, t(A_ref), atol=1e-6, rtol=1e-6), (A, A_ref)


# ---------------------------------------------------------------------------------------------
# State, masks, dtypes, dispatch


def _run(p, batches, keys):
    return [ebpo_advantages(R, p, keys=keys) for R in batches]


@pytest.mark.parametrize(
    "opts", [{}, {"tau2": "moments", "sigma2": "within", "decay": 0.8, "min_count": 2}]
)
@pytest.mark.parametrize("via", ["json", "torch"])
def test_state_round_trip_continues_identically(opts, via):
    gen = torch.Generator().manual_seed(3)
    batches = [torch.bernoulli(torch.full((6, 4), 0.5, dtype=F64), generator=gen) for _ in range(6)]
    keys = ["add", "sub", 3, "add", 3, "mul"]
    p = EBPrior(**opts)
    _run(p, batches[:3], keys)
    state = p.state_dict()
    if via == "json":
        state = json.loads(json.dumps(state))
    else:
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
    p2 = EBPrior()
    p2.load_state_dict(state)
    assert p2.state_dict() == p.state_dict() and p2.options() == p.options()
    for (A1, s1), (A2, s2) in zip(_run(p, batches[3:], keys), _run(p2, batches[3:], keys)):
        assert torch.equal(A1, A2) and s1 == s2
    assert "EBPrior(" in repr(p2)


def test_state_dict_is_a_copy():
    p = EBPrior()
    ebpo_advantages(t([[1, 0], [1, 1]]), p)
    state = p.state_dict()
    state["global"]["r"]["mean"] = 99.0
    assert p.state_dict()["global"]["r"]["mean"] == 0.75
    p2 = EBPrior()
    p2.load_state_dict(p.state_dict())
    ebpo_advantages(t([[0, 0], [0, 0]]), p2)
    assert p.state_dict()["global"]["r"]["n"] == 4


@pytest.mark.parametrize(
    "state,match",
    [
        ({"version": 2}, "version 1"),
        ({"version": 1, "options": {}}, "missing"),
        ({**EBPrior().state_dict(), "options": {"tau2": "x"}}, "EBPrior.tau2"),
        ({**EBPrior().state_dict(), "global": {"r": 1}}, "global needs"),
        ({**EBPrior().state_dict(), "keys": {"x:1": EBPrior().state_dict()["global"]}}, "key tag"),
    ],
)
def test_load_state_dict_errors(state, match):
    with pytest.raises(ValueError, match=match):
        EBPrior().load_state_dict(state)


def test_welford_matches_torch_and_rejects_bad_state():
    w = Welford()
    x = torch.randn(50, dtype=F64, generator=torch.Generator().manual_seed(0))
    for chunk in x.split(7):
        w.update(chunk)
    w.update(torch.empty(0))
    assert w.n == 50 and w.mean == pytest.approx(x.mean().item())
    assert w.var == pytest.approx(x.var(unbiased=False).item())
    assert Welford().var == 0.0
    before = w.state_dict()
    w.merge(0, 5.0, 1.0)  # nothing to add
    assert w.state_dict() == before
    with pytest.raises(ValueError, match="Welford.load_state_dict"):
        w.load_state_dict({"n": 1})


@SETTINGS
@given(masked_matrix(), st.floats(-1e6, 1e6))
def test_masked_entries_are_ignored(Rm, junk):
    R, M = Rm
    R2 = torch.where(M, R, torch.full_like(R, junk))
    R3 = torch.where(M, R, torch.full_like(R, math.nan))
    for name in ESTIMATORS:
        A1, s1 = compute_advantages(name, R2, prior=EBPrior(), mask=M)
        A2, s2 = compute_advantages(name, R3, prior=EBPrior(), mask=M)
        assert torch.equal(A1, A2) and s1 == s2
        dead = ~M | (M.sum(1, keepdim=True) < 2)
        assert torch.equal(A1[dead], torch.zeros_like(A1[dead]))


def test_mask_equals_compacted_rows():
    R = t([[1, 9, 0, 0], [1, 1, 0, 1]])
    M = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    A = grpo_advantages(R, mask=M)
    assert torch.allclose(A[0, [0, 2, 3]], grpo_advantages(t([[1, 0, 0]]))[0])
    assert A[0, 1] == 0
    # EBPO: a row with < 2 valid entries leaves the prior exactly as if it were absent
    p1, p2 = EBPrior(), EBPrior()
    M1 = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    A1, _ = ebpo_advantages(R, p1, mask=M1, keys=["a", "b"])
    A2, _ = ebpo_advantages(R[:1], p2, keys=["a"])
    assert torch.allclose(A1[0], A2[0]) and torch.equal(A1[1], torch.zeros(4, dtype=F64))
    assert p1.state_dict() == p2.state_dict()


def test_dtype_float32_and_bfloat16():
    R64 = t([[1, 0, 0.5], [0.25, 1, 1]])
    for dt in (torch.float32, torch.bfloat16):
        R = R64.to(dt)
        for name in ESTIMATORS:
            A, _ = compute_advantages(name, R, prior=EBPrior())
            A64, _ = compute_advantages(name, R.to(F64), prior=EBPrior())
            assert A.dtype == dt and torch.equal(A, A64.to(dt))


def test_compute_advantages_dispatch():
    R = t([[1, 0, 0, 1], [1, 1, 1, 0]])
    assert torch.equal(compute_advantages("grpo", R)[0], grpo_advantages(R))
    assert torch.equal(compute_advantages("grpo", R, grpo_scale="batch")[0],
                       grpo_advantages(R, scale="batch"))  # fmt: skip
    assert torch.equal(compute_advantages("dr_grpo", R)[0], dr_grpo_advantages(R))
    assert compute_advantages("rloo", R, keys=["x", "y"])[1] == {}
    A, s = compute_advantages("ebpo", R, prior=EBPrior(), keys=["x", "y"])
    assert torch.equal(A, ebpo_advantages(R, EBPrior(), keys=["x", "y"])[0]) and "shrinkage" in s
    with pytest.raises(ValueError, match="needs prior"):
        compute_advantages("ebpo", R)
    with pytest.raises(ValueError, match="name must be one of"):
        compute_advantages("ppo", R)


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "rewards,mask,match",
    [
        ([[1.0, 0.0]], None, "must be a torch.Tensor"),
        (torch.tensor([[1, 0]]), None, "float tensor"),
        (torch.zeros(4), None, r"shape \[B, G\], got \(4,\)"),
        (torch.zeros(0, 3), None, "no rows"),
        (torch.zeros(3, 1), None, "G >= 2"),
        (t([[0, 1], [math.nan, 0]]), None, r"rewards\[1, 0\] is nan"),
        (
            t([[0, 1], [0, math.inf]]),
            torch.tensor([[1, 1], [1, 1]]).bool(),
            r"rewards\[1, 1\] is inf",
        ),
        (t([[0, 1]]), torch.tensor([[1, 0]]), "bool tensor"),
        (t([[0, 1]]), torch.tensor([[True, False, True]]), r"mask shape \(1, 3\)"),
    ],
)
def test_input_errors(rewards, mask, match):
    for name in ESTIMATORS:
        with pytest.raises(ValueError, match=match):
            compute_advantages(name, rewards, prior=EBPrior(), mask=mask)


def test_other_errors():
    R = t([[1, 0], [0, 1]])
    with pytest.raises(ValueError, match="scale must be"):
        grpo_advantages(R, scale="token")
    with pytest.raises(ValueError, match="prior must be an EBPrior"):
        ebpo_advantages(R, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="B = 2 keys"):
        ebpo_advantages(R, EBPrior(), keys=["a"])
    with pytest.raises(ValueError, match="B = 2 keys"):
        ebpo_advantages(R, EBPrior(), keys="ab")
    with pytest.raises(ValueError, match=r"keys\[1\] must be a str or int, got float"):
        ebpo_advantages(R, EBPrior(), keys=["a", 0.5])
    with pytest.raises(ValueError, match=r"keys\[1\] must be a str or int, got list"):
        ebpo_advantages(R, EBPrior(), keys=["a", ["b"]])
    with pytest.raises(ValueError, match=r"keys\[0\] must be a str or int, got bool"):
        ebpo_advantages(R, EBPrior(), keys=[True, 1])
    for kwargs, field in [
        ({"tau2": "mom"}, "tau2"),
        ({"sigma2": "pooled"}, "sigma2"),
        ({"center": 1}, "center"),
        ({"decay": 1.0}, "decay"),
        ({"decay": True}, "decay"),
        ({"min_count": 0}, "min_count"),
        ({"tau2_min": -1.0}, "tau2_min"),
        ({"tau2_min": math.nan}, "tau2_min"),
    ]:
        with pytest.raises(ValueError, match=f"EBPrior.{field}"):
            EBPrior(**kwargs)


def test_observe_every_drawn_group_then_advantages_for_the_kept():
    """Dynamic sampling: step 1 on all drawn rows, steps 2-6 on the kept ones
    (docs/algorithm.md section 5)."""
    drawn = t([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])  # rows 1, 2 dropped
    kept = drawn[[0, 3]]
    for opts in ({}, {"decay": 0.9}, {"tau2": "moments", "sigma2": "within"}):
        split, whole = EBPrior(**opts), EBPrior(**opts)
        for _ in range(2):  # two steps: the decay clock moves once per observe
            split.observe(drawn, keys=["a", "b", "a", "b"])
            A, s = ebpo_advantages(kept, split, keys=["a", "b"], observe=False)
            ebpo_advantages(drawn, whole, keys=["a", "b", "a", "b"])
        assert split.state_dict() == whole.state_dict()
        assert s["groups_seen"] == 8 and split.step == 2
        # A of the kept rows is the paper's formula with the all-drawn statistics
        mu, sigma2, tau2 = whole.estimates()
        S = (sigma2 / 4) / (sigma2 / 4 + tau2)
        raw = kept - ((1 - S) * kept.mean(1, keepdim=True) + S * mu)
        ref = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)
        assert torch.allclose(A, ref, atol=1e-9) and s["shrinkage"] == pytest.approx(S)
    # one call equals observe + observe=False on the same rows
    p1, p2 = EBPrior(), EBPrior()
    A1, s1 = ebpo_advantages(drawn, p1)
    p2.observe(drawn)
    A2, s2 = compute_advantages("ebpo", drawn, prior=p2, observe=False)
    assert torch.equal(A1, A2) and s1 == s2
