"""User reward functions (`reward.functions: [module:function]`) run contained.

A user function is the user's code, so it may raise, hang, or return the wrong thing; none of
that may end a run. `get_reward_fn("module:function")` returns a `ContainedReward`, which calls
the function in its own worker process (`_reward_worker.py`) and checks what comes back:

- an exception, a worker that dies, or a result that is not a sequence of len(completions)
  (list, tuple or 1-D numpy array): every completion of that call is masked;
- an element that is neither None nor a real number (str, dict, complex, an int too big for a
  float): that completion is masked. NaN and inf pass through as values (the trainer decides
  what a non-finite reward does to a step);
- no reply within `timeout_s` for the whole batch: the worker (and anything it started) is
  killed and the call is masked; a fresh worker starts on the next call, so a hang costs one
  batch. `timeout_s` is the call's `timeout_s` keyword (the trainer passes `reward.timeout_s`),
  else `DEFAULT_TIMEOUT_S`.

Masked means the value is None, which `combine_rewards` turns into a None total: the completion
is left out of the loss. A None the function returns itself ("cannot judge") is not an error.

Counting: `reward/errors` is the number of completion scores masked by containment (every cause;
a call masked whole counts all its completions) and `reward/timeouts` the part of them masked by
the time limit, both since the last `take_error_counts`. The first failure of each kind
(exception, timeout, crash, bad result) of each function is printed to stderr once, with its
traceback; later ones are only counted.

Why a subprocess started by path and not `multiprocessing` (spawn): a spawned child re-imports
the trainer's `__main__` (for `python -m ebpo_lite.train` that is torch, about 2 s on two
cores; a user script without a `__main__` guard would start training again), and importing
ebpo_lite itself imports torch. The worker imports only the standard library and the user's
module, with the trainer's sys.path. It starts lazily on the first call; `close()` stops it
(the trainer does at the end of a run; `atexit` too).

Nothing here or in the worker ever executes a completion: completions are data, pickled to the
worker and passed to the user function as strings.
"""

from __future__ import annotations

import atexit
import numbers
import sys
import threading
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ebpo_lite.errors import UserError
from ebpo_lite.rewards.worker import Worker

DEFAULT_TIMEOUT_S = 5.0  # as math_answer's default (the config's reward.timeout_s)
STARTUP_TIMEOUT_S = 120.0  # the worker must import the user's module within this
MAX_TRACEBACK_CHARS = 8000  # of a printed traceback (its end: where it failed)
_WORKER = Path(__file__).with_name("_reward_worker.py")
_LIVE: weakref.WeakSet[ContainedReward] = weakref.WeakSet()

_WHAT = {
    "error": "raised an exception",
    "timeout": "hit the time limit",
    "crash": "crashed its worker process",
    "result": "returned a bad result",
}


