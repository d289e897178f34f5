"""Numerical faults (issue 13, part 2): a NaN / inf in rewards, advantages, loss or gradients
skips the step, and the adapter, optimizer and EB prior are exactly the pre-fault ones.

Faults are injected into the real loop on the tiny model: a wrapped `Run.score`, a wrapped
`Run.advantages`, a wrapped `loss.policy_loss`, and a gradient hook on one LoRA tensor.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.algo import loss
from ebpo_lite.engine import faults
from ebpo_lite.engine.metrics import read_metrics
from ebpo_lite.engine.run import build_run
from ebpo_lite.train import main, train, train_step
from tests.conftest import REPO, TINY_RECIPE, fast_overrides


def _cfg(out, **extra):
    return config.load(TINY_RECIPE, fast_overrides(out, **extra))


def _state(run):
    """Everything a skipped step must leave as it was."""
    return (
        run.policy.trainable_state(),
        copy.deepcopy(run.optimizer.state_dict()),
        json.dumps(run.prior.state_dict()),
        run.scheduler.state_dict()["last_epoch"],
    )


def _assert_same(a, b):
    wa, oa, pa, sa = a
    wb, ob, pb, sb = b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert pa == pb and sa == sb
    for i, st in oa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)


def _nan_rewards(run, monkeypatch):
    score = run.score

    def bad(examples, roll):
        r, m = score(examples, roll)
        return r.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(math.inf)), m

    monkeypatch.setattr(run, "score", bad)


def _nan_advantages(run, monkeypatch):
    advantages = run.advantages

    def bad(r, m, idx):
        adv, st = advantages(r, m, idx)
        adv = adv.clone()
        adv[m.nonzero()[0].tolist()] = math.nan
        return adv, st

    monkeypatch.setattr(run, "advantages", bad)


def _nan_loss(run, monkeypatch, after=0):
    policy_loss, calls = loss.policy_loss, [0]

    def bad(logp, *a, **k):  # the forward overflowed: NaN log-probs into the loss
        calls[0] += 1
        return policy_loss(logp * math.nan if calls[0] > after else logp, *a, **k)

    monkeypatch.setattr(loss, "policy_loss", bad)


def _inf_gradients(run, monkeypatch, after=0):
    p = run.policy.trainable_parameters()[0]
    calls = [0]

    def hook(g):
        calls[0] += 1
        return g * math.inf if calls[0] > after else g

    handle = p.register_hook(hook)
    monkeypatch.setattr(run, "_hook_handle", handle, raising=False)


INJECT = {
    "rewards": _nan_rewards,
    "advantages": _nan_advantages,
    "loss": _nan_loss,
    "gradients": _inf_gradients,
}


@pytest.mark.parametrize("reason", list(INJECT))
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_fault_skips_the_step_and_changes_nothing(tmp_path, monkeypatch, reason, mini_batches):
    extra = {"train.mini_batches": mini_batches, "algo.prompt_prior": "true"}
    run = build_run(_cfg(tmp_path / "run", **extra))
    synced = []
    sync = run.backend.sync
    monkeypatch.setattr(
        run.backend, "sync", lambda p, version: (synced.append(version), sync(p, version))
    )
    train_step(run, 1)  # a good step first: non-trivial optimizer state and prior
    before = _state(run)
    with monkeypatch.context() as m:
        # with two mini-batches the fault comes in the second update, after a real one
        later = {"after": 1} if mini_batches > 1 and reason in ("loss", "gradients") else {}
        INJECT[reason](run, m, **later)
        with pytest.raises(faults.NonFinite) as e:
            train_step(run, 2)
        if hasattr(run, "_hook_handle"):
            run._hook_handle.remove()
    assert e.value.reason == reason
    _assert_same(before, _state(run))
    assert synced == [1]  # the sampler never saw the faulty step
    if reason != "rewards":  # found before any gradient: the previous step's stay, unused
        assert all(p.grad is None for p in run.policy.trainable_parameters())
    train_step(run, 3)  # and training goes on from there
    assert synced == [1, 3]
    run.backend.close()


def test_skips_are_counted_and_training_continues(tmp_path, monkeypatch):
    """Steps 2 and 3 meet inf rewards: logged as skipped, the run finishes, counts resume."""
    from ebpo_lite.engine import run as run_mod

    score = run_mod.Run.score
    calls = [0]

    def flaky(self, examples, roll):
        r, m = score(self, examples, roll)
        calls[0] += 1
        return (r * math.nan if calls[0] in (2, 3) else r), m

    monkeypatch.setattr(run_mod.Run, "score", flaky)
    out = tmp_path / "run"
    train(_cfg(out, **{"train.steps": 5}))
    recs = [r for r in read_metrics(out / "metrics.jsonl") if "train/skipped_steps" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["train/skipped_steps"] for r in recs] == [0, 1, 2, 2, 2]
    assert [r.get("train/skip_reason") for r in recs] == [None, "rewards", "rewards", None, None]
    state = torch.load(out / "checkpoints" / "step_5" / "trainer_state.pt", weights_only=True)
    assert state["extra"]["skips"]["total"] == 2


def test_consecutive_faults_stop_with_one_line(tmp_path, monkeypatch, capsys):
    """train.max_consecutive_skips in a row: exit 3, one line naming the cause, and the
    checkpoint written before the faults is left as it was."""
    from ebpo_lite.engine import run as run_mod

    out = tmp_path / "run"
    args = fast_overrides(out, **{"train.steps": 2, "train.checkpoint_every": 2})
    assert main([TINY_RECIPE, *args]) == 0
    ckpt = out / "checkpoints" / "step_2"
    files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    capsys.readouterr()
    monkeypatch.setattr(run_mod.Run, "score", _always_nan(run_mod.Run.score))
    more = fast_overrides(
        out, **{"train.steps": 10, "train.resume": "true", "train.max_consecutive_skips": 3}
    )
    monkeypatch.chdir(REPO)
    assert main([TINY_RECIPE, *more]) == 3
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith("error: step 5: 3 steps in a row skipped on non-finite rewards")
    assert "reward.functions" in err[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == files
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/skipped_steps" in r]
    assert steps == [1, 2, 3, 4, 5]


def _always_nan(score):
    def bad(self, examples, roll):
        r, m = score(self, examples, roll)
        return r * math.nan, m

    return bad


def test_undo_restores_prompt_histories_exactly():
    """`EBPrior.snapshot` / `restore` with prompt histories, decay and keys, through evictions."""
    from ebpo_lite.algo.ebprior import EBPrior

    prior = EBPrior(decay=0.9, prompt_prior=True, prompt_capacity=5, min_count=1)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        r = (torch.rand(4, 4, generator=g) > 0.5).float()
        prior.observe(r, keys=["a", "b", "a", "b"], prompts=[step, step + 1, step + 2, 7])
    before = json.dumps(prior.state_dict())
    snap = prior.snapshot()
    prior.observe(torch.ones(4, 4), keys=["a", "c", "a", "c"], prompts=[10, 11, 12, 13])
    assert json.dumps(prior.state_dict()) != before
    prior.restore(snap)
    assert json.dumps(prior.state_dict()) == before
