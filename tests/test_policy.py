"""The batch layout for log-probs: left-padded prompts, right-padded completions."""

from __future__ import annotations

import torch

from ebpo_lite.policy import completion_logprobs, make_batch
from ebpo_lite.tiny import build_tiny_model, build_tokenizer


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
    import pytest

    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        make_batch([[1], [2]], [[3]], pad_id=0)
