"""`rollout.hf_loop: lean`, the plain decode loop of rollout/hf.py, against transformers
`generate` on the same model: the same greedy completions, the same sampling filters, seeded,
stop ids honoured, and a training run with it."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.data.loader import arithmetic_examples
from ebpo_lite.model.policy import Policy
from ebpo_lite.rollout.hf import HFRollout, filter_logits
from tests.conftest import TINY_RECIPE, fast_overrides


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    cfg = config.load(TINY_RECIPE, fast_overrides(tmp_path_factory.mktemp("lean")))
    return Policy.from_config(cfg), cfg


def _sampler(cfg, policy, loop: str) -> HFRollout:
    return HFRollout(dataclasses.replace(cfg.rollout, hf_loop=loop), policy)


def _prompts(policy, n=24):
    exs = arithmetic_examples(n, seed=3, split="train")
    return [policy.tokenizer.encode(ex.prompt, add_special_tokens=False) for ex in exs]


def test_greedy_completions_equal_generates(policy):
    pol, cfg = policy
    prompts = _prompts(pol)
    a = _sampler(cfg, pol, "generate").generate(prompts, 1, seed=0, temperature=0.0)
    b = _sampler(cfg, pol, "lean").generate(prompts, 1, seed=0, temperature=0.0)
    assert b.completion_ids == a.completion_ids and b.finished == a.finished
    assert any(len(c) > 1 for c in b.completion_ids)


def test_sampled_completions_equal_generates_for_the_same_seed(policy):
    pol, cfg = policy
    prompts = _prompts(pol, 32)
    a = _sampler(cfg, pol, "generate").generate(prompts, 8, seed=11)
    b = _sampler(cfg, pol, "lean").generate(prompts, 8, seed=11)
    assert b.completion_ids == a.completion_ids and b.finished == a.finished
    assert len({tuple(c) for c in b.completion_ids}) > 32  # it did sample


def test_samples_are_seeded_and_stop_at_stop_ids(policy):
    pol, cfg = policy
    prompts, lean = _prompts(pol), _sampler(cfg, pol, "lean")
    one = lean.generate(prompts, 4, seed=7)
    assert lean.generate(prompts, 4, seed=7).completion_ids == one.completion_ids
    assert lean.generate(prompts, 4, seed=8).completion_ids != one.completion_ids
    stops = set(pol.stop_ids)
    for ids, done in zip(one.completion_ids, one.finished):
        assert not stops & set(ids[:-1]) and done == (bool(ids) and ids[-1] in stops)
        assert len(ids) <= cfg.rollout.max_new_tokens


def test_first_token_distribution_matches_the_model(policy):
    """The first sampled token of 2,000 draws from one prompt against the model's softmax."""
    pol, cfg = policy
    prompt = _prompts(pol, 1)
    roll = _sampler(cfg, pol, "lean").generate(prompt, 2000, seed=1, max_new_tokens=1)
    counts = Counter(c[0] for c in roll.completion_ids)
    batch = pol.batch(prompt, [[0]])
    with torch.no_grad():
        logits = pol.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    p = logits[0, batch.prompt_width - 1].float().softmax(-1)  # [V]
    top = p.topk(3)
    for prob, tok in zip(top.values.tolist(), top.indices.tolist()):
        se = (prob * (1 - prob) / 2000) ** 0.5
        assert abs(counts[tok] / 2000 - prob) < 5 * se + 1e-3, (tok, counts[tok], prob)


def test_filter_logits_top_k_top_p_min_p():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda out: (out > torch.finfo(out.dtype).min).squeeze(0).tolist()  # noqa: E731
    assert kept(filter_logits(z, 2, 1.0, 0.0)) == [True, True, False, False]
    assert kept(filter_logits(z, 0, 0.8, 0.0)) == [True, True, False, False]  # 0.5 + 0.3 >= 0.8
    assert kept(filter_logits(z, 0, 0.81, 0.0)) == [True, True, True, False]
    assert kept(filter_logits(z, 0, 0.1, 0.0)) == [True, False, False, False]  # always the top
    assert kept(filter_logits(z, 0, 1.0, 0.5)) == [True, True, False, False]  # >= 0.25
    assert kept(filter_logits(z, 0, 1.0, 0.0)) == [True] * 4


def test_a_run_trains_with_the_lean_loop(tmp_path):
    from ebpo_lite.train import train

    cfg = config.load(TINY_RECIPE, fast_overrides(tmp_path / "run", **{"rollout.hf_loop": "lean"}))
    summary = train(cfg)
    assert summary["steps_done"] == 3 and "after/accuracy" in summary


def test_unknown_loop_is_a_config_error():
    with pytest.raises(config.ConfigError, match="rollout.hf_loop: expected one of"):
        config.load(TINY_RECIPE, ["rollout.hf_loop=fast"])
