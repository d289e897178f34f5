"""The optimisation phase of a step (`Run.optimize`) on the tiny model: what it computes once,
in which mode, and what it logs."""

from __future__ import annotations

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.metrics import read_metrics
from ebpo_lite.run import build_run, draw_seed
from ebpo_lite.train import train
from tests.conftest import TINY_RECIPE, fast_overrides


def _setup(tmp_path, **extra):
    """A built run, one rollout of 8 prompts x G and random advantages (all rows valid)."""
    cfg = config.load(TINY_RECIPE, fast_overrides(tmp_path / "run", **extra))
    run = build_run(cfg)
    G = cfg.rollout.group_size
    prompt_ids = run.prompt_ids[:8]
    roll = run.backend.generate(prompt_ids, G, seed=0)
    prompts = [prompt_ids[i // G] for i in range(len(roll.completion_ids))]
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(len(prompts), generator=gen)  # [B*G]
    return run, prompts, roll, adv, torch.ones(len(prompts), dtype=torch.bool)


@torch.no_grad()
def _perturb_lora(policy, seed: int = 0) -> None:
    """A non-trivial adapter (LoRA B starts at zero, so LoRA dropout would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_fixed_logprobs_are_taken_with_dropout_off(tmp_path):
    """Old / reference log-probs do not depend on the mode the model was left in."""
    run, prompts, roll, _, _ = _setup(tmp_path, **{"model.lora_dropout": 0.5})
    _perturb_lora(run.policy)
    run.policy.model.train()  # as after any optimizer step
    rows = list(range(len(roll.completion_ids)))
    fixed = run._fixed_logprobs(prompts, roll, rows, True, True)
    assert run.policy.model.training  # the mode is restored
    old = run.policy.token_logprobs(prompts, roll.completion_ids)  # eval mode, as the samplers
    ref = run.policy.token_logprobs(prompts, roll.completion_ids, reference=True)
    for i, c in enumerate(roll.completion_ids):
        assert torch.allclose(fixed[("old", i)][: len(c)], torch.tensor(old[i]), atol=1e-5)
        assert torch.allclose(fixed[("ref", i)][: len(c)], torch.tensor(ref[i]), atol=1e-5)


def test_logged_lr_is_the_one_the_steps_update_used(tmp_path):
    """With a 3-step warm-up, steps 1-3 update with lr x 1/3, 2/3, 1 and log exactly that."""
    out = tmp_path / "run"
    extra = {"train.warmup_steps": 3, "train.steps": 3, "train.lr": 1e-3}
    train(config.load(TINY_RECIPE, fast_overrides(out, **extra)))
    lrs = [r["train/lr"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])


def test_redraw_seeds_never_collide_across_steps_and_draws():
    """Draw 101 of step s used to get the seed of draw 0 of step s + 1."""
    seeds = [draw_seed(0, step, draw) for step in range(1, 301) for draw in range(0, 201)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert draw_seed(0, 1, 101) != draw_seed(0, 2, 0)
    assert (
        draw_seed(7, 3, 2) == draw_seed(7, 3, 2) != draw_seed(8, 3, 2)
    )  # a function of the triple


def test_vllm_request_seeds_use_the_whole_step_seed():
    from ebpo_lite.rollout.vllm import request_seeds

    low = 12345
    assert request_seeds(low, 4) != request_seeds(low + 2**40, 4)
