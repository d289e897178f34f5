"""Gradients through the NF4 (bitsandbytes 4-bit) base are right, on CPU (issue 14, part 1).

The reference for every NF4 policy is the same policy with each `Linear4bit` replaced by an
ordinary linear layer holding that layer's own dequantized weights (`dequantize_4bit`): the same
function, so its LoRA gradients are what the NF4 gradients must be. Before each gradient the
policy has sampled and scored in eval mode without grad, the forward after which bitsandbytes
0.50.2 used to repack the weight for its non-differentiable CPU gemv kernel
(`policy.keep_nf4_differentiable`; docs/qlora.md).

Tolerances (relative L2 error per gradient tensor, measured on this batch):
- fp32 compute: both paths are `F.linear` on the same dequantized values in the forward and a
  matmul with them in the backward; measured error 0 (bit-identical). Bound: 1e-5 (fp32 round-off
  of a different accumulation order, should a kernel change it).
- bf16 compute: measured at most 0.023. That is the bf16 noise floor, not a bias: the same
  dequantized reference run in bf16 against fp32 differs by 0.020 on this batch (bf16 has 8
  mantissa bits, unit round-off 2^-8 = 0.004 per operation, two layers deep); peft's 4-bit LoRA
  layer rounds the LoRA output to bf16 before adding it, its plain layer after. Bound: 0.06.
  A base that is not differentiable with respect to its input (the repacked path) puts layer 0's
  LoRA gradients off by 0.89 (fp32 and bf16 alike): 15x the bound (see
  `test_the_check_fails_when_the_base_drops_its_input_gradient`).
- Gradient checkpointing on vs off: the recomputed forward is the same computation; measured 0.
  Bound: 1e-6 in both dtypes (fp32 round-off).
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from ebpo_lite import config, loss  # noqa: E402
from ebpo_lite.policy import Policy, completion_logprobs, keep_nf4_differentiable  # noqa: E402
from ebpo_lite.rollout.hf import HFRollout  # noqa: E402
from tests.conftest import TINY_RECIPE  # noqa: E402

TOL = {"float32": 1e-5, "bfloat16": 0.06}  # relative L2 per gradient tensor (module docstring)
TOL_CKPT = 1e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random-init 2-layer Qwen3 (GQA, q/k norms, untied embeddings) and the tiny tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ebpo_lite.tiny import build_tokenizer, tiny_config_kwargs

    out = tmp_path_factory.mktemp("nf4_model")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**tiny_config_kwargs())).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def _policy(model_dir, tmp_path, dtype: str, four_bit: bool = True, ckpt: bool = False) -> Policy:
    cfg = config.load(
        TINY_RECIPE,
        [
            f"output_dir={tmp_path}",
            f"model.name={model_dir}",
            "model.trainable_extra=[]",  # LoRA only: every trainable tensor has a 4-bit twin
            f"model.load_in_4bit={str(four_bit).lower()}",
            f"model.dtype={dtype}",
            f"model.gradient_checkpointing={str(ckpt).lower()}",
        ],
    )
    policy = Policy.from_config(cfg, log=lambda *a: None)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at zero, which would make every LoRA A gradient zero
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return policy


def _four_bit_layers(policy: Policy) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in policy.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _dequantized_twin(policy: Policy, model_dir, tmp_path, dtype: str) -> Policy:
    """The full-precision policy with each 4-bit layer's dequantized weights and the same LoRA."""
    ref = _policy(model_dir, tmp_path, dtype, four_bit=False)
    mods = dict(ref.model.named_modules())
    layers = _four_bit_layers(policy)
    assert len(layers) == 14  # q, k, v, o, gate, up, down in each of the 2 layers
    with torch.no_grad():
        for name, mod in layers.items():
            w = bnb.functional.dequantize_4bit(mod.weight.data, mod.weight.quant_state)
            mods[name].weight.copy_(w.to(mods[name].weight.dtype))
    ref.load_trainable_state(policy.trainable_state())
    return ref


def _sample_and_score(policy: Policy) -> list[list[int]]:
    """What a training step does before its gradient: sample (HF generate; the decode steps run
    [N, 1, h] through every 4-bit layer) and score in eval mode, both without grad."""
    roll = HFRollout(config.RolloutConfig(max_new_tokens=6), policy).generate(
        [[5, 6, 7], [9, 10]], group_size=2, seed=3
    )
    policy.token_logprobs([[5, 6, 7]] * 2 + [[9, 10]] * 2, roll.completion_ids)
    return roll.completion_ids


