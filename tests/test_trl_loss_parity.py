"""Every loss of the menu equals TRL 1.16's on the same batch, value and gradient (issue 33).

TRL's own `GRPOTrainer._compute_loss` runs on a tiny model built here, its forward included; the
test only listens to the per-token log-probs and entropies that forward returns (a pass-through
wrapper) and hands the very same tensors to `ebpo_lite.algo.loss.policy_loss`. Both losses are then
functions of one tensor, so value and gradient must agree to float32 round-off. Where the two
define a loss differently on purpose the test pins the difference (docs/losses.md, "Where this
differs from TRL"). Needs trl (CI tier `.ci/tier_integrations.sh`); skipped where it is missing.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.trl
pytest.importorskip("trl")

from ebpo_lite.algo import loss  # noqa: E402

torch.set_num_threads(1)

N, T, MAX_LEN = 8, 6, 8  # sequences, completion positions, max_completion_length
LENGTHS = [6, 6, 5, 4, 6, 3, 6, 2]  # valid tokens per sequence
ADV = [1.3, -0.7, 0.4, -1.6, 0.0, 2.1, -0.2, 0.9]
FINISHED = [True, False, True, True, False, True, True, True]  # False: hit MAX without a stop


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from ebpo_lite.model.tiny import build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("tiny")
    build_tiny_model(0).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def _trainer(tiny_dir, tmp_path, **options):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=N,
        num_generations=4,
        max_completion_length=MAX_LEN,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **options,
    )
    tr = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir),
        processing_class=AutoTokenizer.from_pretrained(tiny_dir),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": f"{i}+1="} for i in range(8)]),
    )
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by training_step in a real run
    return tr


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 128, (N, 4), generator=g)
    completion_ids = torch.randint(3, 128, (N, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()  # [N, T]
    return prompt_ids, completion_ids, mask


def trl_and_ours(tr, ours: dict, *, drop_truncated=False, sampler_shift=None, seed=0):
    """(TRL's loss, ours, d TRL / d logp, d ours / d logp) on one batch of the trainer's forward.

    `drop_truncated`: TRL's `mask_truncated_completions`, which TRL applies in generation
    (grpo_trainer.py: completion_mask * ~is_truncated, num_items_in_batch from that mask); ours is
    run.py's mask. `sampler_shift`: a vLLM log-prob gap for the importance-sampling correction.
    """
    prompt_ids, completion_ids, mask = _batch(seed)
    g = torch.Generator().manual_seed(seed + 1)
    seen = {}
    forward = tr._get_per_token_logps_and_entropies

    def listen(*args, **kwargs):  # pass-through: keeps the tensors TRL's own forward returned
        logps, entropies, aux = forward(*args, **kwargs)
        seen["logp"], seen["entropy"] = logps, entropies
        return logps, entropies, aux

    tr._get_per_token_logps_and_entropies = listen
    with torch.no_grad():
        base, _, _ = forward(
            tr.model, torch.cat([prompt_ids, completion_ids], 1), torch.ones(N, 4 + T), T
        )
    old = base + 0.3 * torch.randn(N, T, generator=g)  # ratios spread over the clip region
    ref = base + 0.2 * torch.randn(N, T, generator=g)
    loss_mask = mask * torch.tensor(FINISHED)[:, None].long() if drop_truncated else mask
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": loss_mask,
        "advantages": torch.tensor(ADV),
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": loss_mask.sum(),
    }
    sampler = None
    if sampler_shift is not None:
        sampler = old - sampler_shift * torch.randn(N, T, generator=g)
        # as TRL's generation step makes it (token_truncate): padding's ratio is exp(0) = 1
        inputs["importance_sampling_ratio"] = torch.exp((old - sampler) * mask).clamp(max=2.0)
        tr.use_vllm = tr.vllm_importance_sampling_correction = True
    trl_loss = tr._compute_loss(tr.model, inputs)
    logp, entropy = seen["logp"], seen["entropy"]
    if drop_truncated:  # ours: what run.py does with the rollout's `finished` flags
        mask = loss.drop_truncated(mask, FINISHED)
    kw = {"ref_logp": ref, "max_tokens": MAX_LEN, "entropy": entropy, **ours}
    if sampler is not None:
        kw.update(sampler_logp=sampler, is_correction="token", is_cap=2.0)
    our_loss, _ = loss.policy_loss(logp, old, torch.tensor(ADV), mask, **kw)
    g_trl = torch.autograd.grad(trl_loss, logp, retain_graph=True)[0]
    g_ours = torch.autograd.grad(our_loss, logp)[0]
    return trl_loss, our_loss, g_trl, g_ours


def assert_same(trl_loss, our_loss, g_trl, g_ours):
    assert torch.isfinite(our_loss) and g_ours.abs().sum() > 0
    torch.testing.assert_close(our_loss, trl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_ours, g_trl, rtol=1e-5, atol=1e-7)


# (TRL GRPOConfig options, our policy_loss options[, TRL-side batch options])
CASES = {
    "grpo": ({"loss_type": "grpo"}, {"loss_type": "grpo"}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"loss_type": "dr_grpo"}),
    "dapo": ({"loss_type": "dapo"}, {"loss_type": "dapo"}),
    "bnpo": ({"loss_type": "bnpo"}, {"loss_type": "bnpo"}),
    "luspo": ({"loss_type": "luspo"}, {"loss_type": "luspo"}),
    "sapo": ({"loss_type": "sapo"}, {"loss_type": "sapo"}),
    "vespo": ({"loss_type": "vespo"}, {"loss_type": "vespo"}),
    # CISPO's cap: TRL's epsilon_high is the cap itself, ours is 1 + clip_eps_high (pinned below)
    "cispo": (
        {"loss_type": "cispo", "epsilon_high": 1.25},
        {"loss_type": "cispo", "clip_eps_high": 0.25},
    ),
    "dapo_clip_higher": (
        {"loss_type": "dapo", "epsilon_high": 0.28},
        {"loss_type": "dapo", "clip_eps_high": 0.28},
    ),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    ),
    "luspo_sequence": (
        {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    ),
    "cispo_sequence": (
        {"loss_type": "cispo", "epsilon_high": 1.1, "importance_sampling_level": "sequence"},
        {"loss_type": "cispo", "clip_eps_high": 0.1, "importance_sampling_level": "sequence"},
    ),
    "sapo_temperatures": (
        {"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
        {
            "loss_type": "sapo",
            "options": {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
        },
    ),
    "vespo_params": (
        {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 4.0},
        {"loss_type": "vespo", "options": {"vespo": (1.5, 3.0, 3.0, 4.0)}},
    ),
    "delta_grpo": (
        {"loss_type": "grpo", "delta": 1.3},
        {"loss_type": "grpo", "options": {"delta": 1.3}},
    ),
    "delta_dapo": (
        {"loss_type": "dapo", "delta": 1.3},
        {"loss_type": "dapo", "options": {"delta": 1.3}},
    ),
    "top_entropy_dapo": (
        {"loss_type": "dapo", "top_entropy_quantile": 0.3},
        {"loss_type": "dapo", "top_entropy_quantile": 0.3},
    ),
    "top_entropy_grpo": (
        {"loss_type": "grpo", "top_entropy_quantile": 0.15},
        {"loss_type": "grpo", "top_entropy_quantile": 0.15},
    ),
    "kl_dapo": (
        {"loss_type": "dapo", "beta": 0.05, "use_bias_correction_kl": False},
        {"loss_type": "dapo", "kl_coef": 0.05},
    ),
    "kl_bias_corrected_grpo": (
        {"loss_type": "grpo", "beta": 0.05, "use_bias_correction_kl": True},
        {"loss_type": "grpo", "kl_coef": 0.05, "use_bias_correction_kl": True},
    ),
    "kl_bias_corrected_gspo": (
        {
            "loss_type": "grpo",
            "beta": 0.05,
            "importance_sampling_level": "sequence",
            "use_bias_correction_kl": True,
        },
        {
            "loss_type": "grpo",
            "kl_coef": 0.05,
            "importance_sampling_level": "sequence",
            "use_bias_correction_kl": True,
        },
    ),
    "kl_luspo": (
        {"loss_type": "luspo", "beta": 0.05, "use_bias_correction_kl": False},
        {"loss_type": "luspo", "kl_coef": 0.05},
    ),
    "mask_truncated_dapo": (
        {"loss_type": "dapo", "mask_truncated_completions": True},
        {"loss_type": "dapo"},
        {"drop_truncated": True},
    ),
    "mask_truncated_grpo": (
        {"loss_type": "grpo", "mask_truncated_completions": True},
        {"loss_type": "grpo"},
        {"drop_truncated": True},
    ),
    "mask_truncated_dr_grpo_kl": (
        {
            "loss_type": "dr_grpo",
            "mask_truncated_completions": True,
            "beta": 0.05,
            "use_bias_correction_kl": False,
        },  # fmt: skip
        {"loss_type": "dr_grpo", "kl_coef": 0.05},
        {"drop_truncated": True},
    ),
    "is_correction_dapo": (
        {"loss_type": "dapo"},
        {"loss_type": "dapo"},
        {"sampler_shift": 0.5},
    ),
    "is_correction_vespo": (
        {"loss_type": "vespo"},
        {"loss_type": "vespo"},
        {"sampler_shift": 0.5},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_equals_trl(tiny_dir, tmp_path, name):
    trl_options, ours, *batch = CASES[name]
    tr = _trainer(tiny_dir, tmp_path, **trl_options)
    assert_same(*trl_and_ours(tr, ours, **(batch[0] if batch else {})))


def test_cispo_cap_convention_is_pinned(tiny_dir, tmp_path):
    """Ours caps CISPO's ratio at 1 + clip_eps_high (MiniMax-M1's bound); TRL's epsilon_high is
    the cap. The same number in both therefore gives different losses."""
    tr = _trainer(tiny_dir, tmp_path, loss_type="cispo", epsilon_high=1.1)
    trl_loss, our_loss, g_trl, g_ours = trl_and_ours(
        tr, {"loss_type": "cispo", "clip_eps_high": 1.1}
    )
    assert not torch.allclose(g_ours, g_trl, rtol=1e-3, atol=1e-5)


def test_kl_default_differs_from_trls_on_purpose(tiny_dir, tmp_path):
    """TRL 1.16 multiplies the KL by the ratio by default (use_bias_correction_kl=True); ours
    defaults to the plain k3 term (algo.use_bias_correction_kl=false): equal value on the same
    ratios is not guaranteed, and the gradients differ."""
    tr = _trainer(tiny_dir, tmp_path, loss_type="dapo", beta=0.05)
    _, _, g_trl, g_ours = trl_and_ours(tr, {"loss_type": "dapo", "kl_coef": 0.05})
    assert not torch.allclose(g_ours, g_trl, rtol=1e-3, atol=1e-5)
