"""User reward function worker: run as a script, one per contained function (`contained.py`).

Started as `python _reward_worker.py` (by path: it imports only the standard library and the
user's module, never ebpo_lite or torch, and never re-imports the trainer's `__main__`, so it is
up in tens of milliseconds plus the user module's own import). It runs in its own session, so
the trainer can kill it together with anything the user function started.

Protocol: pickled messages with `multiprocessing.connection` framing, requests on stdin, replies
on stdout (the real fds 0 and 1 are moved aside first: the user function's prints go to stderr,
and reading stdin gives EOF).
- first request {"target": "module:function", "sys_path": [...]}: the worker takes the trainer's
  sys.path, imports the function and replies ("ready", None), or ("import_error", traceback) and
  exits;
- then each request (args, kwargs): reply ("ok", fn(*args, **kwargs)) or ("error", traceback),
  also when the result cannot be pickled. The result is not checked here (the trainer does it).
- EOF on the request pipe ends the worker.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection


def _die_with_parent() -> None:
    """Linux: SIGKILL when the trainer dies, so a hung function cannot outlive it."""
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
    os.dup2(2, 1)  # stray prints of the user function must not corrupt the protocol
    return requests, replies


def _load(target: str):
    module_name, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"{target}: {attr!r} is not callable")
    return fn


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
        fn = _load(hello["target"])
    except BaseException:
        replies.send(("import_error", traceback.format_exc()))
        return
    replies.send(("ready", None))
    while True:
        try:
            args, kwargs = requests.recv()
        except EOFError:
            return
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:  # SystemExit, KeyboardInterrupt, RecursionError: all are failures
            reply = ("error", traceback.format_exc())
        try:
            replies.send(reply)
        except Exception:  # the result does not pickle (a generator, a lambda, ...)
            replies.send(("error", "the result cannot be sent back:\n" + traceback.format_exc()))


if __name__ == "__main__":
    main()
