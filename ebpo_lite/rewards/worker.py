"""The trainer's side of a contained worker: a Python script started by path, in a session of
its own, talking pickled messages over two pipes (`multiprocessing.connection` framing).

`rewards/contained.py` runs user reward functions in one (`_reward_worker.py`) and
`env/host.py` tools and environments (`env/_tool_worker.py`); both scripts import only the
standard library and the user's module, never ebpo_lite or torch. This holds what the two
share: start the script and say hello, notice a dead or a forked-away worker, stop it (SIGKILL
to its process group: the worker and whatever it started).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


class Worker:
    """One worker process of `script` (module docstring). `requests` / `replies` are its pipes
    while it runs; `proc` is None when there is none."""

    def __init__(self, script: Path):
        self.script = script
        self.proc: subprocess.Popen | None = None
        self.pid = os.getpid()  # the process that started it (a forked child does not own it)
        self.requests: Connection | None = None
        self.replies: Connection | None = None

    def running(self) -> bool:
        """Whether a worker of this process is up (one that died while idle is cleaned up)."""
        if self.proc is not None and self.pid != os.getpid():  # we are a forked child:
            self.proc = None  # the parent's worker is the parent's to stop
        if self.proc is not None and self.proc.poll() is not None:
            self.stop(kill=True)
        return self.proc is not None

    def start(self, hello: Any, timeout_s: float, failed: str) -> tuple[str, Any]:
        """Start the script and send it `hello`; its first reply, or (`failed`, why) when it
        exits or says nothing within `timeout_s`."""
        r_req, w_req = os.pipe()  # trainer -> worker
        r_rep, w_rep = os.pipe()  # worker -> trainer
        self.proc = subprocess.Popen(
            [sys.executable, str(self.script)],
            stdin=r_req,
            stdout=w_rep,
            close_fds=True,
            start_new_session=True,  # its own process group: killed whole on a timeout
        )
        os.close(r_req)
        os.close(w_rep)
        self.pid = os.getpid()
        self.requests = Connection(w_req, readable=False)
        self.replies = Connection(r_rep, writable=False)
        try:
            self.requests.send(hello)
            if self.replies.poll(timeout_s):
                return self.replies.recv()
            return failed, f"no reply within {timeout_s:g} s"
        except (EOFError, OSError):
            return failed, "no reply (the worker exited)"

    def exit_status(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def stop(self, kill: bool) -> None:
        """Close the pipes (an idle worker exits on EOF); `kill`, or no exit within 2 s: SIGKILL
        to its process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for conn in (self.requests, self.replies):
            try:
                conn.close()
            except OSError:
                pass
        if not kill:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and whatever it started
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the worker if this process started it (a forked child leaves it alone)."""
        if self.pid == os.getpid():
            self.stop(kill=False)
        self.proc = None
