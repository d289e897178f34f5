"""The batch layout for log-probs: left-padded prompts, right-padded completions."""

from __future__ import annotations

import pytest
import torch

from ebpo_lite.model.policy import completion_logits, completion_logprobs, make_batch
from ebpo_lite.model.tiny import build_tiny_model, build_tokenizer


def _naive_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(completion)]


def test_padded_batch_matches_unpadded_forward():
    torch.manual_seed(0)
    model = build_tiny_model(seed=3).eval()
    tok = build_tokenizer()
    prompts = [tok.encode("7+5="), tok.encode("12*3="), tok.encode("1-1=")]
    completions = [tok.encode("12") + [tok.eos_token_id], tok.encode("36"), []]
    batch = make_batch(prompts, completions, tok.pad_token_id)
    assert batch.input_ids.shape == (3, 5 + 3)
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    with torch.no_grad():
        logp, entropy = completion_logprobs(model, batch, with_entropy=True)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        want = _naive_logprobs(model, p, c)
        got = logp[i, : len(c)].tolist()
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert abs(g - w) < 1e-5
    assert (entropy[:, :2] > 0).all() and (entropy <= torch.log(torch.tensor(128.0)) + 1e-4).all()


def test_make_batch_rejects_mismatched_lengths():

    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        make_batch([[1], [2]], [[3]], pad_id=0)


# ----------------------------------------------------------------------------- chunked log-probs


def _lora_model(dtype=torch.float32, hidden_size=None):
    """The tiny model + a LoRA whose B is random, so the adapter's gradients are not trivial."""
    from peft import LoraConfig, get_peft_model

    base = build_tiny_model(seed=3)
    if hidden_size:  # a hidden size unlike the vocabulary's, so shapes tell the two apart
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from ebpo_lite.model.tiny import tiny_config_kwargs

        torch.manual_seed(3)
        base = Qwen3ForCausalLM(Qwen3Config(**{**tiny_config_kwargs(), "hidden_size": hidden_size}))
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.to(dtype)


def _ragged_batch():
    tok = build_tokenizer()
    prompts = [tok.encode(p) for p in ("7+5=", "12*3=", "1-1=", "9*9=")]
    completions = [tok.encode(c) for c in ("12", "36 and more", "", "81")]
    return make_batch(prompts, completions, tok.pad_token_id)  # N = 4, C = 11


def _reference(model, batch, temperature):
    """The unchunked computation: fp32 [N, C, V] logits, log-softmax and entropy at once."""
    logits = completion_logits(model, batch)[:, :-1].float() / temperature  # [N, C, V]
    targets = batch.input_ids[:, batch.prompt_width :]  # [N, C]
    logz = torch.logsumexp(logits, dim=-1)  # [N, C]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz  # [N, C]
    with torch.no_grad():
        entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)  # [N, C]
    return logp, entropy


def _loss_and_grads(model, logp, batch):
    weights = torch.linspace(-1.0, 2.0, logp.numel()).reshape(logp.shape)  # [N, C]
    loss = (logp * weights * batch.completion_mask).sum()
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 5, 7, 44, 45, 1000, None])  # N * C = 44
def test_chunked_logprobs_entropy_and_gradients_equal_the_unchunked(temperature, chunk_rows):
    model, batch = _lora_model(), _ragged_batch()
    want_logp, want_entropy = _reference(model, batch, temperature)
    want_grads = _loss_and_grads(model, want_logp, batch)
    logp, entropy = completion_logprobs(
        model, batch, with_entropy=True, temperature=temperature, chunk_rows=chunk_rows
    )
    grads = _loss_and_grads(model, logp, batch)
    assert logp.dtype == torch.float32 and logp.shape == want_logp.shape == (4, 11)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=2e-6)
    assert not entropy.requires_grad
    for g, w in zip(grads, want_grads):  # fp32 round-off relative to the largest entry
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * w.abs().max().item())
    assert max(w.abs().max().item() for w in want_grads) > 1e-2  # the gradients are not trivial


