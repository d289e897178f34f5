"""The beyond-paper options of ebpo: leave-one-out baselines and the per-prompt prior.

Values are checked against formulas written out here from the module docstring, the
leave-one-out unbiasedness by exact enumeration of every outcome of a Bernoulli group."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from ebpo_lite.algo.advantages import EBPO_EPS, EBPrior, ebpo_advantages

F64 = torch.float64
HISTORY = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def primed(**opts) -> EBPrior:
    """A prior that has seen two steps, so S and mu are neither 0 nor degenerate."""
    prior = EBPrior(center=False, **opts)
    ids = [100, 101, 102]
    prior.observe(HISTORY, prompts=ids)
    prior.observe(HISTORY.flip(1), prompts=ids)
    return prior


def baselines(R: torch.Tensor, prior: EBPrior, prompts=None) -> torch.Tensor:
    """V [B, G] as ebpo_advantages used it: with center=False, A = (R - V) / (std + eps)."""
    A, st = ebpo_advantages(R.to(F64), prior, observe=False, prompts=prompts)
    return R.to(F64) - A * (st["raw_std"] + EBPO_EPS)


def test_leave_one_out_matches_formula_at_g2_and_g4():
    for R in (torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0, 1.0, 1.0]])):
        R = R.to(F64)
        prior = primed(leave_one_out=True)
        mu, sigma2, tau2 = prior.estimates()
        n = R.shape[1]
        S1 = (sigma2 / (n - 1)) / (sigma2 / (n - 1) + tau2)
        mean_out = (R.sum(1, keepdim=True) - R) / (n - 1)
        want = (1 - S1) * mean_out + S1 * mu
        torch.testing.assert_close(baselines(R, prior), want, rtol=0, atol=1e-12)


def test_leave_one_out_baseline_ignores_own_reward():
    prior = primed(leave_one_out=True)
    R = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    flipped = R.clone()
    flipped[0, 2] = 0.0
    V, Vf = baselines(R, prior), baselines(flipped, prior)
    assert V[0, 2] == pytest.approx(float(Vf[0, 2]), abs=1e-12)  # its own baseline: unchanged
    assert not torch.allclose(V[0, [0, 1, 3]], Vf[0, [0, 1, 3]])  # the others' baselines moved
    paper = primed()
    assert float(baselines(R, paper)[0, 2]) != pytest.approx(float(baselines(flipped, paper)[0, 2]))


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
def test_leave_one_out_gradient_is_unbiased_by_enumeration(p):
    """E[(R_i - V_i) d/dtheta log pi(y_i)] over all 2^G outcomes of a Bernoulli(p) policy with
    logit theta (score y - p): equals dJ/dtheta = p (1 - p) with leave-one-out, and
    (1 - (1 - S) / G) p (1 - p) with the paper's group-mean baseline."""
    G = 4
    companion = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)  # keeps the batch std away from 0
    grads = {}
    for loo in (True, False):
        prior = primed(leave_one_out=loo)
        total = 0.0
        for ys in itertools.product((0.0, 1.0), repeat=G):
            y = torch.tensor(ys, dtype=F64)
            V = baselines(torch.stack([y, companion]), prior)[0]  # [G]
            prob = p ** sum(ys) * (1 - p) ** (G - sum(ys))
            total += prob * float(((y - V) * (y - p)).mean())
        grads[loo] = total
    mu, sigma2, tau2 = primed().estimates()
    S = (sigma2 / G) / (sigma2 / G + tau2)
    assert grads[True] == pytest.approx(p * (1 - p), abs=1e-12)
    assert grads[False] == pytest.approx((1 - (1 - S) / G) * p * (1 - p), abs=1e-12)


def test_prompt_prior_posterior_formula():
    prior = primed(prompt_prior=True)
    # read at step 2, the history holds step 1 only: a step never counts its own groups
    assert prior.prompt_history([100, 101, 102, 999]) == ([4.0] * 3 + [0.0], [2.0, 3.0, 0.0, 0.0])
    R = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]], dtype=F64)
    prompts = [101, 999]  # one seen twice before, one new
    prior.observe(R, prompts=prompts)
    mu, sigma2, tau2 = prior.estimates()
    n = 4
    for row, (m, s) in enumerate([(8.0, 6.0), (0.0, 0.0)]):
        kappa = sigma2 / tau2
        centre = (kappa * mu + s) / (kappa + m)
        S = (kappa + m) / (kappa + m + n)  # the Beta-binomial form of the same posterior
        want = (1 - S) * R[row].mean() + S * centre
        got = baselines(R, prior, prompts)[row]
        torch.testing.assert_close(
            got, torch.full((4,), float(want), dtype=F64), atol=1e-12, rtol=0
        )


def test_prompt_prior_excludes_current_step_and_new_prompts_match_paper():
    R = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    a, b = primed(prompt_prior=True), primed(prompt_prior=True)
    A1, _ = ebpo_advantages(R, a, prompts=[101, 5])  # observes inside
    b.observe(R, prompts=[101, 5])
    A2, _ = ebpo_advantages(R, b, prompts=[101, 5], observe=False)
    torch.testing.assert_close(A1, A2, rtol=0, atol=0)
    # prompts never seen before: exactly the paper variant
    fresh, paper = primed(prompt_prior=True), primed()
    A3, st = ebpo_advantages(R, fresh, prompts=[7, 8])
    A4, _ = ebpo_advantages(R, paper)
    torch.testing.assert_close(A3, A4, rtol=0, atol=1e-15)
    assert st["prompt_visits"] == 0.0 and st["frac_prompt_seen"] == 0.0


