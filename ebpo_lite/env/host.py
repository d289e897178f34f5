"""Tools and environment instances run contained: a worker process, a time limit per call.

A tool is the user's code, so it may raise, hang, crash or return something odd; none of that
may end a run, and each failure becomes a message the model reads (TRL's `{"error": ...}`
shape). One host per run:

    host = make_host({None: "my_env:WordleEnv"}, ["my_tools:lookup"], timeout_s=5.0)
    host.describe()                    # {None: {"tools": [...], ...}, "__plain__": ["lookup"]}
    host.start([None] * 8, rows, seeds)  # one episode per row: an instance, random.seed, reset
    host.call([(0, "guess", {"word": "crane"}), (3, "lookup", {"q": "x"})])  # -> ToolOutcome
    host.rewards(range(8)); host.instances(range(8)); host.close()

`ToolHost` runs everything in one worker process (`_tool_worker.py`, started by path: the
standard library and the user's modules only, the trainer's sys.path, its own session). Per
request the host waits `timeout_s`; on a timeout (or when the worker dies) it kills the worker's
whole process group and starts a fresh one, and REBUILDS every live episode there by replaying
its reset and the calls that ran before (same seeds, same `random` states, the same order), so
the other episodes, and the one that hung up to before its hung call, keep their state. Replay
is why **environments should be deterministic given `random.seed`** (`reset(**columns)` and the
calls; not wall clocks, not the network): a replayed reset or call whose status now differs
from the first time's (an ok that fails, an error that passes) marks that episode lost, and its
later calls are answered with an error saying so. Plain tools are taken as stateless and are not
replayed. An episode whose reset raised or hung is lost too (the loop ends it).

`LocalToolHost`, the same interface in the trainer process, is for objects given through the
Python API that a fresh process cannot import (a class defined in a notebook's `__main__`):
each request runs in a daemon thread joined with `timeout_s`. A hung call cannot be killed
there: its thread is abandoned (it runs on, holding its instance) and its episode is lost.
Exceptions are contained as in the worker. The episodes' `random` states are the trainer's
global `random`, put back after each request (an abandoned thread may still touch it).

`make_host` picks: every factory and tool given as a target, or as an object importable as
`module:qualname` from a fresh process (`target_of`), gives a `ToolHost`; any other object
makes the whole host a `LocalToolHost`.

Statuses of a `ToolOutcome`: "ok", "error" (the tool raised, its worker crashed, or the episode
is lost), "timeout", "unknown" (no such tool, or arguments that do not bind to its signature).
`counts` (cumulative): calls, errors, timeouts, unknown (of the calls; a reset or get_reward
that raises or hangs counts in errors / timeouts too), restarts (workers replaced), lost
(episodes lost).
"""

from __future__ import annotations

import atexit
import copy
import importlib.util
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ebpo_lite.env import _tool_worker as runtime
from ebpo_lite.errors import UserError
from ebpo_lite.rewards.worker import Worker

STARTUP_TIMEOUT_S = 120.0  # the worker must import the user's modules (and probe) within this
_WORKER = Path(runtime.__file__)
_LIVE: weakref.WeakSet[ToolHost] = weakref.WeakSet()
PLAIN = "__plain__"  # describe()'s key for the plain tools


@dataclass
class ToolOutcome:
    text: str  # what the model sees: the result, or an {"error": ...} message
    status: str  # "ok" | "error" | "timeout" | "unknown"
    seconds: float


@dataclass
class _Episode:
    env: str | None
    columns: dict
    seed: int
    calls: list[tuple[str, dict, str]] = field(default_factory=list)  # (tool, kwargs, status)
    lost: str | None = None  # why its environment was lost


def target_of(obj: Any) -> str | None:
    """`module:qualname` when a fresh process can import `obj` by it (a string is taken as a
    target already), else None: a `__main__` or a local object, or a module with no spec."""
    if isinstance(obj, str):
        return obj
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or module == "__main__" or "<locals>" in qual:
        return None
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    found: Any = sys.modules.get(module)
    for part in qual.split("."):
        found = getattr(found, part, None)
    return f"{module}:{qual}" if found is obj else None


