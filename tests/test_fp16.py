"""float16 compute learns: dynamic loss scaling (issue 30, part 2; ebpo_lite/model/scaler.py).

The gradient test runs the trainer's own loss path (`completion_logprobs`, `loss.policy_loss`,
`loss.microbatch_weight`) on a random Qwen3 at Qwen3's vocabulary (151,936) with a token-mean
over 20,000 tokens (qwen3_4b_t4: 64 completions of up to 384 tokens), so each token's gradient
weight is what the T4 recipe's is. A micro-batch of 2 x 32 completion tokens carries that weight
(`microbatch_weight` = 64 / 20,000), as one micro-batch of the real mini-batch does. Hidden size
64 keeps it CPU-sized; embeddings of std 1 (a residual stream of rms ~1, not the init's 0.02) and
an lm_head of std 0.5 (logit std ~4) make the completions, sampled from the model at
temperature 1, LM-like: measured, the top token has p ~0.4 on average and ~24% of the mass sits
on tokens with p < 1e-3, exactly the terms whose fp16 gradient (5e-5 x p) underflows.

Tolerance: the LoRA gradients in fp16 against the same weights in fp32, worst tensor's relative
L2 error. Rounding alone makes an error proportional to the unit roundoff; bfloat16 rounds like
float16 with 3 fewer significand bits (2^-8 vs 2^-11) and has float32's exponent range, so it
cannot underflow here: its error, measured in the same test, divided by 8 is float16's rounding
floor. The bound is 3x that floor (ebpo_lite/commands/qlora_check.py's FLOOR_FACTOR). Measured on CPU:
bf16 0.0174, so floor 0.0022 and bound 0.0065; fp16 with scaling 0.0021 (the same, 0.0020-0.0022,
at any scale from 2^12 to 2^24); fp16 without scaling 0.47, 72x the bound.

CPU speed only: the lm_head weight is stored column-major (same values). CPU fp16 GEMM of the
[positions, V] gradient with a row-major [V, h] weight took 10.6 s for 64 positions, 0.36 s
column-major (torch 2.13, AVX-512 without FP16).
"""

from __future__ import annotations

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.algo import loss
from ebpo_lite.engine import faults
from ebpo_lite.engine.metrics import read_metrics
from ebpo_lite.errors import ConfigError, TrainingFault
from ebpo_lite.model import scaler as scaler_mod
from ebpo_lite.model.policy import completion_logprobs, make_batch
from ebpo_lite.model.scaler import LossScaler
from tests.conftest import TINY_RECIPE, fast_overrides

V, TOKENS = 151_936, 20_000  # Qwen3's vocabulary; the token-mean's mini-batch (qwen3_4b_t4)
ROWS, PROMPT, COMPLETION = 2, 8, 32
FLOOR_FACTOR = 3.0
BF16_TO_FP16 = 2.0**-3  # unit roundoff 2^-11 / 2^-8


def _weights() -> dict[str, torch.Tensor]:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config())
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.5)
    return {k: v.half() for k, v in model.state_dict().items()}  # fp16-exact for every dtype


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _policy_model(weights, dtype):
    """The random Qwen3 in `dtype` with LoRA on every linear layer, as policy._add_lora builds
    it (peft upcasts the adapter to fp32), and a non-zero LoRA B so that A has a gradient."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(_config())
    model.load_state_dict(weights)
    model.to(dtype)
    head = model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().t().contiguous().t(), False)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
    return model


@torch.no_grad()
def _sampled_batch(model):
    """Completions sampled from the model at temperature 1, as a rollout's are."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (ROWS, PROMPT), generator=gen)
    for _ in range(COMPLETION):
        logits = model(input_ids=ids, logits_to_keep=1).logits[:, -1].float()  # [N, V]
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=gen)], 1)
    return make_batch(ids[:, :PROMPT].tolist(), ids[:, PROMPT:].tolist(), pad_id=0)


def _lora_grads(model, batch, scaler: LossScaler) -> dict[str, torch.Tensor]:
    """`Run._update`'s gradient for one micro-batch of a 20,000-token token-mean."""
    model.train()
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, batch)  # [N, C]
    adv = torch.tensor([1.0, -0.7])  # [N]
    lval, _ = loss.policy_loss(
        logp, logp.detach(), adv, batch.completion_mask, agg="token_mean", sync_stats=False
    )
    share = loss.microbatch_weight("token_mean", ROWS * COMPLETION, ROWS, TOKENS, 64)
    scaler.scale_loss(lval * share).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    scaler.unscale_(params)
    return {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}


