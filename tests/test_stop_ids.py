"""Every sampler stops at every end-of-turn id the model's generation config lists.

The model is the warmed-up tiny model saved with a `generation_config.json` whose `eos_token_id`
lists two ids, as Qwen3 / Llama 3 chat models do (`<|im_end|>` / `<|eot_id|>` beside the
tokenizer's `eos_token`): the tokenizer's `<eos>` and a digit the model emits before it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.data.loader import arithmetic_examples
from ebpo_lite.model.policy import Policy
from ebpo_lite.rollout import cut_at_stop, stop_token_ids
from tests.conftest import TINY_RECIPE, fast_overrides


def test_stop_ids_read_int_or_list_and_add_the_tokenizers_eos():
    tok = SimpleNamespace(eos_token_id=7)
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=[151645, 151643])) == (
        151645,
        151643,
        7,
    )
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=[3, 7, 3])) == (3, 7)
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=7)) == (7,)
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=None)) == (7,)
    assert stop_token_ids(tok, None) == (7,)
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), None) == ()


def test_cut_at_stop_keeps_the_first_stop_id_and_nothing_after():
    assert cut_at_stop([5, 9, 6, 1, 0], (1, 9)) == ([5, 9], True)
    assert cut_at_stop([5, 6], (1, 9)) == ([5, 6], False)
    assert cut_at_stop([], (1,)) == ([], False)


def _cfg(out: Path, *extra: str) -> config.Config:
    return config.load(
        TINY_RECIPE, fast_overrides(out, **{"model.trainable_extra": "[]"}) + [*extra]
    )


def _prompts(policy: Policy, n: int = 16) -> list[list[int]]:
    exs = arithmetic_examples(n, seed=5, split="train")
    return [policy.tokenizer.encode(ex.prompt, add_special_tokens=False) for ex in exs]


def _greedy(sampler, prompts):
    return sampler.generate(prompts, 1, seed=0, temperature=0.0)


def _two_stop_model(tmp_path: Path, make, *extra: str):
    """(policy on a copy of the tiny model whose generation config lists [<eos>, X], prompt, X).

    X is the first token of a greedy completion that is longer than one token plus <eos>, so
    stopping at X is visible: that completion must become exactly [X].
    """
    cfg = _cfg(tmp_path / "a", *extra)
    policy = Policy.from_config(cfg)
    prompts = _prompts(policy)
    sampler = make(cfg, policy)
    roll = _greedy(sampler, prompts)
    eos = policy.tokenizer.eos_token_id
    row = next(i for i, c in enumerate(roll.completion_ids) if len(c) >= 3 and c[-1] == eos)
    x = roll.completion_ids[row][0]
    assert x != eos
    sampler.close()
    folder = tmp_path / "two_stop_model"
    shutil.copytree(policy.base_path, folder)
    gen_file = folder / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    gen["eos_token_id"] = [eos, x]
    gen_file.write_text(json.dumps(gen))
    cfg = _cfg(tmp_path / "b", f"model.name={folder}", *extra)
    two = Policy.from_config(cfg)
    assert two.stop_ids == (eos, x)
    return cfg, two, prompts, row, x


def _check_cut(policy: Policy, prompts, roll, row: int, x: int) -> None:
    stops = set(policy.stop_ids)
    assert roll.completion_ids[row] == [x] and roll.finished[row]
    for ids, done in zip(roll.completion_ids, roll.finished):
        assert not stops & set(ids[:-1])  # nothing is kept after a stop id
        assert done == (bool(ids) and ids[-1] in stops)
    batch = policy.batch(prompts, roll.completion_ids)  # the mask the loss trains on
    assert batch.completion_mask[row].sum().item() == 1.0


def test_hf_sampler_stops_at_every_generation_config_stop_id(tmp_path):
    from ebpo_lite.rollout.hf import HFRollout

    def make(cfg, policy):
        return HFRollout(cfg.rollout, policy)

    cfg, policy, prompts, row, x = _two_stop_model(tmp_path, make)
    roll = _greedy(make(cfg, policy), prompts)
    _check_cut(policy, prompts, roll, row, x)
    sampled = make(cfg, policy).generate(prompts, 4, seed=1, temperature=1.0)
    stops = set(policy.stop_ids)
    assert all(not stops & set(c[:-1]) for c in sampled.completion_ids)


@pytest.mark.vllm
def test_vllm_sampler_stops_at_every_generation_config_stop_id(tmp_path):
    pytest.importorskip("vllm")
    from ebpo_lite.rollout.vllm import VLLMRollout

    extra = ("rollout.backend=vllm", "train.threads=1", "rollout.kv_cache_gb=0.25")
    torch.manual_seed(0)
    cfg, policy, prompts, row, x = _two_stop_model(tmp_path, VLLMRollout, *extra)
    sampler = VLLMRollout(cfg, policy)
    try:
        roll = _greedy(sampler, prompts)
        _check_cut(policy, prompts, roll, row, x)
        # the sampler's log-probs are trimmed with the completions
        assert [len(s) for s in roll.sampler_logprobs] == [len(c) for c in roll.completion_ids]
    finally:
        sampler.close()
