"""The loss menu (loss_types.py, loss.policy_loss's `loss_type` and options, the config keys):
hand-computed values and gradients, and every loss type training the tiny task end to end.

Equality with TRL's own code is `tests/test_trl_loss_parity.py` (integrations tier)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.algo import loss_types as lt
from ebpo_lite.algo.loss import aggregate, drop_truncated, microbatch_weight, policy_loss
from ebpo_lite.algo.loss_keys import AGGREGATION, LOSS_AGG_ALIAS, LOSS_TYPES, loss_type_of
from ebpo_lite.engine.metrics import read_metrics
from ebpo_lite.errors import ConfigError
from tests.conftest import TINY_RECIPE, fast_overrides

torch.set_num_threads(1)


def one_token(ratios, adv, old=-1.0):
    """Sequences of one token each with the given ratios: (logp with grad, old, adv, mask)."""
    r = torch.tensor(ratios, dtype=torch.float32)
    old_t = torch.full((len(ratios), 1), old)
    logp = (old_t + r.log()[:, None]).requires_grad_()
    return logp, old_t, torch.tensor(adv, dtype=torch.float32), torch.ones(len(ratios), 1)


def grad_of(loss, logp):
    return torch.autograd.grad(loss, logp)[0]


def test_delta_caps_the_ratio_of_a_negative_advantage():
    # A = -1, ratio 3: PPO's min(3 * -1, 1.2 * -1) = -3 -> loss 3, gradient -A * r = 3;
    # delta 2 caps the unclipped ratio: min(2 * -1, -1.2) = -2 -> loss 2, no gradient
    logp, old, adv, m = one_token([3.0], [-1.0])
    plain, _ = policy_loss(logp, old, adv, m)
    capped, _ = policy_loss(logp, old, adv, m, options={"delta": 2.0})
    assert plain.item() == pytest.approx(3.0) and capped.item() == pytest.approx(2.0)
    assert grad_of(plain, logp).item() == pytest.approx(3.0)
    assert grad_of(capped, logp).item() == 0.0
    # delta above the ratio changes nothing; a positive advantage is clipped at 1 + eps as before
    logp, old, adv, m = one_token([1.1, 3.0], [-1.0, 1.0])
    a, _ = policy_loss(logp, old, adv, m)
    b, _ = policy_loss(logp, old, adv, m, options={"delta": 2.0})
    assert a.item() == pytest.approx(b.item()) == pytest.approx((1.1 - 1.2) / 2)


def test_cispo_keeps_every_gradient_with_a_capped_detached_weight():
    # loss_t = -min(r, 1 + eps_high) A logp; d/dlogp = -min(r, cap) A, also where PPO's clip is 0
    logp, old, adv, m = one_token([2.0, 0.5, 1.1], [1.0, -1.0, 2.0])
    loss, stats = policy_loss(logp, old, adv, m, loss_type="cispo", clip_eps_high=0.25)
    w = torch.tensor([1.25, 0.5, 1.1])
    expected = -(w * adv * logp.detach()[:, 0]).mean()  # token_mean over 3 tokens
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(grad_of(loss, logp)[:, 0], -w * adv / 3)
    assert stats["clip_frac_high"] == pytest.approx(1 / 3) and stats["clip_frac_low"] == 0.0


def test_sapo_gate_value_slope_and_temperatures():
    # l = -(4 / tau) sigmoid(tau (r - 1)) A: at r = 1 the value is -2A / tau and d/dlogp = -A
    logp, old, adv, m = one_token([1.0, 1.0], [1.0, -1.0])
    opts = {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5}
    loss, _ = policy_loss(logp, old, adv, m, loss_type="sapo", options=opts)
    assert loss.item() == pytest.approx((-2 * 1 / 2.0 + -2 * -1 / 0.5) / 2)  # seq_mean
    torch.testing.assert_close(grad_of(loss, logp)[:, 0], -adv / 2)
    # far from 1 the gate closes: r = 3, tau 1 -> slope 4 sigmoid'(2) r, well below PPO's A r
    logp, old, adv, m = one_token([3.0], [1.0])
    far, _ = policy_loss(logp, old, adv, m, loss_type="sapo")
    s = 1 / (1 + math.exp(-2.0))
    assert grad_of(far, logp).item() == pytest.approx(-4 * s * (1 - s) * 3.0, rel=1e-5)


def test_vespo_gamma_weight_by_hand():
    # phi(w) = exp(lambda + k log w - lambda w): phi(1) = 1; w = 2 with (k, lambda) = (2, 3):
    # 4 e^-3; with (3, 2) for a negative advantage: 8 e^-2
    m = torch.ones(3, 2)
    log_ratio = torch.tensor([[0.0, 0.0], [math.log(2) / 2] * 2, [0.3, math.log(2) - 0.3]])
    a = torch.tensor([[1.0], [1.0], [-1.0]])
    phi = lt.gamma_weights(log_ratio, a, m, None, 2.0, 3.0, 3.0, 2.0)
    expected = torch.tensor([[1.0], [4 * math.exp(-3)], [8 * math.exp(-2)]])
    torch.testing.assert_close(phi, expected)
    # the sampler's log-weights add to log w; padding counts for nothing
    log_is = torch.tensor([[math.log(2), 5.0], [0, 0], [0, 0]])
    padded = torch.tensor([[1.0, 0.0], [1, 1], [1, 1]])
    phi = lt.gamma_weights(log_ratio, a, padded, log_is, 2.0, 3.0, 3.0, 2.0)
    assert phi[0].item() == pytest.approx(4 * math.exp(-3), rel=1e-6)


def test_vespo_loss_is_weighted_reinforce():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    loss, _ = policy_loss(logp, logp.detach(), adv, torch.ones(2, 2), loss_type="vespo")
    # on policy phi = 1: -(A logp) token mean = -(1 * -3 + -2 * -1) / 4
    assert loss.item() == pytest.approx(0.25)
    torch.testing.assert_close(grad_of(loss, logp), -adv[:, None].expand(2, 2) / 4)


def test_sequence_ratio_is_the_geometric_mean_and_feeds_every_token():
    logp = torch.tensor([[-1.0, -1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -0.6, 5.0]])  # the last position is padding
    m = torch.tensor([[1.0, 1.0, 0.0]])
    log_w = lt.log_importance_weights(logp, old, m, "sequence")
    assert log_w[0, 0].item() == pytest.approx((0.2 - 0.4) / 2)
    (g,) = torch.autograd.grad(log_w[0, 0], logp)
    torch.testing.assert_close(g, torch.tensor([[0.5, 0.5, 0.0]]))


def test_high_entropy_mask_keeps_the_top_quantile_of_valid_tokens():
    ent = torch.tensor([[0.1, 0.5, 0.9, 9.0], [0.3, 0.7, 0.2, 0.4]])
    m = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])  # 9.0 is padding: never kept, never counted
    top = lt.high_entropy_mask(ent, m, 0.25)  # 7 valid values: the 0.75 quantile is 0.6
    assert top.tolist() == [[False, False, True, False], [False, True, False, False]]
    assert lt.high_entropy_mask(ent, m, 0.0).sum() == 1  # only the highest
    assert lt.high_entropy_mask(ent, m, 1.0).tolist() == m.bool().tolist()
    # in the loss: only kept tokens carry gradient, the normaliser still counts every token
    logp = torch.zeros(2, 4, requires_grad=True)
    adv = torch.tensor([1.0, 1.0])
    loss, _ = policy_loss(logp, logp.detach(), adv, m, entropy=ent, top_entropy_quantile=0.25)
    assert loss.item() == pytest.approx(-2 / 7)
    torch.testing.assert_close(grad_of(loss, logp), -top.float() / 7)


def test_kl_estimators_values_and_gradients():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    d = ref - logp.detach()  # [-0.5, 1.0]
    for name, value, grad in [
        ("k1", -d, torch.ones_like(d)),
        ("k2", d * d / 2, -d),
        ("k3", d.exp() - d - 1, 1 - d.exp()),
    ]:
        kl = lt.kl_estimate(logp, ref, name)
        torch.testing.assert_close(kl.detach(), value)
        torch.testing.assert_close(grad_of(kl.sum(), logp), grad)
    with pytest.raises(ValueError, match="kl_estimator"):
        lt.kl_estimate(logp, ref, "k4")


def test_bias_corrected_kl_multiplies_by_the_ratio():
    # on policy the ratio is 1: same value, but the ratio's gradient adds kl_t to each token's
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    adv = torch.zeros(1)
    kw = {"ref_logp": ref, "kl_coef": 1.0}
    plain, _ = policy_loss(logp, logp.detach(), adv, torch.ones(1, 2), **kw)
    corr, _ = policy_loss(
        logp, logp.detach(), adv, torch.ones(1, 2), use_bias_correction_kl=True, **kw
    )
    assert plain.item() == pytest.approx(corr.item())
    k3 = lt.kl_estimate(logp.detach(), ref, "k3")
    torch.testing.assert_close(grad_of(corr, logp) - grad_of(plain, logp), k3 / 2)


def test_luspo_sums_each_sequence_and_every_aggregation_accumulates_exactly():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    assert aggregate(x, m, "seq_sum").item() == pytest.approx((6 + 4) / 2)
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(5, 4, generator=g)).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(5, 4, generator=g)
    adv = torch.randn(5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    for kind in LOSS_TYPES:
        kw = {"loss_type": kind, "max_tokens": 4}
        full, _ = policy_loss(logp, old, adv, mask, **kw)
        parts, tokens = [], mask.sum(1).tolist()
        for rows in ([0, 1], [2, 3, 4]):
            part, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], **kw)
            share = microbatch_weight(
                AGGREGATION[kind], sum(tokens[i] for i in rows), len(rows), sum(tokens), 5
            )
            parts.append(part * share)
        assert sum(parts).item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7), kind


def test_default_is_the_old_loss_and_loss_agg_names_three_types():
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 4, generator=g)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 4, generator=g)
    adv, mask = (
        torch.randn(3, generator=g),
        torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]),
    )
    for agg, kind in LOSS_AGG_ALIAS.items():
        old_way, _ = policy_loss(logp, old, adv, mask, agg=agg, max_tokens=4)
        new_way, _ = policy_loss(logp, old, adv, mask, loss_type=kind, max_tokens=4)
        assert old_way.item() == new_way.item(), kind
    a = config.AlgoConfig()
    assert a.loss_type is None and loss_type_of(a) == "dapo"  # today's default, unchanged
    default, _ = policy_loss(logp, old, adv, mask)
    assert default.item() == policy_loss(logp, old, adv, mask, loss_type="dapo")[0].item()


def test_drop_truncated_zeroes_unfinished_rows():
    mask = torch.ones(3, 2)
    assert drop_truncated(mask, [True, False, True]).tolist() == [[1, 1], [0, 0], [1, 1]]


def _load(*overrides):
    return config.load(TINY_RECIPE, list(overrides))


@pytest.mark.parametrize(
    "overrides, key, says",
    [
        (["algo.loss_type=ppo"], "algo.loss_type", "expected one of grpo"),
        (
            ["algo.loss_type=grpo", "algo.loss_agg=token_sum_norm"],
            "algo.loss_agg",
            "aggregates by seq_mean; drop algo.loss_agg",
        ),
        (["algo.loss_type=sapo", "algo.delta=2"], "algo.delta", "not of sapo"),
        (["algo.delta=0.9"], "algo.delta", "must be > 1"),
        (
            ["algo.loss_type=vespo", "algo.importance_sampling_level=sequence"],
            "algo.importance_sampling_level",
            "leave it at token",
        ),
        (["algo.importance_sampling_level=seq"], "algo.importance_sampling_level", "expected"),
        (["algo.top_entropy_quantile=1.5"], "algo.top_entropy_quantile", "[0, 1]"),
        (["algo.kl_estimator=k4"], "algo.kl_estimator", "k1, k2, k3"),
        (["algo.sapo_temperature_neg=0"], "algo.sapo_temperature_neg", "> 0"),
    ],
)
def test_impossible_loss_settings_are_refused_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as e:
        _load(*overrides)
    assert str(e.value).startswith(f"{key}: ") and says in str(e.value)
    assert "\n" not in str(e.value)


def test_loss_agg_and_loss_type_that_agree_are_accepted():
    assert loss_type_of(_load("algo.loss_agg=seq_mean").algo) == "grpo"
    assert loss_type_of(_load("algo.loss_agg=seq_mean", "algo.loss_type=sapo").algo) == "sapo"
    assert loss_type_of(_load("algo.loss_type=luspo").algo) == "luspo"  # recipe: token_mean


def test_help_lists_the_loss_keys():
    from ebpo_lite.commands.confighelp import train_help

    text = train_help()
    for key in ("algo.loss_type", "algo.delta", "algo.mask_truncated_completions"):
        assert key in text
    assert "grpo | dr_grpo | dapo | bnpo | cispo | sapo | luspo | vespo" in text


# ------------------------------------------------------------------ end to end, the tiny task
def _cfg(out, **extra):
    base = {"train.steps": 2, "train.prompts_per_step": 16, **extra}
    return config.load(TINY_RECIPE, fast_overrides(out, **base))


def _trained(out, step):
    from safetensors.torch import load_file

    return load_file(out / "checkpoints" / f"step_{step}" / "trainable.safetensors")


def _check_trained(out, steps=2):
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == steps and all(math.isfinite(r["train/loss"]) for r in rows)
    lora_b = [v for k, v in _trained(out, steps).items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # LoRA B starts at zero


GSPO_ALL = {  # the run.py wiring of every new option at once
    "algo.loss_type": "grpo",
    "algo.importance_sampling_level": "sequence",
    "algo.mask_truncated_completions": "true",
    "algo.top_entropy_quantile": 0.5,
    "algo.kl_coef": 0.01,
    "algo.kl_estimator": "k2",
    "algo.use_bias_correction_kl": "true",
}


@pytest.mark.slow
def test_gspo_with_every_option_trains_the_tiny_task(tmp_path):
    from ebpo_lite.train import train

    train(_cfg(tmp_path / "run", **GSPO_ALL))
    _check_trained(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_every_loss_type_trains_the_tiny_task(tmp_path, kind):
    from ebpo_lite.train import train

    extra = {"algo.importance_sampling_level": "sequence"} if kind == "luspo" else {}
    extra.update({"algo.delta": 1.5} if kind == "dapo" else {})
    train(_cfg(tmp_path / "run", **{"algo.loss_type": kind, **extra}))
    _check_trained(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "cispo"])
def test_resume_is_exact_under_the_menu(tmp_path, kind):
    """4 steps straight == 2 steps, stop, resume for 2 (tests/test_train.py's check): the menu
    adds no state, so the checkpoint holds all a resumed run needs."""
    from ebpo_lite.train import train

    a, b = tmp_path / "a", tmp_path / "b"
    common = {**GSPO_ALL, "algo.loss_type": kind, "train.steps": 4}
    train(_cfg(a, **common))
    train(_cfg(b, **common, **{"train.stop_after": 2}))
    train(_cfg(b, **common, **{"train.resume": "true"}))
    wa, wb = _trained(a, 4), _trained(b, 4)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    pa = json.loads((a / "checkpoints" / "step_4" / "prior.json").read_text())
    assert pa == json.loads((b / "checkpoints" / "step_4" / "prior.json").read_text())
    la = [r["train/loss"] for r in read_metrics(a / "metrics.jsonl") if "train/loss" in r]
    lb = [r["train/loss"] for r in read_metrics(b / "metrics.jsonl") if "train/loss" in r]
    assert la == lb and len(la) == 4
