"""Tools and environments run contained (ebpo_lite/env/host.py), in real worker processes.

A stateful environment keeps its state per episode; a tool that raises, hangs or kills its
process becomes an {"error": ...} message and the run goes on; after a hang or a crash the fresh
worker rebuilds every live episode by replay (the hung one up to before its hung call); unknown
tools and bad arguments are "unknown"; get_reward, copies of the instances, the plain tools, the
one-line errors for targets that do not load, and the in-process LocalToolHost.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

import pytest

from ebpo_lite.env.host import PLAIN, LocalToolHost, ToolHost, make_host, target_of
from ebpo_lite.errors import UserError

MOD = "ebpo_test_user_envs"
USER_MODULE = """
import os
import random
import threading
import time


class Counter:
    def __init__(self):
        self.n = 0

    def reset(self, start=0, **columns):
        self.n = int(start)
        return f"start {self.n}"

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def draw(self) -> float:
        return random.random()

    def boom(self):
        raise ValueError("bad luck")

    def hang(self):
        time.sleep(60)

    def crash(self):
        os._exit(3)

    def get_reward(self):
        if self.n < 0:
            raise RuntimeError("negative")
        return self.n * 0.5


class Locked(Counter):
    def reset(self, **columns):
        self.lock = threading.Lock()  # does not pickle


class NoReset:
    def add(self, k: int) -> int:
        return k


class Broken:
    def __init__(self):
        raise RuntimeError("needs a config file")

    def reset(self):
        pass


class Once:
    # not deterministic across processes: its second touch of the same flag file raises

    def reset(self, flag):
        self.flag = flag

    def touch(self) -> str:
        if os.path.exists(self.flag):
            raise RuntimeError("touched twice")
        open(self.flag, "w").close()
        return "touched"

    def hang(self):
        time.sleep(60)


def shout(text: str) -> str:
    return text.upper()


def loaded() -> str:
    import sys

    return ",".join(m for m in ("torch", "ebpo_lite", "numpy") if m in sys.modules) or "-"