def _worst(got: dict, want: dict) -> float:
    """The worst tensor's relative L2 error."""
    return max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)


def test_fp16_lora_gradients_match_fp32_only_with_loss_scaling():
    weights = _weights()
    ref = _policy_model(weights, torch.float32)
    batch = _sampled_batch(ref)
    want = _lora_grads(ref, batch, LossScaler(False))
    bf16 = _worst(
        _lora_grads(_policy_model(weights, torch.bfloat16), batch, LossScaler(False)), want
    )
    floor = BF16_TO_FP16 * bf16
    assert 0 < floor < 0.01, f"bf16 error {bf16:.3g}: no usable rounding floor"
    fp16 = _policy_model(weights, torch.float16)
    assert {p.dtype for p in fp16.parameters() if p.requires_grad} == {torch.float32}
    scaler = LossScaler(True)
    scaled = _lora_grads(fp16, batch, scaler)
    assert all(torch.isfinite(g).all() for g in scaled.values())
    bound = FLOOR_FACTOR * floor
    err = _worst(scaled, want)
    assert err <= bound, f"fp16 with loss scale {scaler.scale:g}: {err:.3g} > {bound:.3g}"
    unscaled = _worst(_lora_grads(fp16, batch, LossScaler(False)), want)
    assert unscaled > 10 * bound, f"fp16 without scaling: {unscaled:.3g}, bound {bound:.3g}"


def test_scaler_backs_off_grows_and_is_off_outside_float16(monkeypatch, capsys):
    monkeypatch.setattr(scaler_mod, "GROWTH_INTERVAL", 3)
    s = LossScaler(True)
    s.update(overflow=True)
    assert (s.scale, s.clean) == (2.0**15, 0)
    assert "loss scale 65536: lowered to 32768" in capsys.readouterr().out
    for _ in range(2):
        s.update(overflow=False)
    assert (s.scale, s.clean) == (2.0**15, 2)
    s.update(overflow=False)  # the third clean update in a row doubles it
    assert (s.scale, s.clean) == (2.0**16, 0)
    again = LossScaler(True)
    again.load_state_dict(s.state_dict())
    assert again.state_dict() == s.state_dict()
    off = LossScaler(False)  # bf16 / fp32: the same loss tensor, gradients untouched
    x = torch.tensor(3.0, requires_grad=True)
    assert off.scale_loss(x) is x and off.metrics() == {}
    x.grad = torch.tensor(5.0)
    off.unscale_([x])
    off.update(overflow=True)
    assert x.grad.item() == 5.0 and off.scale == 2.0**16


def test_inf_gradients_of_a_finite_loss_halve_the_scale_and_skip(monkeypatch):
    s = LossScaler(True)
    with pytest.raises(faults.NonFinite) as e:
        faults.check_update(torch.tensor(1.0), torch.tensor(float("inf")), s)
    assert e.value.reason == "scaled_gradients" and s.scale == 2.0**15
    with pytest.raises(faults.NonFinite) as e:  # a NaN loss is not the scale's doing
        faults.check_update(torch.tensor(float("nan")), torch.tensor(float("inf")), s)
    assert e.value.reason == "loss" and s.scale == 2.0**15
    faults.check_update(torch.tensor(1.0), torch.tensor(2.0), s)
    assert s.clean == 1
    with pytest.raises(faults.NonFinite) as e:  # without scaling: the old reason
        faults.check_update(torch.tensor(1.0), torch.tensor(float("inf")), LossScaler(False))
    assert e.value.reason == "gradients"
    skips = faults.Skips(limit=1)  # overflow at every scale: one line naming the cause
    skips.skip(7, "scaled_gradients")
    with pytest.raises(TrainingFault, match="float16 gradients overflowed at every loss scale"):
        skips.maybe_stop(7)


def _fp16(out, **extra):
    more = {"model.dtype": "float16", "model.trainable_extra": "[]", **extra}
    return config.load(TINY_RECIPE, fast_overrides(out, **more))


