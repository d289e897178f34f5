"""Tool use through the trainer (issue 41): recipes/tiny_tools_cpu.yaml trains from the CLI's
function and from the Python API with an environment class, logs what the episodes did, shows
the conversation, and resumes exactly (environments seeded per group).

The tiny model's tool warm-up is shortened (60 steps: it already calls the calculator on some
problems); every component is the real one.
"""

from __future__ import annotations

import json

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.engine.metrics import read_metrics
from ebpo_lite.train import train
from tests.conftest import REPO, fast_overrides

TOOLS_RECIPE = REPO / "recipes" / "tiny_tools_cpu.yaml"
FAST = {"model.sft_warmup_steps": 60, "log.completions_every": 1, "log.show_completions": 1}


def _cfg(out, **extra):
    return config.load(TOOLS_RECIPE, fast_overrides(out, **{**FAST, **extra}))


def _adapter(out, step):
    from safetensors.torch import load_file

    return load_file(out / "checkpoints" / f"step_{step}" / "adapter_model.safetensors")


@pytest.mark.slow
def test_the_tool_recipe_trains_logs_episodes_and_resumes_exactly(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    # 96 new tokens: room for a tool's answer after the call. The recipe's 32 fit the
    # calculator's short results, but after this 60-step warm-up many calls are malformed, and
    # the error that answers them is longer: with 32 it is rolled back, leaving no tool turn.
    common = {
        "train.steps": 4,
        "rollout.group_size": 4,
        "train.prompts_per_step": 8,
        "rollout.max_new_tokens": 96,
    }
    summary = train(_cfg(a, **common))
    said = capsys.readouterr().out
    assert "tools: plain tools [calculator] (in a contained worker)" in said
    assert summary["steps_done"] == 4 and "before/env/tool_calls" in summary
    steps = [r for r in read_metrics(a / "metrics.jsonl") if "train/loss" in r]
    for key in ("env/turns", "env/tool_calls", "env/called_frac", "env/tool_seconds"):
        assert all(key in r for r in steps), key
    assert any(r["env/tool_calls"] > 0 for r in steps)  # the warmed model does call
    assert all(1.0 <= r["env/turns"] <= 2.0 for r in steps)  # env.max_turns: 2
    rows = [json.loads(line) for line in (a / "completions.jsonl").read_text().splitlines()]
    answered = [r for r in rows if any(m["role"] == "tool" for m in r["messages"])]
    assert answered and all("<<tool " in r["completion"] for r in answered)
    assert all(r["messages"][0]["role"] == "assistant" for r in rows)
    assert all(r["tool_calls"] >= 1 for r in answered)
    assert all(r["ended"] in ("answer", "max_turns", "budget") for r in rows)
    # the same run stopped after 2 steps and resumed: the same adapter, bit for bit
    train(_cfg(b, **common, **{"train.stop_after": 2}))
    train(_cfg(b, **common, **{"train.resume": "true"}))
    wa, wb = _adapter(a, 4), _adapter(b, 4)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    mb = [r for r in read_metrics(b / "metrics.jsonl") if "train/loss" in r]
    assert [r["env/tool_calls"] for r in steps] == [r["env/tool_calls"] for r in mb]


DESK = '''
from ebpo_lite.env.calculator import calculator


class Desk:
    def reset(self, **columns) -> None:
        self.calls = 0

    def calculator(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression.

        Args:
            expression: integers with +, - and *
        """
        self.calls += 1
        return calculator(expression)


def used_the_desk(completions, environments, **kwargs):
    return [float(e.calls > 0) for e in environments]
'''


@pytest.mark.slow
def test_the_python_api_takes_an_environment_class_and_rewards_read_it(tmp_path, monkeypatch):
    import dataclasses

    from ebpo_lite import train_run

    (tmp_path / "desk_env.py").write_text(DESK)
    monkeypatch.syspath_prepend(str(tmp_path))
    from desk_env import Desk

    cfg = _cfg(tmp_path / "api", **{"train.steps": 2})
    cfg = dataclasses.replace(
        cfg,
        env=dataclasses.replace(cfg.env, tools=[]),
        reward=dataclasses.replace(
            cfg.reward, functions=["arithmetic_answer", "desk_env:used_the_desk"]
        ),
    )
    result = train_run(cfg, environment=Desk)
    assert result.summary["steps_done"] == 2
    steps = [r for r in read_metrics(tmp_path / "api" / "metrics.jsonl") if "train/loss" in r]
    assert any(r["env/tool_calls"] > 0 for r in steps)
    assert all(r.get("reward/errors", 0) == 0 for r in steps)  # `environments` reached it
    # the reward saw each episode's own instance: episodes that called scored 1 more
    rows = [
        json.loads(line)
        for line in (tmp_path / "api" / "completions.jsonl").read_text().splitlines()
    ]
    for r in rows:
        if r["reward"] is not None and r["tool_calls"] == 0:
            assert r["reward"] in (0.0, 1.0)
    assert any(r["reward"] is not None and r["reward"] >= 1.0 and r["tool_calls"] for r in rows)
