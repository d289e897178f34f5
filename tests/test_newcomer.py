"""Issue 32, part 4: what told a newcomer something false. Here: a hub model id without a network.

A mistyped (or uncached) hub id with no hub to ask took a minute of transformers' download retries
and left an empty run folder behind; `checks.hub_model` now asks the hub once, within
`checks.HUB_TIMEOUT_S`, before the folder is made. The hub cannot be reached from this machine:
its answers come from a local HTTP server that sends the status and `X-Error-Code` headers the
hub sends, which huggingface_hub's `hf_raise_for_status` turns into its typed errors
(huggingface_hub 2.4, utils/_http.py). `--gpu` names (part 4's plan item) are in test_plan.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ebpo_lite.engine import checks
from ebpo_lite.errors import ConfigError
from tests.conftest import REPO
from tests.test_mistakes import set_hub_endpoint, unreachable_hub

R = "recipes/tiny_cpu.yaml"


def _offline(mp: pytest.MonkeyPatch) -> None:
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("no_network", ["HF_HUB_OFFLINE=1", "HF_ENDPOINT unreachable"])
def test_a_hub_id_without_network_is_one_line_in_seconds_and_no_run_folder(
    no_network, tmp_path, monkeypatch, capsys
):
    """The whole `train` up to its refusal, in-process (torch already imported: what is timed is
    the run's own work; before the hub check the unreachable case took 63 s here)."""
    from ebpo_lite.train import main

    monkeypatch.chdir(REPO)
    _offline(monkeypatch) if no_network.startswith("HF_HUB") else unreachable_hub(
        tmp_path, monkeypatch
    )
    out = tmp_path / "run"
    t0 = time.perf_counter()
    rc = main([R, "model.name=Qwen/Qwen3-06B", f"output_dir={out}"])
    seconds = time.perf_counter() - t0
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: model.name: Qwen/Qwen3-06B "), err
    assert seconds < 10, seconds
    assert not out.exists()


@pytest.mark.slow  # two fresh processes: torch and transformers import for 10-15 s each here
def test_the_real_process_exits_2_with_one_line_and_writes_nothing(tmp_path):
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    for extra in ({"HF_ENDPOINT": "http://127.0.0.1:9"}, {"HF_HUB_OFFLINE": "1"}):
        out = tmp_path / "run"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "ebpo_lite", "train", R, "model.name=Qwen/Qwen3-06B",
             f"output_dir={out}"],
            cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: model.name: Qwen/Qwen3-06B is not in the local")
        assert not out.exists() and seconds < 45, seconds  # was 63 s of retries, then a folder


class _Hub(BaseHTTPRequestHandler):
    """Answers HEAD /OWNER/NAME/resolve/main/config.json as the hub does, by OWNER."""

    ANSWERS = {
        "missing": (404, "RepoNotFound"),
        "gated": (403, "GatedRepo"),
        "nocfg": (404, "EntryNotFound"),
        "busy": (503, None),
        "there": (200, None),
    }

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        status, code = self.ANSWERS[self.path.strip("/").split("/")[0]]
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("ETag", '"abc"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def local_hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    set_hub_endpoint(monkeypatch, url)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # checks.hub_offline reads both
        monkeypatch.delenv(flag, raising=False)
    yield url
    server.shutdown()


@pytest.mark.parametrize(
    "owner,says",
    [
        ("missing", "missing/model: no such model on the hub (http://127.0.0.1:"),
        ("gated", "gated/model is gated on the hub"),
        ("nocfg", "nocfg/model has no config.json on the hub"),
    ],
)
def test_what_the_hub_answers_is_one_line_naming_model_name(owner, says, local_hub):
    with pytest.raises(ConfigError, match="^model.name: ") as e:
        checks.model_name(f"{owner}/model")
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("owner", ["there", "busy"])
def test_a_model_the_hub_has_or_a_hub_hiccup_passes(owner, local_hub):
    checks.model_name(f"{owner}/model")  # 5xx: the download's own retries deal with it


def test_a_hub_that_never_answers_is_refused_within_the_timeout(monkeypatch):
    with socket.socket() as server:  # accepts the connection, never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        set_hub_endpoint(monkeypatch, f"http://127.0.0.1:{server.getsockname()[1]}")
        t0 = time.perf_counter()
        with pytest.raises(ConfigError, match="cannot be reached"):
            checks.hub_model("nobody/model", timeout=0.5)
    assert time.perf_counter() - t0 < 2


def test_a_cached_model_is_not_asked_about(monkeypatch, tmp_path):
    """In the local cache: no question to the hub (an unreachable one included)."""
    unreachable_hub(tmp_path, monkeypatch)
    snap = tmp_path / "hub" / "models--owner--cached" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    refs = tmp_path / "hub" / "models--owner--cached" / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    checks.model_name("owner/cached")
    with pytest.raises(ConfigError, match="cannot be reached"):
        checks.model_name("owner/uncached")


def test_a_local_folder_that_does_not_exist_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=f"^model.name: {tmp_path}/nope: no such folder"):
        checks.model_name(str(tmp_path / "nope"))


# ----------------------------------------------------------------------------- columns a reward reads

REWARDS = """
def by_level(completions, level, **columns):
    return [float(x) for x in level]

def by_source(completions, source, **columns):
    return [0.0] * len(completions)

def with_default(completions, source=None, **columns):
    return [0.0] * len(completions)
"""


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user's reward module (TRL's signature: named columns, **columns for the rest) and a
    jsonl whose rows carry a `level` column."""
    (tmp_path / "newcomer_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "newcomer_rewards", raising=False)
    rows = [f'{{"problem": "{i}+1?", "answer": "{i + 1}", "level": {i % 3 + 1}}}' for i in range(4)]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    from ebpo_lite import config
    from ebpo_lite.data import mathdata

    cfg = config.load(REPO / R, [f"data.path={tmp_path / 'd.jsonl'}"])
    return mathdata.load_examples(cfg.data)


def test_a_reward_reading_a_column_the_data_has_is_accepted(user_rewards):
    """TRL passes a dataset's columns by name: `def score(completions, level, **kw)` is a valid
    reward (it was refused at load as 'cannot be called as fn(completions, **columns)')."""
    from ebpo_lite import rewards

    fn = rewards.get_reward_fn("newcomer_rewards:by_level")
    rewards.check_columns([("by_level", fn)], user_rewards, "the training data")
    kept = rewards.get_reward_fn("newcomer_rewards:with_default")  # a default: not required
    rewards.check_columns([("with_default", kept)], user_rewards, "the training data")
    columns = rewards.reward_columns(user_rewards)
    assert fn(completions=["x"] * 4, timeout_s=10.0, **columns) == [1.0, 2.0, 3.0, 1.0]
    rewards.close_contained()


def test_a_reward_reading_a_column_the_data_lacks_is_one_line_naming_it(user_rewards):
    from ebpo_lite import rewards

    fn = rewards.get_reward_fn("newcomer_rewards:by_source")
    with pytest.raises(ConfigError) as e:
        rewards.check_columns(
            [("newcomer_rewards:by_source", fn)], user_rewards, "the training data"
        )
    line = str(e.value)
    assert line.startswith("reward.functions: newcomer_rewards:by_source reads 'source', which ")
    assert "(its columns: answer, level, prompts;" in line and "\n" not in line
    rewards.check_columns([("by_source", fn)], [], "the held-out data")  # nothing held out
    rewards.close_contained()