def _overflow_above(monkeypatch, limit: float) -> list[float]:
    """Plant float16 overflow: the scaled loss is inf whenever the scale exceeds `limit`
    (what a run whose gradients need a scale of `limit` or lower meets). Returns the scales
    each backward ran at."""
    scale_loss, scales = LossScaler.scale_loss, []

    def planted(self, value):
        scales.append(self.scale)
        return scale_loss(self, value) * (float("inf") if self.scale > limit else 1.0)

    monkeypatch.setattr(LossScaler, "scale_loss", planted)
    return scales


def test_fp16_overflow_redoes_the_step_and_resumes_the_scale(tmp_path, monkeypatch, capsys):
    """On the tiny model in float16, through the training loop: a run that needs a loss scale
    of 2^11 or lower, from 2^16. Step 1's updates are redone on the same rollout at each halved
    scale, five times, and the step is kept (it was skipped, and five skips in a row stopped the
    run: train.max_consecutive_skips=2 here stops it at step 2). No skip is counted, the scale
    and its retries are logged, saved, and the resumed run goes on with the scale and its
    clean-update count (growth after 3 here: a scaler that restarted the count would not retry
    at step 4, one that restarted the scale would retry five times at step 3)."""
    from ebpo_lite.train import train

    monkeypatch.setattr(scaler_mod, "GROWTH_INTERVAL", 3)
    scales = _overflow_above(monkeypatch, 2.0**11)
    out = tmp_path / "run"
    limits = {"train.steps": 4, "train.max_consecutive_skips": 2}
    train(_fp16(out, **limits, **{"train.stop_after": 2}))
    assert "redoing this step's updates on the same rollout at 2048" in capsys.readouterr().out
    train(_fp16(out, **limits, **{"train.resume": "true"}))
    recs = [r for r in read_metrics(out / "metrics.jsonl") if "train/skipped_steps" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["train/skipped_steps"] for r in recs] == [0, 0, 0, 0]
    # step 3's update is the third clean one: the scale grows to 2^12, overflows at step 4 and
    # that step is redone at 2^11 (a scaler that restarted the count would not have grown)
    assert [r["train/scale_retries"] for r in recs] == [5, 0, 0, 1]
    assert [r["train/loss_scale"] for r in recs] == [2.0**11] * 4
    assert scales[:6] == [2.0**k for k in range(16, 10, -1)]  # one backward a try (1 micro-batch)
    state = torch.load(out / "checkpoints" / "step_4" / "trainer_state.pt", weights_only=True)
    assert state["extra"]["loss_scale"] == {"scale": 2.0**11, "clean": 1}
    assert state["extra"]["skips"]["total"] == 0


def test_fp16_overflow_at_every_scale_skips_and_stops(tmp_path, monkeypatch):
    """Gradients that overflow even unscaled: the retries go down to a scale of 1, then the
    step is skipped and counted, and train.max_consecutive_skips=1 stops the run in one line."""
    from ebpo_lite.train import train

    scales = _overflow_above(monkeypatch, 0.0)
    out = tmp_path / "run"
    with pytest.raises(TrainingFault, match="overflowed at every loss scale tried, down to 1"):
        train(_fp16(out, **{"train.steps": 2, "train.max_consecutive_skips": 1}))
    assert scales == [2.0**k for k in range(16, -1, -1)]  # 2^16 ... 1: 17 tries, then the skip


def test_the_t4_combination_gets_fp32_lora_and_loss_scaling(tmp_path):
    """NF4 base computing in float16 (recipes/qwen3_4b_t4.yaml): peft's LoRA tensors are fp32
    and the scaler is on; norms trained in float16 are refused before the model loads."""
    pytest.importorskip("bitsandbytes")
    from ebpo_lite.model.policy import Policy

    policy = Policy.from_config(_fp16(tmp_path / "nf4", **{"model.load_in_4bit": "true"}))
    assert {p.dtype for p in policy.trainable_parameters()} == {torch.float32}
    assert LossScaler.for_policy(policy).enabled
    with pytest.raises(ConfigError, match="model.trainable_extra"):
        Policy.from_config(_fp16(tmp_path / "x", **{"model.trainable_extra": "[norm]"}))
