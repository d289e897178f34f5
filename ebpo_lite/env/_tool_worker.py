"""Tool and environment worker: run as a script, one per run (`host.py`); also the in-process
runtime of `LocalToolHost`.

Started as `python _tool_worker.py` (by path: it imports only the standard library and the
user's modules, never ebpo_lite or torch, and never re-imports the trainer's `__main__`). It runs
in its own session, so the trainer can kill it together with anything a tool started, and it
gets SIGKILL when the trainer dies (PR_SET_PDEATHSIG).

Protocol: pickled messages with `multiprocessing.connection` framing, requests on stdin, replies
on stdout (the real fds 0 and 1 are moved aside first: a tool's prints go to stderr).
- first request {"sys_path", "factories": {name: "module:Class" or ""}, "tools": ["module:fn"],
  "probe": bool}: the worker takes the trainer's sys.path, loads every target (and with `probe`
  builds one instance of each environment to describe it), then replies ("ready", description)
  or ("load_error", one line naming the target) and exits;
- then each request is (operation, *arguments), an operation being a `Runtime` method (`drop`,
  `reset`, `call`, `reward`, `instance`); the reply is its (status, payload). One request at a
  time: the host times each one, and kills the worker when one takes too long.
- EOF on the request pipe ends the worker.

`random`: each episode has its own state of the global `random` generator, seeded with its seed
before its instance is built and `reset` runs, and put back around each of its calls. So what an
episode draws does not depend on how the episodes' calls interleave, and replaying an episode in
a fresh worker (after a timeout) draws the same numbers again.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pickle
import random
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

RESERVED = ("reset", "get_reward")  # an environment's methods that are not tools


class LoadError(Exception):
    """A target that does not load or an environment that cannot be used; one line naming it."""


def error_text(message: str) -> str:
    """TRL's shape for a failed tool call, as the model sees it."""
    return json.dumps({"error": message})


def load(target: str, what: str) -> Any:
    """The object `module:qualname` names; `what` ("environment", "tool") starts the error."""
    module_name, sep, qual = target.partition(":")
    if not sep or not module_name or not qual:
        raise LoadError(f"{what} {target!r}: expected 'module:name'")
    try:
        obj = importlib.import_module(module_name)
    except BaseException as e:  # a missing module, or one that fails while importing
        if not isinstance(e, ModuleNotFoundError):
            traceback.print_exc()
        raise LoadError(f"{what} {target!r}: cannot import {module_name!r} ({_brief(e)})") from e
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LoadError(f"{what} {target!r}: {module_name!r} has no {qual!r}") from None
    if not callable(obj):
        raise LoadError(f"{what} {target!r}: {qual!r} is not callable")
    return obj


def _brief(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def public_methods(cls: type) -> list[str]:
    """The tools an environment class offers: its public methods but `reset` and `get_reward`."""
    return [
        n
        for n in dir(cls)
        if not n.startswith("_") and n not in RESERVED and callable(getattr(cls, n, None))
    ]


def reset_arguments(reset: Callable, columns: dict) -> dict:
    """The columns `reset` gets: all of them when it takes **kwargs, else the ones it names."""
    try:
        params = inspect.signature(reset).parameters.values()
    except (TypeError, ValueError):
        return dict(columns)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(columns)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in columns.items() if k in names}


def _required(fn: Callable) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


class _Episode:
    __slots__ = ("env", "instance", "tools", "rng")

    def __init__(self, env: str | None) -> None:
        self.env = env
        self.instance: Any = None
        self.tools: list[str] = []
        self.rng: Any = None  # its state of the global `random`


