"""Every drawn group reaches the EB prior and the curriculum (dynamic sampling, unscorable rows).

Real runs on the tiny model (`build_run` + `train_step`); only the reward function is the test's
own, a plain callable as any user's, so that which groups are dropped or unscorable is known.
"""

from __future__ import annotations

import numpy as np
import pytest

from ebpo_lite import config
from ebpo_lite.engine.run import build_run
from ebpo_lite.rewards import arithmetic_answer
from ebpo_lite.train import train_step
from tests.conftest import TINY_RECIPE, fast_overrides

B, G = 8, 4


def _run(tmp_path, reward, **extra):
    cfg = config.load(
        TINY_RECIPE,
        fast_overrides(
            tmp_path / "run",
            **{"train.prompts_per_step": B, "rollout.group_size": G, "algo.estimator": "ebpo"},
            **extra,
        ),
    )
    run = build_run(cfg)
    run.reward_fns = [("test", reward)]
    return run


def test_dynamic_sampling_feeds_every_drawn_group_to_the_prior_and_curriculum(tmp_path):
    """Odd answers always score 0 (all-equal groups, dropped), even ones score by correctness
    or completion length: some groups are dropped, so the loop redraws."""

    def reward(completions, answer, **kw):
        right = arithmetic_answer(completions, answer)
        return [0.0 if int(a) % 2 else float(r or len(c) % 2) for c, a, r in zip(completions, answer, right)]  # fmt: skip

    run = _run(
        tmp_path,
        reward,
        **{
            "curriculum.dynamic_sampling": "true",
            "curriculum.max_extra_draws": 2,
            "curriculum.sampler": "adaptive",
        },
    )
    rec = train_step(run, 1)
    drawn = run.curriculum.batches * B  # every next_batch call draws B prompts
    assert rec["train/extra_draws"] >= 1 and drawn == (1 + rec["train/extra_draws"]) * B
    # docs/algorithm.md section 5: W_r receives every reward, W_mu every group mean (dropped
    # ones too)
    acc = run.prior.glob.acc
    assert acc["mu"].n == drawn and acc["r"].n == drawn * G
    assert rec["adv/groups_seen"] == drawn
    # the advantages read the statistics after all drawn groups were added (step 1, then 2)
    mu, sigma2, tau2 = run.prior.estimates()
    assert (rec["adv/mu_glob"], rec["adv/sigma2"], rec["adv/tau2"]) == pytest.approx(
        (mu, sigma2, tau2)
    )
    # the adaptive curriculum learnt from every drawn completion, dropped prompts included
    assert run.curriculum.trials.sum() == drawn * G
    assert rec["train/groups_drawn"] == drawn and rec["train/groups_kept"] < drawn


def test_unscorable_completions_are_not_failures_for_the_adaptive_curriculum(tmp_path):
    """Prompts whose answer is a multiple of 3 are unscorable (None); the rest score 0/1."""
    seen = {"none": 0, "scored": 0, "successes": 0.0, "none_prompts": set()}

    def reward(completions, answer, prompts, **kw):
        right = arithmetic_answer(completions, answer)
        out = [None if int(a) % 3 == 0 else r for a, r in zip(answer, right)]
        for p, v in zip(prompts, out):
            if v is None:
                seen["none"] += 1
                seen["none_prompts"].add(p)
            else:
                seen["scored"] += 1
                seen["successes"] += v
        return out

    run = _run(tmp_path, reward, **{"curriculum.sampler": "adaptive"})
    rec = train_step(run, 1)
    assert seen["none"] > 0 and seen["scored"] > 0
    assert rec["train/unscored_frac"] == pytest.approx(
        seen["none"] / (seen["none"] + seen["scored"])
    )
    s = run.curriculum
    assert s.trials.sum() == seen["scored"] and s.successes.sum() == seen["successes"]
    # an all-unscorable prompt keeps its prior Beta(1, 1): alpha and beta unchanged
    alpha, beta = s.posterior()
    unscored = [i for i, ex in enumerate(run.train_examples) if ex.prompt in seen["none_prompts"]]
    assert unscored
    assert np.all(alpha[unscored] == 1.0) and np.all(beta[unscored] == 1.0)