"""


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """The user module in a tmp dir on sys.path (the worker gets the trainer's sys.path)."""
    d = tmp_path_factory.mktemp("user_envs")
    (d / f"{MOD}.py").write_text(USER_MODULE)
    sys.path.insert(0, str(d))
    yield importlib.import_module(MOD)
    sys.path.remove(str(d))
    sys.modules.pop(MOD, None)


@pytest.fixture
def host(envs):
    h = ToolHost({None: f"{MOD}:Counter", "bare": ""}, [f"{MOD}:shout"], timeout_s=0.5)
    yield h
    h.close()


def _texts(outcomes):
    return [o.text for o in outcomes]


def _error(outcome) -> str:
    return json.loads(outcome.text)["error"]


def test_describe_names_tools_reward_and_plain_tools(host):
    d = host.describe()
    assert d[None]["tools"] == ["add", "boom", "crash", "draw", "hang"]  # no reset / get_reward
    assert d[None]["has_reward"] is True and d[None]["reset_ok"] is True
    assert d["bare"] == {"tools": [], "has_reward": False, "reset_ok": True, "reset_required": []}
    assert d[PLAIN] == ["shout"]


def test_worker_imports_neither_torch_nor_ebpo_lite(envs):
    host = ToolHost({}, [f"{MOD}:loaded"], timeout_s=5.0)
    try:
        host.start([None], [{}], [0])
        assert "torch" in sys.modules and "ebpo_lite" in sys.modules  # here, not there
        assert _texts(host.call([(0, "loaded", {})])) == ["-"]
    finally:
        host.close()


def test_state_kept_across_calls_and_episodes_independent(host):
    started = host.start([None, None], [{"start": 1}, {"start": 10}], [0, 1])
    assert _texts(started) == ["start 1", "start 10"]
    out = host.call([(0, "add", {"k": 2}), (1, "add", {"k": 5}), (0, "add", {"k": 3})])
    assert _texts(out) == ["3", "15", "6"] and {o.status for o in out} == {"ok"}
    again = host.start([None], [{}], [0])  # a new set: state starts over
    assert _texts(again) == ["start 0"] and _texts(host.call([(0, "add", {"k": 1})])) == ["1"]


def test_hang_times_out_and_replay_rebuilds_every_episode(host, envs):
    host.start([None, None], [{"start": 1}, {"start": 10}], [0, 1])
    host.call([(0, "add", {"k": 2}), (1, "add", {"k": 5}), (1, "draw", {})])
    old_pid = host._worker.proc.pid
    t0 = time.monotonic()
    (hung,) = host.call([(0, "hang", {})])
    took = time.monotonic() - t0
    assert hung.status == "timeout" and _error(hung) == "timed out after 0.5s"
    assert 0.5 <= took < 5.0, took  # not the 60 s sleep
    with pytest.raises(ProcessLookupError):  # the hung worker was killed (and reaped)
        os.kill(old_pid, 0)
    assert host.counts["timeouts"] == 1 and host.counts["restarts"] == 1
    after = host.call([(0, "add", {"k": 1}), (1, "add", {"k": 1}), (1, "draw", {})])
    assert _texts(after)[:2] == ["4", "16"]  # both episodes' state, the hung one's before the hang
    # the replayed episode draws what it would have drawn without the hang
    plain = ToolHost({None: f"{MOD}:Counter"}, [], timeout_s=5.0)
    try:
        plain.start([None, None], [{}, {}], [0, 1])
        draws = plain.call([(1, "draw", {}), (1, "draw", {})])
    finally:
        plain.close()
    assert after[2].text == draws[1].text


def test_replay_that_goes_differently_loses_that_episode_only(envs, tmp_path):
    host = ToolHost({"once": f"{MOD}:Once"}, [], timeout_s=0.5)
    try:
        assert host.describe()["once"]["reset_required"] == ["flag"]
        assert host.describe()["once"]["reset_ok"] is False
        flags = [{"flag": str(tmp_path / "a"), "other": 1}, {"flag": str(tmp_path / "b")}]
        host.start(["once", "once"], flags, [0, 0])  # reset gets only the columns it names
        assert _texts(host.call([(0, "touch", {}), (1, "touch", {})])) == ["touched"] * 2
        os.remove(tmp_path / "b")  # episode 1 replays as it ran; episode 0 does not
        (hung,) = host.call([(1, "hang", {})])
        assert hung.status == "timeout"
        lost, survived = host.call([(0, "touch", {}), (1, "touch", {})])
        assert lost.status == "error" and "lost" in _error(lost) and "touch" in _error(lost)
        assert survived.status == "error" and "touched twice" in _error(survived)  # its state
        assert host.counts["lost"] == 1
    finally:
        host.close()


def test_crash_is_an_error_and_the_other_episode_survives(host):
    host.start([None, None], [{"start": 1}, {"start": 10}], [0, 1])
    host.call([(1, "add", {"k": 5})])
    (crashed,) = host.call([(0, "crash", {})])
    assert crashed.status == "error" and "died" in _error(crashed)
    assert host.counts["restarts"] == 1
    assert _texts(host.call([(1, "add", {"k": 1}), (0, "add", {"k": 1})])) == ["16", "2"]


def test_raising_tool_is_an_error_message_and_the_episode_goes_on(host):
    host.start([None], [{"start": 3}], [0])
    (boom,) = host.call([(0, "boom", {})])
    assert boom.status == "error" and json.loads(boom.text) == {"error": "ValueError: bad luck"}
    assert _texts(host.call([(0, "add", {"k": 1})])) == ["4"]
    assert host.counts["errors"] == 1 and host.counts["restarts"] == 0


def test_unknown_tool_and_bad_arguments(host):
    host.start([None], [{}], [0])
    unknown, extra, missing = host.call(
        [(0, "nope", {}), (0, "add", {"k": 1, "kk": 1}), (0, "add", {})]
    )
    assert [o.status for o in (unknown, extra, missing)] == ["unknown"] * 3
    assert "'nope'" in _error(unknown) and "add, boom" in _error(unknown)
    assert "shout" in _error(unknown)
    assert "'add'" in _error(extra) and "kk" in _error(extra)
    assert "missing" in _error(missing)
    assert host.counts["unknown"] == 3
    assert _texts(host.call([(0, "add", {"k": 2})])) == ["2"]  # nothing ran


def test_plain_tool_in_every_episode(host):
    host.start(["bare", None], [{}, {}], [0, 0])
    out = host.call(
        [(0, "shout", {"text": "hi"}), (1, "shout", {"text": "yo"}), (0, "add", {"k": 1})]
    )
    assert _texts(out)[:2] == ["HI", "YO"]
    assert out[2].status == "unknown"  # the bare episode has no environment methods


def test_reset_that_raises_loses_the_episode(host):
    out = host.start([None, None], [{"start": "x"}, {"start": 2}], [0, 0])
    assert out[0].status == "error" and "ValueError" in _error(out[0])
    lost, fine = host.call([(0, "add", {"k": 1}), (1, "add", {"k": 1})])
    assert lost.status == "error" and "lost" in _error(lost)
    assert fine.text == "3" and host.counts["lost"] == 1


def test_rewards(host):
    host.start([None, "bare", None], [{"start": 4}, {}, {"start": 1}], [0, 0, 0])
    host.call([(2, "add", {"k": -3})])  # n = -2: its get_reward raises
    assert host.rewards([0, 1, 2]) == [2.0, None, None]
    assert host.counts["errors"] == 1


def test_instances_are_copies_with_state(host, envs, capfd):
    host.start([None, "bare"], [{"start": 7}, {}], [0, 0])
    copy, bare = host.instances([0, 1])
    assert isinstance(copy, envs.Counter) and copy.n == 7 and bare is None
    copy.add(100)  # a copy: the episode's own instance is untouched
    assert _texts(host.call([(0, "add", {"k": 1})])) == ["8"]
    locked = ToolHost({None: f"{MOD}:Locked"}, [], timeout_s=5.0)
    try:
        locked.start([None, None], [{}, {}], [0, 0])
        assert locked.instances([0, 1]) == [None, None]
    finally:
        locked.close()
    assert capfd.readouterr().err.count("cannot be copied") == 1  # warned once


@pytest.mark.parametrize(
    "factories, tools, words",
    [
        ({None: f"{MOD}:NoReset"}, [], [f"{MOD}:NoReset", "no reset"]),
        ({None: f"{MOD}:Broken"}, [], [f"{MOD}:Broken", "needs a config file"]),
        ({None: "no_such_module_xyz:Env"}, [], ["no_such_module_xyz"]),
        ({None: f"{MOD}:Missing"}, [], [f"{MOD}:Missing", "has no"]),
        ({}, [f"{MOD}:nope"], [f"tool '{MOD}:nope'"]),
    ],
)
def test_targets_that_do_not_load_are_one_line_user_errors(envs, factories, tools, words):
    host = ToolHost(factories, tools, timeout_s=5.0)
    with pytest.raises(UserError) as e:
        host.describe()
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    host.close()


def test_make_host_and_target_of(envs):
    assert target_of(envs.Counter) == f"{MOD}:Counter" and target_of(envs.shout) == f"{MOD}:shout"

    class Local:
        def reset(self):
            return "local"

    assert target_of(Local) is None
    contained = make_host({None: envs.Counter}, [envs.shout], 1.0)
    local = make_host({None: Local}, [envs.shout], 1.0)
    try:
        assert type(contained) is ToolHost and contained.factories == {None: f"{MOD}:Counter"}
        assert type(local) is LocalToolHost
        assert _texts(local.start([None], [{}], [0])) == ["local"]
    finally:
        contained.close()
        local.close()


def test_local_host_contains_raise_and_hang(envs):
    host = LocalToolHost({None: envs.Counter}, [envs.shout], timeout_s=0.5)
    assert host.describe()[PLAIN] == ["shout"]
    host.start([None, None], [{"start": 1}, {"start": 10}], [0, 1])
    host.call([(0, "add", {"k": 2}), (1, "add", {"k": 5})])
    (boom,) = host.call([(0, "boom", {})])
    assert boom.status == "error" and _error(boom) == "ValueError: bad luck"
    t0 = time.monotonic()
    (hung,) = host.call([(1, "hang", {})])
    assert hung.status == "timeout" and time.monotonic() - t0 < 3.0
    ok, lost, bad = host.call([(0, "add", {"k": 1}), (1, "add", {"k": 1}), (0, "x", {})])
    assert ok.text == "4" and lost.status == "error" and "abandoned" in _error(lost)
    assert bad.status == "unknown"
    assert host.rewards([0, 1]) == [2.0, None]
    assert host.counts["timeouts"] == 1 and host.counts["lost"] == 1