class Runtime:
    """The episodes' instances and the plain tools, and the operations on them.

    `factories`: environment name -> (label, class or None for tools only); `tools`: [(label,
    function)]. Every operation returns (status, payload) and never raises for the user's code.
    """

    def __init__(self, factories: dict[str | None, tuple[str, Any]], tools: list[tuple[str, Any]]):
        self.factories = dict(factories)
        self.plain: dict[str, Callable] = {}
        for label, fn in tools:
            name = getattr(fn, "__name__", None) or label.rpartition(":")[2]
            if name in self.plain:
                raise LoadError(f"tool {label!r}: a second tool named {name!r}")
            self.plain[name] = fn
        self.episodes: dict[int, _Episode] = {}
        self._reported: set[str] = set()

    def describe(self) -> dict:
        """Build one instance of each environment: its tools, `get_reward`, `reset`'s needs."""
        out: dict[Any, Any] = {}
        for name, (label, cls) in self.factories.items():
            if cls is None:
                out[name] = {
                    "tools": [],
                    "has_reward": False,
                    "reset_ok": True,
                    "reset_required": [],
                }
                continue
            try:
                probe = cls()
            except BaseException as e:
                raise LoadError(
                    f"environment {label!r} fails to construct with no arguments: {_brief(e)}"
                ) from e
            reset = getattr(probe, "reset", None)
            if not callable(reset):
                raise LoadError(f"environment {label!r} has no reset method")
            required = _required(reset)
            out[name] = {
                "tools": public_methods(type(probe)),
                "has_reward": callable(getattr(probe, "get_reward", None)),
                "reset_ok": not required,
                "reset_required": required,
            }
        out["__plain__"] = list(self.plain)
        return out

    # ------------------------------------------------------------------ operations
    def drop(self) -> tuple[str, None]:
        self.episodes.clear()
        return "ok", None

    def reset(self, i: int, env: str | None, columns: dict, seed: int) -> tuple[str, str]:
        """Episode i: a fresh instance of `env`, `random.seed(seed)`, `reset(**columns)`."""
        self.episodes.pop(i, None)
        label, cls = self.factories.get(env, ("", None))
        ep = _Episode(env)
        if cls is None:
            self.episodes[i] = ep
            return "ok", ""

        def run() -> str:
            ep.instance = cls()
            ep.tools = public_methods(type(ep.instance))
            value = ep.instance.reset(**reset_arguments(ep.instance.reset, columns))
            return "" if value is None else str(value)

        status, text = self._in_episode(ep, run, f"{label}.reset", seed=seed)
        if status == "ok":
            self.episodes[i] = ep
        return status, text

    def call(self, i: int, name: str, kwargs: dict) -> tuple[str, tuple[str, bool]]:
        """Tool `name` of episode i: payload (text, whether it is an environment method)."""
        ep = self.episodes.get(i)
        if ep is None:
            return "error", (
                error_text(f"episode {i} has no environment (its reset failed)"),
                False,
            )
        fn: Callable | None = None
        is_method = ep.instance is not None and name in ep.tools
        if is_method:
            fn = getattr(ep.instance, name)
        elif name in self.plain:
            fn = self.plain[name]
        known = ", ".join(ep.tools + [n for n in self.plain if n not in ep.tools]) or "(none)"
        if fn is None:
            return "unknown", (error_text(f"unknown tool {name!r}; the tools are: {known}"), False)
        try:
            inspect.signature(fn).bind(**kwargs)
        except TypeError as e:
            problem = f"bad arguments for tool {name!r}: {e}; the tools are: {known}"
            return "unknown", (error_text(problem), False)
        except ValueError:
            pass  # no signature to check (a builtin): the call itself decides
        status, text = self._in_episode(ep, lambda: str(fn(**kwargs)), name)
        return status, (text, is_method)

    def reward(self, i: int) -> tuple[str, float | str | None]:
        """get_reward() of episode i as a float, None when there is none to ask."""
        ep = self.episodes.get(i)
        get = getattr(ep.instance, "get_reward", None) if ep is not None else None
        if not callable(get):
            return "ok", None

        def run() -> float | None:
            value = get()
            if value is None:
                return None
            if isinstance(value, complex) or not isinstance(value, (int, float)):
                try:  # numpy scalars and the like
                    return float(value.__float__())
                except Exception:
                    raise TypeError(f"get_reward returned a {type(value).__name__}") from None
            return float(value)

        return self._in_episode(ep, run, "get_reward", as_text=False)

    def instance(self, i: int) -> tuple[str, bytes | str | None]:
        """Episode i's instance, pickled (None when it has none)."""
        ep = self.episodes.get(i)
        if ep is None or ep.instance is None:
            return "ok", None
        try:
            return "ok", pickle.dumps(ep.instance)
        except BaseException as e:
            return "error", f"its environment instance cannot be pickled ({_brief(e)})"

    # ------------------------------------------------------------------ the episode's `random`
    def _in_episode(
        self, ep: _Episode, fn: Callable, what: str, seed: int | None = None, as_text: bool = True
    ) -> tuple[str, Any]:
        """fn() with the episode's `random` state; ("ok", value) or ("error", message)."""
        saved = random.getstate()
        if seed is not None:
            random.seed(seed)
        elif ep.rng is not None:
            random.setstate(ep.rng)
        try:
            return "ok", fn()
        except BaseException as e:  # SystemExit, RecursionError, ...: all are the tool's failures
            if what not in self._reported:
                self._reported.add(what)
                print(
                    f"ebpo_lite: {what} raised (the model is told; later errors of it are only "
                    f"counted):\n{traceback.format_exc().rstrip()}",
                    file=sys.stderr,
                    flush=True,
                )
            return "error", error_text(_brief(e)) if as_text else _brief(e)
        finally:
            ep.rng = random.getstate()
            random.setstate(saved)


# ---------------------------------------------------------------------- the worker process
def _die_with_parent() -> None:
    """Linux: SIGKILL when the trainer dies, so a hung tool cannot outlive it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _protocol_fds() -> tuple[Connection, Connection]:
    """Connections on the original stdin / stdout; fds 0 and 1 become /dev/null and stderr."""
    requests = Connection(os.dup(0), writable=False)
    replies = Connection(os.dup(1), readable=False)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # a tool's prints must not corrupt the protocol
    return requests, replies


def _runtime(hello: dict) -> Runtime:
    factories = {
        name: (target, load(target, "environment") if target else None)
        for name, target in hello["factories"].items()
    }
    return Runtime(factories, [(t, load(t, "tool")) for t in hello["tools"]])


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we exit on EOF
    _die_with_parent()
    requests, replies = _protocol_fds()
    try:
        hello = requests.recv()
    except EOFError:
        return
    sys.path[:] = list(hello["sys_path"])  # the trainer's, not this file's folder
    try:
        runtime = _runtime(hello)
        description = runtime.describe() if hello["probe"] else None
    except LoadError as e:
        replies.send(("load_error", str(e)))
        return
    replies.send(("ready", description))
    while True:
        try:
            request = requests.recv()
        except EOFError:
            return
        try:
            reply = getattr(runtime, request[0])(*request[1:])
        except BaseException as e:  # not the user's code: a request this worker cannot serve
            reply = ("error", error_text(f"the tool worker failed: {_brief(e)}"))
        try:
            replies.send(reply)
        except Exception as e:
            replies.send(("error", error_text(f"the result cannot be sent back: {_brief(e)}")))


if __name__ == "__main__":
    main()