def test_prompt_prior_state_round_trips_and_resumes_exactly():
    prior = primed(prompt_prior=True, leave_one_out=True, decay=0.9)
    R = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
    ebpo_advantages(R, prior, prompts=[100, "x"])
    state = json.loads(json.dumps(prior.state_dict()))
    copy = EBPrior()
    copy.load_state_dict(state)
    assert copy.options() == prior.options()
    for step in range(3):
        R2 = torch.bernoulli(torch.full((2, 4), 0.5), generator=torch.Generator().manual_seed(step))
        A, _ = ebpo_advantages(R2, prior, prompts=[100, "x"])
        B, _ = ebpo_advantages(R2, copy, prompts=[100, "x"])
        torch.testing.assert_close(A, B, rtol=0, atol=0)
    assert copy.state_dict() == prior.state_dict()


def test_old_state_without_new_options_loads_with_them_off():
    prior = EBPrior()
    ebpo_advantages(HISTORY, prior)
    state = prior.state_dict()
    for k in ("leave_one_out", "prompt_prior", "prompt_capacity"):
        del state["options"][k]
    copy = EBPrior(prompt_prior=True)
    copy.load_state_dict(state)
    assert not copy.prompt_prior and not copy.leave_one_out


def test_prompt_history_is_bounded_and_decays():
    prior = EBPrior(prompt_prior=True, prompt_capacity=3, decay=0.5)
    R = torch.ones(1, 4)
    for p in range(5):
        prior.observe(R, prompts=[p])
    m, s = prior.prompt_history(range(5))
    assert m[:2] == [0.0, 0.0]  # the two least recently seen were evicted
    assert m[2:] == [4.0 * 0.5**2, 4.0 * 0.5, 0.0]  # seen 2 and 1 steps ago; now: not yet
    assert s == m  # all rewards were 1
    prior.observe(R, prompts=["other"])
    assert prior.prompt_history([4]) == ([4.0 * 0.5], [4.0 * 0.5])
    assert len(prior.state_dict()["prompts"]["tags"]) == 3


def test_prompt_prior_needs_prompt_ids():
    with pytest.raises(ValueError, match="prompts="):
        ebpo_advantages(HISTORY, EBPrior(prompt_prior=True))
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a str or int"):
        ebpo_advantages(HISTORY, EBPrior(prompt_prior=True), prompts=[1.5, 2, 3])
    with pytest.raises(ValueError, match="EBPrior.leave_one_out"):
        EBPrior(leave_one_out=1)


def test_leave_one_out_is_the_paper_advantage_reweighted_per_group():
    """R_i - V_paper = c_b (R_i - V_loo) with c_b = (n_b - 1 + S_b) / n_b (module docstring):
    identical whitened advantages when all groups share n and S, different with a mask."""
    R = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=F64)
    for center in (True, False):
        loo, paper = EBPrior(center=center, leave_one_out=True), EBPrior(center=center)
        for step in range(3):
            A1, _ = ebpo_advantages(R.roll(step, 0), loo)
            A2, _ = ebpo_advantages(R.roll(step, 0), paper)
            # equal but for the whitening's eps = 1e-6, which the factor c does not scale
            torch.testing.assert_close(A1, A2, rtol=1e-5, atol=1e-5)
    # raw advantages, per group: the factor c_b, read off the paper's S
    prior_p, prior_l = primed(), primed(leave_one_out=True)
    S = ebpo_advantages(R, primed(), observe=False)[1]["shrinkage"]
    raw_p = R - baselines(R, prior_p)
    raw_l = R - baselines(R, prior_l)
    torch.testing.assert_close(raw_p, (4 - 1 + S) / 4 * raw_l, rtol=0, atol=1e-12)
    # a mask (groups of 4 and 3) makes c_b differ between groups: the whitened advantages differ
    M = torch.ones_like(R, dtype=torch.bool)
    M[2, 3] = False
    A1, _ = ebpo_advantages(R, EBPrior(leave_one_out=True), mask=M)
    A2, _ = ebpo_advantages(R, EBPrior(), mask=M)
    assert (A1 - A2).abs().max() > 1e-3


def test_prompt_history_of_150k_prompts_stays_within_its_capacity():
    import tracemalloc

    prior = EBPrior(prompt_prior=True, prompt_capacity=100_000)
    R = torch.bernoulli(torch.full((1000, 4), 0.5), generator=torch.Generator().manual_seed(0))
    tracemalloc.start()
    for k in range(150):
        prior.observe(R, prompts=range(k * 1000, (k + 1) * 1000))
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(prior.prompts.rows) == 100_000
    assert prior.prompt_history([0, 149_999]) == ([0.0, 0.0], [0.0, 0.0])  # evicted; this step's
    assert prior.prompt_history([60_000])[0] == [4.0]
    assert used / 100_000 < 400  # bytes per remembered prompt (about 250)
