"""Multi-turn tool use (issue 41, docs/tools.md): the episode loop, its containment, and the
tool mask in the loss.

The loop and host tests script the model's turns (`Scripted`: what a model would write, decided
by the test, since the tiny model cannot be made to write a hung or malformed call on cue); the
tool host, its worker process, the tools, the tokenizer and the format are the real ones. The
loss tests run the real tiny policy on real tool trajectories.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.data.example import Example
from ebpo_lite.engine import episodes as ep_mod
from ebpo_lite.engine.episodes import CUT_MARKER, EpisodeRunner, episode_metrics
from ebpo_lite.env import contract
from ebpo_lite.env.calculator import calculator
from ebpo_lite.env.formats import TinyFormat
from ebpo_lite.env.host import make_host
from ebpo_lite.model.tiny import build_tokenizer
from ebpo_lite.rollout.common import Rollout, cut_at_stop
from tests.conftest import REPO, fast_overrides

TOOLS_RECIPE = REPO / "recipes" / "tiny_tools_cpu.yaml"
TOK = build_tokenizer()
EOS = TOK.eos_token_id


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class Scripted:
    """A sampler whose turns the test writes: `script[prompt][k]` is the text of the k-th model
    turn of the episodes of that prompt (an `<eos>` is added, as the model's stop). It records
    every call: (the sequences it was asked to continue, their budgets)."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = {p: [enc(t) + [EOS] for t in turns] for p, turns in script.items()}
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def generate(self, prompt_ids, group_size, seed, temperature=None, max_new_tokens=None):
        n = len(prompt_ids)
        budgets = list(max_new_tokens) if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        self.calls.append(([list(p) for p in prompt_ids], budgets))
        comps, fins = [], []
        for p, budget in zip(prompt_ids, budgets):
            for _ in range(group_size):
                prompt = next(k for k in self.script if p[: len(enc(k))] == enc(k))
                turn = sum(1 for t in p[len(enc(prompt)) :] if t == EOS)  # model turns so far
                ids, done = cut_at_stop(self.script[prompt][turn][:budget], [EOS])
                comps.append(ids)
                fins.append(done)
        return Rollout([list(p) for p in prompt_ids], comps, None, fins)


def _runner(tmp_path, tools, factory=None, max_turns=3, max_new=48, limit=16, timeout=0.5):
    env_cfg = config.EnvConfig(
        max_turns=max_turns, max_tool_response_tokens=limit, tool_timeout_s=timeout
    )
    setup = contract.load(factory, tools, tmp_path)
    host = make_host(dict(setup.factories), list(setup.tools), timeout)
    fmt = TinyFormat(TOK, setup.first_params)

    def encode(ex, text=""):
        return enc(ex.prompt + text)

    return EpisodeRunner(setup, host, fmt, TOK, env_cfg, max_new, 512, encode), host


def _examples(*prompts):
    return [Example(prompt=p, answer="0") for p in prompts]


def test_results_become_masked_tokens_and_the_next_turn_continues_the_exact_sequence(tmp_path):
    runner, host = _runner(tmp_path, [calculator])
    try:
        script = {"35+8=": ["[calculator(35+8)]", "43"], "7*6=": ["42"]}
        backend = Scripted(script)
        roll = runner.run(backend, _examples("35+8=", "7*6="), [enc("35+8="), enc("7*6=")], 2, 5)
    finally:
        host.close()
    call, result, answer = enc("[calculator(35+8)]") + [EOS], enc(">43\n"), enc("43") + [EOS]
    assert roll.completion_ids[0] == call + result + answer
    assert roll.tool_masks[0] == [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert roll.completion_ids[2] == enc("42") + [EOS] and roll.tool_masks[2] == [1] * 3
    assert roll.finished == [True] * 4 and roll.row_prompt_ids is None  # no reset text
    # turn 2: only the two episodes that called, each continued from its whole token sequence,
    # with the budget it has left (the episode's, 48, less what it holds)
    (first, _), (second, budgets) = backend.calls
    assert first == [enc("35+8="), enc("7*6=")]
    assert second == [enc("35+8=") + call + result] * 2
    assert budgets == [48 - len(call) - len(result)] * 2
    eps = roll.episodes
    assert [e.turns for e in eps] == [2, 2, 1, 1] and [e.ended for e in eps] == ["answer"] * 4
    assert eps[0].final_text == "43" and eps[0].messages[1] == {
        "role": "tool",
        "name": "calculator",
        "content": "43",
    }
    m = episode_metrics(eps)
    assert m["env/tool_calls"] == 0.5 and m["env/turns"] == 1.5 and m["env/called_frac"] == 0.5
    assert [roll.loss_tokens(i) for i in range(4)] == [len(call) + len(answer)] * 2 + [3, 3]


TOOLS_MODULE = '''
import time

def slow(x: str) -> str:
    """Hangs.

    Args:
        x: anything
    """
    time.sleep(60)
    return x

def boom(x: str) -> str:
    """Raises.

    Args:
        x: anything
    """
    raise ValueError("no " + x)

def big(x: str) -> str:
    """A long result.

    Args:
        x: anything
    """
    return x * 500
'''


def test_hung_raising_oversized_malformed_and_unknown_calls_are_answered_not_fatal(tmp_path):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent(TOOLS_MODULE))
    names = ["my_tools:slow", "my_tools:boom", "my_tools:big", calculator]
    runner, host = _runner(tmp_path, names, max_turns=4, max_new=200, limit=8)
    turns = {
        "1+1=": ["[slow(a)]", "2"],
        "2+2=": ["[boom(b)]", "4"],
        "3+3=": ["[big(c)]", "6"],
        "4+4=": ["[calculator(4+]", "8"],  # malformed: not [name(arguments)]
        "5+5=": ["[nosuch(1)]", "[calculator(5+5)]", "10"],
    }
    prompts = list(turns)
    try:
        roll = runner.run(Scripted(turns), _examples(*prompts), [enc(p) for p in prompts], 1, 0)
    finally:
        host.close()
    eps = roll.episodes
    tool_text = [e.messages[1]["content"] for e in eps]
    assert "timed out" in json.loads(tool_text[0])["error"] and eps[0].tool_timeouts == 1
    assert json.loads(tool_text[1]) == {"error": "ValueError: no b"} and eps[1].tool_errors == 1
    assert tool_text[2] == "c" * 8 + CUT_MARKER and eps[2].tool_cut == 1  # 8 tokens: 8 chars
    assert "error" in json.loads(tool_text[3]) and eps[3].tool_unknown == 1
    assert "nosuch" in json.loads(tool_text[4])["error"] and eps[4].tool_unknown == 1
    assert eps[4].messages[3]["content"] == "10"  # the episode went on to a working call
    # every episode reached its answer: a bad call costs the model a turn, never the run
    assert [e.ended for e in eps] == ["answer"] * 5 and all(roll.finished)
    assert [e.final_text for e in eps] == ["2", "4", "6", "8", "10"]
    m = episode_metrics(eps)
    assert m["env/tool_timeouts"] == 0.2 and m["env/tool_errors"] == 0.2
    assert m["env/tool_unknown"] == 0.4 and m["env/tool_cut"] == 0.2


def test_a_result_that_leaves_no_room_to_answer_is_rolled_back(tmp_path):
    runner, host = _runner(tmp_path, [calculator], max_new=22)  # call 20 + result 5 > 22 - 1
    try:
        roll = runner.run(
            Scripted({"35+87=": ["[calculator(35+87)]", "122"]}),
            _examples("35+87="),
            [enc("35+87=")],
            1,
            0,
        )
    finally:
        host.close()
    assert roll.completion_ids[0] == enc("[calculator(35+87)]") + [EOS]  # no result appended
    assert roll.tool_masks[0] == [1] * 20 and roll.finished == [False]
    assert roll.episodes[0].ended == "budget"
    assert [m["role"] for m in roll.episodes[0].messages] == ["assistant"]  # rolled back whole


def test_max_turns_ends_an_episode_that_keeps_calling(tmp_path):
    runner, host = _runner(tmp_path, [calculator], max_turns=2)
    try:
        roll = runner.run(
            Scripted({"1+2=": ["[calculator(1+2)]", "[calculator(3)]", "3"]}),
            _examples("1+2="),
            [enc("1+2=")],
            1,
            0,
        )
    finally:
        host.close()
    e = roll.episodes[0]
    assert e.turns == 2 and e.tool_calls == 1 and e.ended == "max_turns"
    assert e.final_text == "[calculator(3)]"  # what the reward sees: no answer given


ENV_MODULE = '''
import random


class Counter:
    def reset(self, start: int = 0, **columns) -> str:
        self.n = start + random.randint(0, 9)
        return f"({self.n})"

    def add(self, k: int) -> str:
        """Add to the counter.

        Args:
            k: how much
        """
        self.n += k
        return str(self.n)
'''


def test_reset_text_is_appended_to_the_prompt_and_groups_reset_alike(tmp_path):
    (tmp_path / "my_env.py").write_text(ENV_MODULE)
    runner, host = _runner(tmp_path, [], factory="my_env:Counter")
    try:
        ex = [Example(prompt="c=", answer="0", meta={"start": 100})]
        roll = runner.run(Scripted({"c=": ['[add({"k": 5})]', "ok"]}), ex, [enc("c=")], 3, 7)
        again = runner.run(Scripted({"c=": ['[add({"k": 5})]', "ok"]}), ex, [enc("c=")], 3, 7)
    finally:
        host.close()
    texts = [TOK.decode(p) for p in roll.row_prompt_ids]
    assert len(set(texts)) == 1 and texts[0].startswith("c=(1")  # one seed per group
    start = int(texts[0][3:-1])
    assert [e.messages[1]["content"] for e in roll.episodes] == [str(start + 5)] * 3
    assert again.row_prompt_ids == roll.row_prompt_ids  # seeded: a resumed step draws the same


# ----------------------------------------------------------------------------- the loss


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    from ebpo_lite.engine.run import build_run

    out = tmp_path_factory.mktemp("tools") / "run"
    cfg = config.load(
        TOOLS_RECIPE,
        fast_overrides(out, **{"model.sft_warmup_steps": 60, "algo.kl_coef": 0.05}),
    )
    run = build_run(cfg, log=lambda _: None)
    yield run
    run.tools.close()


def _trajectory_rollout(run, n=4):
    """Real tool trajectories (the warm-up's: call, result, answer) as a multi-turn rollout."""
    from ebpo_lite.model.tiny_tools import tool_trajectory

    tok = run.policy.tokenizer
    exs = run.train_examples[:n]
    rows = [tool_trajectory(tok, ex) for ex in exs]
    return Rollout(
        [list(run.prompt_ids[i]) for i in range(n)],
        [ids for ids, _ in rows],
        None,
        [True] * n,
        tool_masks=[mask for _, mask in rows],
    )


def _loss_and_grads(run, roll, shift: float):
    """The policy loss of `roll` (KL and the entropy mask on) with every TOOL token's log-prob
    and entropy moved by `shift`; its value and the LoRA gradients."""
    from ebpo_lite.algo import loss
    from ebpo_lite.engine.run import _batch
    from ebpo_lite.model.policy import completion_logprobs

    policy = run.policy
    rows = list(range(len(roll.completion_ids)))
    b = _batch(policy, roll.row_prompts(), roll, rows)
    width = b.completion_mask.shape[1]
    tool = torch.zeros(len(rows), width)
    for j, m in enumerate(roll.tool_masks):
        tool[j, : len(m)] = 1 - torch.tensor(m, dtype=torch.float)
    policy.model.zero_grad(set_to_none=True)
    logp, entropy = completion_logprobs(policy.model, b, with_entropy=True)
    logp = logp + shift * tool
    entropy = entropy + 10 * shift * tool
    old = logp.detach() - 0.1
    value, _ = loss.policy_loss(
        logp, old, torch.linspace(-1, 1, len(rows)), b.completion_mask,
        entropy=entropy, top_entropy_quantile=0.5, ref_logp=logp.detach() + 0.2,
        kl_coef=0.05, sampler_logp=old + 0.05, is_correction="token", max_tokens=32,
    )  # fmt: skip
    value.backward()
    grads = [p.grad.clone() for p in policy.trainable_parameters() if p.grad is not None]
    return value.item(), grads


def test_tool_tokens_change_no_loss_and_no_gradient(tool_run):
    roll = _trajectory_rollout(tool_run)
    assert all(0 in m for m in roll.tool_masks)  # each has a tool result
    base, g0 = _loss_and_grads(tool_run, roll, 0.0)
    moved, g1 = _loss_and_grads(tool_run, roll, 3.0)
    assert moved == base
    assert len(g0) == len(g1) > 0
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    # and the counts that normalise the loss are the model's tokens only
    model_tokens = sum(sum(m) for m in roll.tool_masks)
    assert tool_run._loss_tokens(list(range(4)), roll) == model_tokens
    assert model_tokens < sum(len(c) for c in roll.completion_ids)


def test_without_the_mask_the_same_shift_does_change_the_loss(tool_run):
    """The test above can fail: scored as one-turn completions, tool tokens are in the loss."""
    roll = _trajectory_rollout(tool_run)
    plain = Rollout(roll.prompt_ids, roll.completion_ids, None, roll.finished)
    plain.tool_masks = [[1] * len(c) for c in roll.completion_ids]  # every token the model's
    shifted = Rollout(roll.prompt_ids, roll.completion_ids, None, roll.finished, roll.tool_masks)
    a, _ = _loss_and_grads(tool_run, shifted, 3.0)
    b, _ = _loss_and_grads(tool_run, plain, 3.0)
    assert a != b


def test_a_tool_free_episode_trains_exactly_as_a_single_turn_completion(tool_run):
    """Same tokens, all the model's: the multi-turn rollout's update equals the one-turn one."""
    run = tool_run
    tok = run.policy.tokenizer
    comps = [
        tok.encode(ex.answer, add_special_tokens=False) + [EOS] for ex in run.train_examples[:4]
    ]
    prompts = [list(run.prompt_ids[i]) for i in range(4)]
    single = Rollout(prompts, comps, None, [True] * 4)
    multi = Rollout(prompts, comps, None, [True] * 4, tool_masks=[[1] * len(c) for c in comps])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    valid = torch.ones(4, dtype=torch.bool)
    state = {k: v.clone() for k, v in run.policy.trainable_state().items()}
    opt = {k: v for k, v in run.optimizer.state_dict().items()}
    opt = json.loads(json.dumps({"param_groups": opt["param_groups"]}))  # lr etc.

    def once(roll):
        run.policy.load_trainable_state(state)
        run.optimizer.state.clear()
        stats = run.optimize(single.prompt_ids, roll, adv, valid)
        return stats, {k: v.clone() for k, v in run.policy.trainable_state().items()}

    s1, p1 = once(single)
    s2, p2 = once(multi)
    run.policy.load_trainable_state(state)
    assert s1["train/loss"] == pytest.approx(s2["train/loss"], abs=1e-6)
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(p1[k], state[k]) for k in p1)  # it did update