def test_temperature_scales_the_logits_and_greedy_scores_at_one():
    model, batch = _lora_model(), _ragged_batch()
    with torch.no_grad():
        at_1 = completion_logprobs(model, batch)[0]
        at_07, ent_07 = completion_logprobs(model, batch, with_entropy=True, temperature=0.7)
        at_0 = completion_logprobs(model, batch, temperature=0.0)[0]
        want_07, want_ent_07 = _reference(model, batch, 0.7)
    torch.testing.assert_close(at_07, want_07, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent_07, want_ent_07, rtol=0, atol=2e-6)
    assert (at_07 - at_1).abs().max() > 0.05  # temperature matters
    torch.testing.assert_close(at_0, at_1, rtol=0, atol=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        completion_logprobs(model, batch, temperature=-1.0)


def test_no_fp32_full_vocabulary_copy_is_kept_for_backward():
    """A bf16 model: what autograd keeps for the log-probs is the bf16 logits, not fp32 ones."""
    model, batch = _lora_model(torch.bfloat16, hidden_size=256), _ragged_batch()
    n, c = batch.completion_mask.shape
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = completion_logprobs(model, batch, with_entropy=True, chunk_rows=8)
    big = [t for t in kept if t.shape[-1:] == (128,) and t.numel() >= n * c * 128]  # [N, C+, V]
    assert big and all(t.dtype == torch.bfloat16 for t in big), [(t.dtype, t.shape) for t in big]
    logp.sum().backward()  # and backward runs from what was kept


# ----------------------------------------------------------------------------- shared prompts


def _grouped_rows(tok, group: int = 3):
    """Ragged prompts, each `group` times with ragged completions (one empty), shuffled rows."""
    prompts = [tok.encode(p) for p in ("7+5=", "12*34=", "1-1=")]
    texts = ["12", "36 and more", "", "81", "4080", "0", "x", "408", "00"]
    rows = [(prompts[k % 3], tok.encode(texts[k % len(texts)])) for k in range(3 * group)]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1)).tolist()
    return [rows[i][0] for i in order], [rows[i][1] for i in order]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_shared_prompts_equal_the_full_batch(attn):
    """Logits, log-probs and every LoRA gradient of the shared-prompt forward equal the full
    batch's to fp32 round-off, in train mode, with ragged (left-padded) prompts."""
    tok = build_tokenizer()
    model = _lora_model()
    model.base_model.model.config._attn_implementation = attn
    model.train()
    prompts, completions = _grouped_rows(tok)
    full = make_batch(prompts, completions, tok.pad_token_id)
    shared = make_batch(prompts, completions, tok.pad_token_id, share_prompts=True)
    assert full.prompt_index is None
    assert len(shared.prompt_rows) == 3 and len(shared.prompt_index) == 9
    for i, u in enumerate(shared.prompt_index.tolist()):  # each row points at its own prompt
        assert prompts[shared.prompt_rows[u]] == prompts[i]

    grads, logps, logits = [], [], []
    for batch in (full, shared):
        model.zero_grad()
        logits.append(completion_logits(model, batch).detach())
        logp, _ = completion_logprobs(model, batch)  # [N, C]
        (logp * batch.completion_mask).sum().backward()
        logps.append(logp.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    real = full.completion_mask.bool()
    assert torch.allclose(logits[0][:, :-1][real], logits[1][:, :-1][real], atol=1e-5, rtol=0)
    assert (logps[0] - logps[1]).abs()[real].max() < 1e-5
    for name, g in grads[0].items():
        assert g.abs().sum() > 0, name  # every LoRA weight is reached, the prompt's ones too
        assert torch.allclose(g, grads[1][name], atol=1e-5, rtol=1e-4), name


def test_shared_prompts_run_each_distinct_prompt_once():
    tok = build_tokenizer()
    model = _lora_model().eval()
    prompts, completions = _grouped_rows(tok, group=4)
    seen = []

    def record(module, args, kwargs, output):
        seen.append(tuple(kwargs["input_ids"].shape))

    hook = model.register_forward_hook(record, with_kwargs=True)
    with torch.no_grad():
        completion_logits(model, make_batch(prompts, completions, 0, share_prompts=True))
        completion_logits(model, make_batch(prompts, completions, 0))
    hook.remove()
    width_p = max(map(len, prompts))
    width_c = max(map(len, completions))
    assert seen == [(3, width_p), (12, width_c), (12, width_p + width_c)]


def test_distinct_prompts_and_checkpointing_run_the_full_batch():
    tok = build_tokenizer()
    prompts = [tok.encode(p) for p in ("7+5=", "12*34=")]
    assert make_batch(prompts, [[1], [2]], 0, share_prompts=True).prompt_index is None
    model = _lora_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    prompts, completions = _grouped_rows(tok)
    shared = make_batch(prompts, completions, tok.pad_token_id, share_prompts=True)
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    logp, _ = completion_logprobs(model, shared)
    hook.remove()
    assert len(calls) == 1  # one full forward: checkpointed layers would drop the prompt cache
    full = make_batch(prompts, completions, tok.pad_token_id)
    assert torch.allclose(logp, completion_logprobs(model, full)[0], atol=1e-6)


def test_shared_prompt_gradients_are_the_same_every_time_on_two_threads():
    """Each prompt's logits are gathered to its rows with `index_select`, whose CPU backward
    sums in a fixed order. Advanced indexing (`logits[index]`) backpropagates through
    `index_put_(accumulate=True)`, which on CPU adds concurrently from the threads: with the
    rows of a prompt spread over both threads' halves, as length-sorted micro-batches spread
    them, 175 of 200 repeats gave distinct gradients, and two runs of the same seed parted at
    round-off within a few steps (train.threads=2)."""
    tok = build_tokenizer()
    model = _lora_model()
    model.train()
    prompts, completions = _grouped_rows(tok, group=86)  # 258 rows, 3 prompts, shuffled
    batch = make_batch(prompts, completions, tok.pad_token_id, share_prompts=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = set()
        for _ in range(12):
            model.zero_grad()
            logp, _ = completion_logprobs(model, batch)  # [N, C]
            (logp * batch.completion_mask).sum().backward()
            seen.add(
                b"".join(p.grad.numpy().tobytes() for p in model.parameters() if p.grad is not None)
            )
    finally:
        torch.set_num_threads(threads)
    assert len(seen) == 1
