"""The "ebpo" verl plugin: registered, called through verl's own compute_advantage, persisted.

Needs verl (CI tier `.ci/tier_integrations.sh`); skipped where it is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.verl
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from ebpo_lite.algo.advantages import EBPrior, ebpo_advantages  # noqa: E402
from ebpo_lite.integrations import verl as plugin  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_prior(monkeypatch):
    monkeypatch.delenv(plugin.PRIOR_DIR_ENV, raising=False)
    plugin.reset_prior()
    yield
    plugin.reset_prior()


def _batch(rewards: list[list[float]], perm: np.ndarray, T: int = 5):
    """DataProto with one sample per reward, uid per group, rows permuted by perm."""
    from verl import DataProto

    uids = [f"u{b}" for b, row in enumerate(rewards) for _ in row]
    scores = torch.tensor([r for row in rewards for r in row])  # [bs]
    bs = len(uids)
    lengths = torch.arange(bs) % (T - 1) + 1  # [bs] response lengths 1..T-1
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [bs, T]
    tlr = torch.zeros(bs, T)
    tlr[torch.arange(bs), lengths - 1] = scores  # reward on the last response token
    perm_t = torch.as_tensor(perm)
    return DataProto.from_dict(
        tensors={"token_level_rewards": tlr[perm_t], "response_mask": mask[perm_t]},
        non_tensors={"uid": np.array(uids, dtype=object)[perm]},
    ), mask[perm_t]


def _expected_per_sample(rewards, prior):
    """ebpo_advantages on the grouped, padded rewards, flattened back to sample order."""
    G = max(len(r) for r in rewards)
    R = torch.zeros(len(rewards), G)
    M = torch.zeros(len(rewards), G, dtype=torch.bool)
    for b, row in enumerate(rewards):
        R[b, : len(row)] = torch.tensor(row)
        M[b, : len(row)] = True
    A, _ = ebpo_advantages(R, prior, mask=M)
    return torch.cat([A[b, : len(row)] for b, row in enumerate(rewards)])  # [bs]


def test_registered_under_ebpo():
    assert core_algos.get_adv_estimator_fn("ebpo") is plugin.compute_ebpo_outcome_advantage


def test_compute_advantage_with_reordered_samples_equals_ebpo_advantages():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    config = OmegaConf.create({"adv_estimator": "ebpo", "ebpo": {"tau2": "moments", "decay": 0.9}})
    steps = [
        [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]],
        [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.0], [1.0]],  # unequal groups, one single
    ]
    reference = EBPrior(tau2="moments", decay=0.9)
    rng = np.random.default_rng(0)
    for rewards in steps:
        bs = sum(len(r) for r in rewards)
        perm = rng.permutation(bs)
        data, mask = _batch(rewards, perm)
        out = compute_advantage(data, adv_estimator="ebpo", config=config)
        expected = _expected_per_sample(rewards, reference)[torch.as_tensor(perm)]  # [bs]
        adv = out.batch["advantages"]  # [bs, T]
        torch.testing.assert_close(adv, expected[:, None] * mask, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.batch["returns"], adv)
    # the single-sample group gets 0; the all-success group a positive push (GRPO gives 0)
    single = [i for i, p in enumerate(perm) if p == bs - 1][0]
    assert float(adv[single].abs().sum()) == 0.0
    assert plugin.get_prior().options()["tau2"] == "moments"
    assert plugin.get_prior().step == 2
    assert plugin.last_stats()["shrinkage"] == pytest.approx(
        _stats_of(steps, EBPrior(tau2="moments", decay=0.9))["shrinkage"]
    )


def _stats_of(steps, prior):
    for rewards in steps:
        G = max(len(r) for r in rewards)
        R = torch.zeros(len(rewards), G)
        M = torch.zeros(len(rewards), G, dtype=torch.bool)
        for b, row in enumerate(rewards):
            R[b, : len(row)] = torch.tensor(row)
            M[b, : len(row)] = True
        _, stats = ebpo_advantages(R, prior, mask=M)
    return stats


def test_leave_one_out_with_uneven_groups_equals_ebpo_advantages():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import compute_advantage

    config = OmegaConf.create({"adv_estimator": "ebpo", "ebpo": {"leave_one_out": True}})
    rewards = [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]
    perm = np.random.default_rng(1).permutation(13)
    data, mask = _batch(rewards, perm)
    out = compute_advantage(data, adv_estimator="ebpo", config=config)
    expected = _expected_per_sample(rewards, EBPrior(leave_one_out=True))[torch.as_tensor(perm)]
    torch.testing.assert_close(
        out.batch["advantages"], expected[:, None] * mask, rtol=1e-5, atol=1e-6
    )
    paper = _expected_per_sample(rewards, EBPrior())[torch.as_tensor(perm)]
    assert (expected - paper).abs().max() > 1e-3  # uneven groups: it is not the paper variant
    assert plugin.get_prior().leave_one_out


def test_prompt_prior_is_refused_with_the_reason():
    data, _ = _batch([[1.0, 0.0]], np.arange(2))
    with pytest.raises(ValueError, match="prompt_prior: not available in verl"):
        plugin.compute_ebpo_outcome_advantage(
            data.batch["token_level_rewards"],
            data.batch["response_mask"],
            config={"ebpo": {"prompt_prior": True}},
            index=data.non_tensor_batch["uid"],
        )


def test_hand_computed_two_groups():
    # rewards [[1, 0], [0, 0]]: mean_g = (.5, 0), sigma2 = var(1,0,0,0) = 3/16, tau2 = var(.5, 0)
    # = 1/16, S = (3/32) / (3/32 + 2/32) = 0.6, V = (.4*.5 + .6*.25, .6*.25) = (.35, .15),
    # A_raw = (.65, -.35, -.15, -.15), mean 0, pop std = sqrt(.65^2+.35^2+2*.15^2)/2
    data, mask = _batch([[1.0, 0.0], [0.0, 0.0]], np.array([3, 1, 0, 2]))
    adv, _ = plugin.compute_ebpo_outcome_advantage(
        data.batch["token_level_rewards"],
        data.batch["response_mask"],
        config=None,
        index=data.non_tensor_batch["uid"],
    )
    std = (0.65**2 + 0.35**2 + 2 * 0.15**2) ** 0.5 / 2
    expected = torch.tensor([-0.15, -0.35, 0.65, -0.15]) / (std + 1e-6)  # sample order 3, 1, 0, 2
    torch.testing.assert_close(adv, expected[:, None] * mask, rtol=1e-5, atol=1e-6)
    assert plugin.last_stats()["shrinkage"] == pytest.approx(0.6)


def test_unknown_option_names_the_key():
    data, _ = _batch([[1.0, 0.0]], np.arange(2))
    with pytest.raises(ValueError, match="algorithm.ebpo: unknown key"):
        plugin.compute_ebpo_outcome_advantage(
            data.batch["token_level_rewards"],
            data.batch["response_mask"],
            config={"ebpo": {"tua2": "raw"}},
            index=data.non_tensor_batch["uid"],
        )


def test_prior_persists_next_to_verl_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv(plugin.PRIOR_DIR_ENV, str(tmp_path))
    data, _ = _batch([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], np.arange(6))
    args = (data.batch["token_level_rewards"], data.batch["response_mask"])
    for _ in range(3):
        plugin.compute_ebpo_outcome_advantage(
            *args, config=None, index=data.non_tensor_batch["uid"]
        )
    saved = sorted(p.name for p in (tmp_path / "ebpo_prior").iterdir())
    assert saved == ["step_2.json", "step_3.json"]  # no global_step_1 folder: step 1 pruned
    step2 = json.loads((tmp_path / "ebpo_prior" / "step_2.json").read_text())
    # verl resumes from its checkpoint at step 2: a new process loads step_2 and continues
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "global_step_2").mkdir()
    plugin.reset_prior()
    plugin.compute_ebpo_outcome_advantage(*args, config=None, index=data.non_tensor_batch["uid"])
    assert plugin.get_prior().step == step2["prior"]["step"] + 1 == 3
    again = json.loads((tmp_path / "ebpo_prior" / "step_3.json").read_text())
    assert again["calls"] == 3
    # manual save / load round-trips exactly
    plugin.save_prior(tmp_path / "manual.json")
    state = plugin.get_prior().state_dict()
    plugin.reset_prior()
    assert plugin.load_prior(tmp_path / "manual.json").state_dict() == state


def _check(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "ebpo_lite.integrations.verl", "--check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_check_cli_reports_registered_and_disabled():
    ok = _check({})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "'ebpo' is registered" in ok.stdout and ok.stdout.strip().endswith("OK")
    off = _check({"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert off.returncode == 1, off.stdout + off.stderr
    assert "excludes 'ebpo'" in off.stdout and "NOT registered" in off.stdout