def check_result(values: Any, n: int) -> tuple[list[float | None], int, str | None]:
    """(values as floats / None, how many were masked, what was wrong) for a result meant for
    `n` completions. See the module docstring for the rules."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()  # numpy scalars -> Python numbers
    if not isinstance(values, (list, tuple)):
        what = f"an array of shape {values.shape}" if isinstance(values, np.ndarray) else None
        what = what or f"a {type(values).__name__}"
        return [None] * n, n, f"returned {what}, not a list of {n} values"
    if len(values) != n:
        return [None] * n, n, f"returned {len(values)} values for {n} completions"
    out: list[float | None] = []
    bad: list[int] = []
    for i, v in enumerate(values):
        x = None
        if v is None:
            out.append(None)
            continue
        if isinstance(v, (numbers.Real, np.bool_)):
            try:
                x = float(v)
            except (OverflowError, TypeError, ValueError):
                x = None
        if x is None:
            bad.append(i)
        out.append(x)
    if not bad:
        return out, 0, None
    first = values[bad[0]]
    shown = repr(first) if len(repr(first)) < 80 else repr(first)[:77] + "..."
    problem = f"{len(bad)} of {n} values are not numbers (first: [{bad[0]}] = {shown})"
    return out, len(bad), problem


class ContainedReward:
    """A `module:function` reward function called in a worker process (see the module doc).

    Called like the function itself (TRL's convention); returns a list of len(completions)
    floats / None, never raises for the function's own failures. Thread-safe (calls are
    serialised). `counts`: calls, errors, timeouts (masked completions), restarts (workers
    replaced after a timeout or a crash).
    """

    def __init__(self, target: str) -> None:
        self.target = self.__name__ = target
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "restarts": 0}
        self._untaken = {"errors": 0, "timeouts": 0}
        self._reported: set[str] = set()
        self._lock = threading.Lock()
        self._worker = Worker(_WORKER)
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"ContainedReward({self.target!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> list[float | None]:
        completions = kwargs["completions"] if "completions" in kwargs else args[0]
        n = len(completions)
        timeout_s = float(kwargs.get("timeout_s") or DEFAULT_TIMEOUT_S)
        with self._lock:
            self.counts["calls"] += 1
            kind, payload = self._call(args, kwargs, timeout_s)
            if kind == "ok":
                values, masked, problem = check_result(payload, n)
                kind = "result"
            else:
                values, masked, problem = [None] * n, n, payload
            if masked:
                self._record(kind, masked, n, problem)
        return values

    # ------------------------------------------------------------------ the worker
    def _call(self, args: tuple, kwargs: dict, timeout_s: float) -> tuple[str, Any]:
        """("ok", raw result) or (failure kind, description / traceback)."""
        if not self._worker.running():
            self._start()
        w = self._worker
        try:
            w.requests.send((args, kwargs))
        except OSError:
            return self._crashed()
        except Exception as e:  # the arguments do not pickle: the caller's doing, still contained
            return "error", f"its arguments cannot be sent to the worker: {e!r}"
        if not w.replies.poll(timeout_s):
            w.stop(kill=True)
            self.counts["restarts"] += 1
            return "timeout", (
                f"no result within timeout_s = {timeout_s:g} s for the whole batch; its worker "
                "was killed (a fresh one starts on the next call)"
            )
        try:
            return w.replies.recv()
        except (EOFError, OSError):
            return self._crashed()
        except Exception as e:  # the reply does not unpickle in the trainer
            return "error", f"its result cannot be read back: {e!r}"

    def _crashed(self) -> tuple[str, str]:
        code = self._worker.exit_status()
        self._worker.stop(kill=True)
        self.counts["restarts"] += 1
        return "crash", f"its worker process died (exit status {code}); a fresh one starts next"

    def _start(self) -> None:
        hello = {"target": self.target, "sys_path": list(sys.path)}
        reply = self._worker.start(hello, STARTUP_TIMEOUT_S, failed="import_error")
        if reply[0] != "ready":
            self._worker.stop(kill=True)
            tb = str(reply[1]).rstrip()
            print(tb, file=sys.stderr, flush=True)
            raise UserError(
                f"reward.functions: {self.target!r} imports in the trainer but not in its worker "
                f"process (a fresh Python with the trainer's sys.path): {tb.splitlines()[-1]}"
            )

    def close(self) -> None:
        """Stop the worker (a later call starts a fresh one)."""
        with self._lock:
            self._worker.close()

    # ------------------------------------------------------------------ counting and logging
    def _record(self, kind: str, masked: int, n: int, problem: str) -> None:
        self.counts["errors"] += masked
        self._untaken["errors"] += masked
        if kind == "timeout":
            self.counts["timeouts"] += masked
            self._untaken["timeouts"] += masked
        if kind in self._reported:
            return
        self._reported.add(kind)
        detail = str(problem).rstrip()
        if len(detail) > MAX_TRACEBACK_CHARS:
            detail = "...\n" + detail[-MAX_TRACEBACK_CHARS:]
        which = "all its" if masked == n else f"{masked} of its"
        print(
            f"ebpo_lite: reward function {self.target!r} {_WHAT[kind]}: {which} {n} completions "
            f"in this call are masked (reward None) and the run continues; later failures of "
            f"this kind are only counted (reward/errors, reward/timeouts)\n{detail}",
            file=sys.stderr,
            flush=True,
        )

    def take_counts(self) -> dict[str, int]:
        """Masked completions ("errors", of them "timeouts") since the last call; resets them."""
        with self._lock:
            out, self._untaken = self._untaken, {"errors": 0, "timeouts": 0}
        return out


def take_error_counts(fns: Iterable[Any]) -> dict[str, int]:
    """`reward/errors` and `reward/timeouts` of the contained functions among `fns` (callables
    or (name, callable) pairs) since they were last taken; 0 and 0 when none is contained."""
    out = {"reward/errors": 0, "reward/timeouts": 0}
    for f in fns:
        fn = f[1] if isinstance(f, tuple) else f
        if isinstance(fn, ContainedReward):
            for k, v in fn.take_counts().items():
                out[f"reward/{k}"] += v
    return out


def close(fns: Sequence[Any] | None = None) -> None:
    """Stop the workers of the contained functions among `fns` (None: all of them)."""
    targets = list(_LIVE) if fns is None else [f[1] if isinstance(f, tuple) else f for f in fns]
    for fn in targets:
        if isinstance(fn, ContainedReward):
            fn.close()


atexit.register(close)