def _rl_gradients(policy: Policy) -> dict[str, torch.Tensor]:
    """LoRA gradients of ebpo_lite's clipped-surrogate loss on a fixed ragged batch."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 100, (k,), generator=gen).tolist() for k in (3, 5, 6, 2)]
    completions = [torch.randint(4, 100, (k,), generator=gen).tolist() for k in (8, 4, 7, 1)]
    b = policy.batch(prompts, completions)
    policy.model.train()
    policy.model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(policy.model, b)  # [N, C]
    adv = torch.randn(logp.shape[0], generator=gen)  # [N]
    old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen)  # [N, C]: some clipped
    value, _ = loss.policy_loss(logp, old, adv, b.completion_mask)
    value.backward()
    return {
        n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.requires_grad
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_gradients_through_nf4_equal_the_dequantized_base(model_dir, tmp_path, dtype):
    policy = _policy(model_dir, tmp_path, dtype)
    ref = _dequantized_twin(policy, model_dir, tmp_path, dtype)
    sampled = _sample_and_score(policy)
    if dtype == "float32":  # the sampling path too: same logits, so the same seeded samples
        assert sampled == _sample_and_score(ref)
    got, want = _rl_gradients(policy), _rl_gradients(ref)
    assert got.keys() == want.keys() and all("lora_" in n for n in got)
    errors = {n: _rel(got[n], want[n]) for n in got}
    worst = max(errors, key=errors.get)
    print(f"{dtype}: worst relative gradient error {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= TOL[dtype], worst
    # below the 4-bit layers: layer 0's LoRA A gets its gradient through every 4-bit layer above
    # it (o_proj, the MLP, all of layer 1): nonzero and equal to the reference's
    bottom = [n for n in got if ".layers.0." in n and "lora_A" in n]
    assert len(bottom) == 7
    assert all(want[n].norm() > 0.1 for n in bottom)
    layers = _four_bit_layers(policy).values()  # and no layer was repacked for the CPU gemv
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", 0) for m in layers)


def test_the_check_fails_when_the_base_drops_its_input_gradient(model_dir, tmp_path):
    """With bitsandbytes' CPU repacking left on (its default), the comparison above fails."""
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    policy = _policy(model_dir, tmp_path, "bfloat16")
    ref = _dequantized_twin(policy, model_dir, tmp_path, "bfloat16")
    for mod in _four_bit_layers(policy).values():
        mod.support_avx512bf16_for_cpu = True  # undo keep_nf4_differentiable
    _sample_and_score(policy)
    with pytest.warns(UserWarning, match="gemv_4bit: an autograd kernel was not registered"):
        got = _rl_gradients(policy)
    want = _rl_gradients(ref)
    bottom = [n for n in got if ".layers.0." in n and "lora_A" in n]
    assert min(_rel(got[n], want[n]) for n in bottom) > 5 * TOL["bfloat16"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_checkpointing_does_not_change_nf4_gradients(model_dir, tmp_path, dtype):
    plain = _policy(model_dir, tmp_path, dtype)
    ckpt = _policy(model_dir, tmp_path, dtype, ckpt=True)
    ckpt.load_trainable_state(plain.trainable_state())
    _sample_and_score(plain)
    _sample_and_score(ckpt)
    a, b = _rl_gradients(plain), _rl_gradients(ckpt)
    assert a.keys() == b.keys()
    worst = max(_rel(b[n], a[n]) for n in a)
    print(f"{dtype}: checkpointing on vs off, worst relative gradient difference {worst:.1e}")
    assert worst <= TOL_CKPT


@pytest.mark.parametrize("shape", [(3, 5, 128), (1, 1, 128), (1, 128)], ids=["BxT", "1x1", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_4bit_layer_is_differentiable_in_its_input_after_a_no_grad_forward(shape, dtype):
    """One `Linear4bit` at the shapes training and sampling give it (a batch of sequences, one
    decode token, one row): after an eval-mode no-grad forward, d out / d x = W_dq in train and
    in eval mode."""
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.05
    layer = torch.nn.Sequential(bnb.nn.Linear4bit(128, 64, bias=False, compute_dtype=dtype))
    layer[0].weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
    layer[0].weight._quantize("cpu")
    assert keep_nf4_differentiable(layer) == 1
    w_dq = bnb.functional.dequantize_4bit(layer[0].weight.data, layer[0].weight.quant_state)
    x = torch.randn(shape, dtype=dtype)
    layer.eval()
    with torch.no_grad():
        y0 = layer(x)  # the forward that repacked (bnb 0.50.2, AVX512-BF16 CPUs)
    for mode in (True, False):
        layer.train(mode)
        xg = x.clone().requires_grad_(True)
        y = layer(xg)
        torch.testing.assert_close(y, y0, rtol=0, atol=0)
        y.backward(torch.ones_like(y))
        assert xg.grad is not None
        want = torch.ones(shape, dtype=dtype)[..., :64] @ w_dq.to(dtype)  # [.., 128]
        torch.testing.assert_close(xg.grad, want)
        assert xg.grad.abs().sum() > 0