def make_host(factories: dict[str | None, Any], tools: Iterable[Any], timeout_s: float) -> ToolHost:
    """A `ToolHost` when every factory / tool is a target or an importable object, else a
    `LocalToolHost` for all of them (module docstring). A factory of None or "" is tools only."""
    tools = list(tools)
    objects = [f for f in factories.values() if f] + tools
    if all(target_of(o) is not None for o in objects):
        targets = {k: (target_of(v) if v else "") for k, v in factories.items()}
        return ToolHost(targets, [target_of(t) for t in tools], timeout_s)  # type: ignore[misc]
    return LocalToolHost(factories, tools, timeout_s)


class ToolHost:
    """Tools and environments in a worker process (module docstring). Thread-safe (requests
    are serialised)."""

    def __init__(
        self,
        factories: dict[str | None, str],
        tools: list[str],
        timeout_s: float,
        sys_path: list[str] | None = None,
    ) -> None:
        self.factories = {k: (v or "") for k, v in factories.items()}
        self.tools = list(tools)
        self.timeout_s = float(timeout_s)
        self.sys_path = list(sys.path if sys_path is None else sys_path)
        self.counts = {
            "calls": 0,
            "errors": 0,
            "timeouts": 0,
            "unknown": 0,
            "restarts": 0,
            "lost": 0,
        }
        self._episodes: list[_Episode] = []
        self._description: dict | None = None
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._worker = Worker(_WORKER)
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.factories!r}, {self.tools!r})"

    # ------------------------------------------------------------------ the interface
    def describe(self) -> dict[Any, Any]:
        """Per environment name {"tools": [method names], "has_reward", "reset_ok" (reset has
        no required parameters), "reset_required": [its required parameters: the columns it
        needs]}, and PLAIN: [plain tool names]. Raises UserError for a target that does not
        load, a factory that fails with no arguments, a class without `reset`."""
        with self._lock:
            self._ensure()
            return copy.deepcopy(self._description)  # type: ignore[return-value]

    def start(
        self, envs: list[str | None], columns: list[dict], seeds: list[int]
    ) -> list[ToolOutcome]:
        """Episodes 0..n-1 (the previous set is dropped): an instance of each one's environment,
        `random.seed(seed)`, `reset(**columns)` (only the columns reset names, unless it takes
        **kwargs); the text is what reset returned ("" for None)."""
        for env in envs:
            if env is not None and env not in self.factories:
                raise KeyError(f"no environment named {env!r} (known: {list(self.factories)})")
        with self._lock:
            self._ensure()
            self._episodes = []
            if self._run(("drop",))[0] != "ok":
                self._stop(kill=True)  # a fresh worker starts with the first reset
            out = []
            for i, (env, cols, seed) in enumerate(zip(envs, columns, seeds)):
                ep = _Episode(env, dict(cols), int(seed))
                self._episodes.append(ep)
                t0 = time.monotonic()
                status, payload = self._run(("reset", i, env, ep.columns, ep.seed))
                seconds = time.monotonic() - t0  # the reset's own time, not the recovery's
                text = payload or ""
                if status != "ok":
                    status, text = self._failed(i, status, text, "its reset")
                out.append(ToolOutcome(text, status, seconds))
            return out

    def call(self, calls: Iterable[tuple[int, str, dict]]) -> list[ToolOutcome]:
        """Run the calls (episode, tool name, kwargs) in order; see the module docstring."""
        out = []
        with self._lock:
            for i, name, kwargs in calls:
                ep = self._episodes[i]
                self.counts["calls"] += 1
                t0 = time.monotonic()
                if ep.lost is not None:
                    self.counts["errors"] += 1
                    text = runtime.error_text(f"this episode's environment was lost ({ep.lost})")
                    out.append(ToolOutcome(text, "error", 0.0))
                    continue
                status, payload = self._run(("call", i, name, kwargs))
                seconds = time.monotonic() - t0
                text, is_method = payload if isinstance(payload, tuple) else (payload or "", False)
                if status in ("ok", "error") and is_method:
                    ep.calls.append((name, dict(kwargs), status))
                if status == "unknown":
                    self.counts["unknown"] += 1
                elif status == "error":
                    self.counts["errors"] += 1
                elif status != "ok":
                    status, text = self._failed(i, status, text, f"its call of {name!r}")
                out.append(ToolOutcome(text, status, seconds))
        return out

    def rewards(self, episodes: Iterable[int]) -> list[float | None]:
        """get_reward() of each episode's instance; None where there is none, the episode is
        lost, or it raised / hung (counted in errors / timeouts)."""
        out: list[float | None] = []
        with self._lock:
            for i in episodes:
                status, value = self._ask(i, "reward", "get_reward")
                out.append(value if status == "ok" else None)
        return out

    def instances(self, episodes: Iterable[int]) -> list[object | None]:
        """Pickled copies of the episodes' instances (for reward functions that take
        `environments`); None where there is none or it does not pickle (warned once)."""
        out: list[object | None] = []
        with self._lock:
            for i in episodes:
                status, payload = self._ask(i, "instance", "pickling its instance")
                value = None
                if status == "ok" and payload is not None:
                    try:
                        value = pickle.loads(payload)
                    except Exception as e:
                        status, payload = "error", f"its pickled instance does not load ({e!r})"
                if status != "ok":
                    self._warn_once(
                        "instance",
                        f"ebpo_lite: an environment instance cannot be copied for the reward "
                        f"functions ({payload}); they get None for it (warned once)",
                    )
                out.append(value)
        return out

    def close(self) -> None:
        """Stop the worker (a later request starts a fresh one, without the episodes)."""
        with self._lock:
            self._worker.close()
            self._episodes = []

    # ------------------------------------------------------------------ failures
    def _ask(self, i: int, op: str, what: str) -> tuple[str, Any]:
        """A reward / instance request for episode i, its failures counted and recovered."""
        if self._episodes[i].lost is not None:
            return "ok", None
        status, payload = self._run((op, i))
        if status == "error":
            self.counts["errors"] += 1
        elif status not in ("ok", "unknown"):
            status, payload = self._failed(i, status, "", what)
        return status, payload

    def _failed(self, i: int, status: str, text: str, what: str) -> tuple[str, str]:
        """The outcome of a request of episode i that did not succeed (status error, timeout or
        crash), after the recovery it needs; counts it."""
        ep = self._episodes[i]
        if status == "error":
            self.counts["errors"] += 1
            if what == "its reset":
                self._lose(ep, "its reset raised")
            return status, text
        if status == "timeout":
            self.counts["timeouts"] += 1
            text = runtime.error_text(f"timed out after {self.timeout_s:g}s")
        else:
            self.counts["errors"] += 1
            status, text = "error", runtime.error_text(f"the tool's process died ({text})")
        if what == "its reset":
            self._lose(ep, f"its reset {'timed out' if status == 'timeout' else 'crashed'}")
        self._recover(i)
        return status, text

    def _lose(self, ep: _Episode, why: str) -> None:
        if ep.lost is None:
            ep.lost = why
            self.counts["lost"] += 1

    def _recover(self, i: int) -> None:
        """After the worker died: a fresh one, every live episode rebuilt by replay."""
        self.counts["restarts"] += 1
        while True:
            self._stop(kill=True)
            died = False
            for j, ep in enumerate(self._episodes):
                if ep.lost is None:
                    problem, died = self._replay(j, ep)
                    if problem:
                        self._lose(ep, f"replaying it in a fresh worker: {problem}")
                    if died:
                        break
            if not died:
                return
            self.counts["restarts"] += 1

    def _replay(self, j: int, ep: _Episode) -> tuple[str | None, bool]:
        """(what went differently, whether the worker died) replaying episode j."""
        status, _ = self._run(("reset", j, ep.env, ep.columns, ep.seed))
        if status != "ok":
            return f"its reset ended with {status}", status in ("timeout", "crash")
        for name, kwargs, was in ep.calls:
            status, _ = self._run(("call", j, name, kwargs))
            if status != was:
                return f"its call of {name!r} ended with {status}, not {was}", status in (
                    "timeout",
                    "crash",
                )
        return None, False

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the worker
    def _run(self, request: tuple) -> tuple[str, Any]:
        """(status, payload) of one request; status "timeout" or "crash" (payload: what
        happened) when the worker is gone, killed."""
        self._ensure()
        w = self._worker
        try:
            w.requests.send(request)
        except OSError:
            return self._crashed()
        except Exception as e:  # the arguments do not pickle
            msg = runtime.error_text(f"its arguments cannot be sent to the tool process: {e!r}")
            return "error", (msg, False) if request[0] == "call" else msg
        if not w.replies.poll(self.timeout_s):
            w.stop(kill=True)
            return "timeout", None
        try:
            return w.replies.recv()
        except (EOFError, OSError):
            return self._crashed()
        except Exception as e:  # the reply does not unpickle here
            msg = runtime.error_text(f"its result cannot be read back: {e!r}")
            return "error", (msg, False) if request[0] == "call" else msg

    def _crashed(self) -> tuple[str, str]:
        code = self._worker.exit_status()
        self._worker.stop(kill=True)
        return "crash", f"exit status {code}"

    def _ensure(self) -> None:
        if not self._worker.running():
            self._start()

    def _start(self) -> None:
        hello = {
            "sys_path": self.sys_path,
            "factories": self.factories,
            "tools": self.tools,
            "probe": self._description is None,
        }
        reply = self._worker.start(hello, STARTUP_TIMEOUT_S, failed="start_error")
        if reply[0] != "ready":
            self._worker.stop(kill=True)
            why = str(reply[1])  # the worker's one line, or why it never answered
            raise UserError(
                f"the tool process did not start: {why}" if reply[0] == "start_error" else why
            )
        if self._description is None:
            self._description = reply[1]

    def _stop(self, kill: bool) -> None:
        self._worker.stop(kill)