def test_encoder_appends_reset_text_to_a_tiny_prompt(tool_run):
    ex = tool_run.train_examples[0]
    assert tool_run.episodes.encode(ex, "") == tool_run.prompt_ids[0]
    assert tool_run.episodes.encode(ex, "!") == tool_run.prompt_ids[0] + enc("!")


def test_turn_seeds_are_pure_and_distinct():
    assert ep_mod.turn_seed(11, 0) == 11
    seeds = {ep_mod.turn_seed(11, t) for t in range(1, 6)} | {
        ep_mod.group_seed(11, g) for g in range(6)
    }
    assert len(seeds) == 11 and ep_mod.turn_seed(11, 3) == ep_mod.turn_seed(11, 3)


TWO_ENVS = '''
class Adder:
    def reset(self, **columns) -> None:
        self.seen = sorted(columns)

    def add(self, a: int, b: int) -> str:
        """Add.

        Args:
            a: one
            b: two
        """
        return str(a + b)


class Echo:
    def reset(self, **columns) -> str:
        return "!"

    def echo(self, text: str) -> str:
        """Echo.

        Args:
            text: what to say
        """
        return text
'''


def test_a_dict_of_environments_picks_each_examples_by_its_environment_column(tmp_path):
    from ebpo_lite.engine.labels import prior_keys

    (tmp_path / "two_envs.py").write_text(TWO_ENVS)
    factory = {"math": "two_envs:Adder", "talk": "two_envs:Echo"}
    runner, host = _runner(tmp_path, [], factory=factory)
    exs = [
        Example(prompt="a=", answer="3", meta={"environment": "math"}),
        Example(prompt="b=", answer="hi", meta={"environment": "talk"}),
    ]
    script = {"a=": ['[add({"a": 1, "b": 2})]', "3"], "b=": ["[echo(hi)]", "hi"]}
    try:
        roll = runner.run(Scripted(script), exs, [enc("a="), enc("b=")], 2, 1)
        copies = host.instances([0, 1])
    finally:
        host.close()
    assert [e.env for e in roll.episodes] == ["math", "math", "talk", "talk"]
    assert [e.messages[1]["content"] for e in roll.episodes] == ["3", "3", "hi", "hi"]
    assert copies[0].seen == ["answer", "prompt"]  # `environment` is not passed on (TRL's rule)
    assert TOK.decode(roll.row_prompt_ids[2]) == "b=!"  # Echo's reset text; Adder's is None
    m = episode_metrics(roll.episodes)
    assert m["env/math/tool_calls"] == 1.0 and m["env/talk/turns"] == 2.0
    assert prior_keys(exs, "environment") == ["math", "talk"]  # algo.prior_key=environment
    with pytest.raises(config.ConfigError, match="environment='sports'"):
        bad = [Example(prompt="a=", answer="3", meta={"environment": "sports"})]
        runner2, host2 = _runner(tmp_path, [], factory=factory)
        try:
            runner2.run(Scripted(script), bad, [enc("a=")], 1, 1)
        finally:
            host2.close()