class LocalToolHost(ToolHost):
    """`ToolHost`'s interface in the trainer process, for objects a fresh process cannot import
    (module docstring: a hung call is abandoned, not killed, and its episode lost). `factories`
    values and `tools` may be objects or targets."""

    def __init__(
        self, factories: dict[str | None, Any], tools: list[Any], timeout_s: float
    ) -> None:
        super().__init__(
            {k: _label(v) for k, v in factories.items()}, [_label(t) for t in tools], timeout_s
        )
        try:
            loaded = {
                k: (_label(v), _resolve(v, "environment") if v else None)
                for k, v in factories.items()
            }
            self._runtime = runtime.Runtime(
                loaded, [(_label(t), _resolve(t, "tool")) for t in tools]
            )
        except runtime.LoadError as e:
            raise UserError(str(e)) from None

    def _ensure(self) -> None:
        if self._description is None:
            try:
                self._description = self._runtime.describe()
            except runtime.LoadError as e:
                raise UserError(str(e)) from None

    def _run(self, request: tuple) -> tuple[str, Any]:
        box: list[tuple[str, Any]] = []

        def work() -> None:
            try:
                box.append(getattr(self._runtime, request[0])(*request[1:]))
            except BaseException as e:
                box.append(("error", runtime.error_text(f"the tool host failed: {e!r}")))

        thread = threading.Thread(target=work, name="ebpo-lite-tool", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive() or not box:
            return "timeout", None
        return box[0]

    def _recover(self, i: int) -> None:
        """A hung request cannot be killed here: its episode is lost, the others go on."""
        ep = self._episodes[i]
        self._lose(ep, "a call of it hung and was abandoned (a local host cannot kill it)")
        self._runtime.episodes.pop(i, None)

    def close(self) -> None:
        with self._lock:
            self._runtime.drop()
            self._episodes = []


def _label(obj: Any) -> str:
    if not obj:
        return ""
    if isinstance(obj, str):
        return obj
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def _resolve(obj: Any, what: str) -> Any:
    return runtime.load(obj, what) if isinstance(obj, str) else obj


def close_all() -> None:
    """Stop every host's worker (the trainer does at the end of a run; atexit too)."""
    for host in list(_LIVE):
        host.close()


atexit.register(close_all)
