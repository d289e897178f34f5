"""A persistent pool of math-verify worker processes with a hard time limit per answer.

Why processes: math-verify (sympy) can take unbounded time and memory on adversarial output
(`9^{9^{9^{9}}}`, deeply nested LaTeX), and its own timeout uses SIGALRM, which only works in the
main thread and cannot interrupt a long C-level integer power. Here each worker is a separate
Python (`_verify_worker.py`, started by path with `subprocess`, so it never re-imports the
caller's `__main__` and works from any thread, notebooks included). Inside the worker a forked
executor does the judging; past `timeout_s` the worker kills it and forks a fresh one in
milliseconds. The trainer side keeps a second, looser deadline (`timeout_s + GRACE_S`) and kills
and restarts a whole worker that stops answering.

The pool starts lazily on the first call (about 1-2 s: Python + sympy imports), is reused by
every later call, and is shut down by `close()` (also registered with `atexit`). After a `fork`
of the trainer the child builds its own pool. Calls from several threads are serialised.

Results per item: 1.0 / 0.0; None when the gold cannot be parsed; "timeout" or "error" when the
limit was hit or the executor failed (the caller maps both to 0.0 and counts them in `stats()`).
`judge` / `judge_batch` take items (prediction, golds, mode) and also return the answer string
math-verify extracted in "text" mode (see `_verify_worker.py`); `score` / `verify_batch` are the
"boxed"-mode shorthand returning the verdicts alone.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

Verdict = float | None | str  # 1.0 / 0.0 / None / "timeout" / "error"
Item = tuple[str, list[str], str]  # (prediction, golds, mode: "boxed" | "text")

GRACE_S = 2.0  # trainer-side slack over the worker's own limit
STARTUP_TIMEOUT_S = 120.0  # a worker must print "ready" within this (sympy import on a busy box)
_WORKER = Path(__file__).with_name("_verify_worker.py")


def default_num_workers() -> int:
    """EBPO_LITE_VERIFY_WORKERS, else half the CPUs (1 to 4)."""
    env = os.environ.get("EBPO_LITE_VERIFY_WORKERS")
    if env:
        return max(1, int(env))
    return min(4, max(1, (os.cpu_count() or 2) // 2))


class _Worker:
    """One worker subprocess and its read buffer."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.task: tuple[int, float] | None = None  # (item index, trainer-side deadline)

    def send(self, idx: int, item: Item, timeout_s: float) -> bool:
        pred, gold, mode = item
        msg = {"id": idx, "pred": pred, "gold": gold, "t": timeout_s, "mode": mode}
        line = json.dumps(msg) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except OSError:
            return False
        self.task = (idx, time.monotonic() + timeout_s + GRACE_S)
        return True

    def read_lines(self) -> list[dict] | None:
        """Complete messages available now; None at EOF (the worker died)."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(x) for x in lines if x.strip()]

    def kill(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class VerifierPool:
    """`num_workers` worker processes; `score` judges a batch with a per-item time limit."""

    def __init__(self, num_workers: int | None = None) -> None:
        self.num_workers = num_workers or default_num_workers()
        self.pid = os.getpid()
        self.workers: list[_Worker] = []
        self.counts = {"items": 0, "timeouts": 0, "errors": 0, "restarts": 0}
        self._failed_starts = 0

    def _start_missing(self) -> None:
        while len(self.workers) < self.num_workers:
            self.workers.append(_Worker())

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers.remove(w)
        self.counts["restarts"] += 1
        self.workers.append(_Worker())

    def score(self, items: list[tuple[str, list[str]]], timeout_s: float) -> list[Verdict]:
        """Judge (answer, golds) pairs in "boxed" mode; see the module docstring for the values."""
        return [r for r, _ in self.judge([(p, g, "boxed") for p, g in items], timeout_s)]

    def judge(self, items: list[Item], timeout_s: float) -> list[tuple[Verdict, str | None]]:
        """(verdict, extracted answer string or None) per (prediction, golds, mode) item."""
        self._start_missing()
        results: list[tuple[Verdict, str | None]] = [(None, None)] * len(items)
        done = [False] * len(items)
        pending = deque(range(len(items)))
        remaining = len(items)
        while remaining:
            for w in self.workers:  # dispatch to idle, ready workers
                while w.ready and w.task is None and pending:
                    idx = pending.popleft()
                    if not w.send(idx, items[idx], timeout_s):
                        pending.appendleft(idx)
                        self._replace(w)
                        break
            remaining -= self._wait_once(results, done, timeout_s)
        self.counts["items"] += len(items)
        return results

    def _wait_once(self, results: list, done: list[bool], timeout_s: float) -> int:
        """Wait for one event (reply, death, deadline); returns how many items finished."""
        now = time.monotonic()
        deadlines = [w.task[1] if w.task else w.started + STARTUP_TIMEOUT_S for w in self.workers]
        wait = max(0.0, min(deadlines) - now)
        fds = {w.fd: w for w in self.workers}
        ready, _, _ = select.select(list(fds), [], [], wait)
        finished = 0
        for fd in ready:
            w = fds[fd]
            msgs = w.read_lines()
            if msgs is None:  # died
                finished += self._fail(w, results, done, "error")
                continue
            for msg in msgs:
                if msg.get("ready"):
                    w.ready = True
                    self._failed_starts = 0
                elif w.task is not None and msg.get("id") == w.task[0] and not done[w.task[0]]:
                    results[w.task[0]] = (msg["r"], msg.get("a"))
                    if msg["r"] in ("timeout", "error"):
                        self.counts[msg["r"] + "s"] += 1
                    done[w.task[0]] = True
                    w.task = None
                    finished += 1
        now = time.monotonic()
        for w in list(self.workers):
            if w.task is not None and now > w.task[1]:
                finished += self._fail(w, results, done, "timeout")
            elif not w.ready and now > w.started + STARTUP_TIMEOUT_S:
                self._fail(w, results, done, "error")
        return finished

    def _fail(self, w: _Worker, results: list, done: list[bool], why: str) -> int:
        if not w.ready:
            self._failed_starts += 1
            if self._failed_starts >= 3:
                self.close()
                raise RuntimeError(
                    f"math verification worker ({_WORKER.name}) failed to start 3 times with "
                    f"{sys.executable}; is math-verify installed? (its stderr is above)"
                )
        finished = 0
        if w.task is not None and not done[w.task[0]]:
            results[w.task[0]] = (why, None)
            done[w.task[0]] = True
            finished = 1
            self.counts["timeouts" if why == "timeout" else "errors"] += 1
        self._replace(w)
        return finished

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []


_POOL: VerifierPool | None = None
_LOCK = threading.Lock()
_NUM_WORKERS: int | None = None


def verify_batch(items: list[tuple[str, list[str]]], timeout_s: float) -> list[Verdict]:
    """Judge (answer, golds) pairs in "boxed" mode through the module-level pool."""
    return [r for r, _ in judge_batch([(p, g, "boxed") for p, g in items], timeout_s)]


def judge_batch(items: list[Item], timeout_s: float) -> list[tuple[Verdict, str | None]]:
    """`VerifierPool.judge` through the module-level pool (started on first use)."""
    global _POOL
    with _LOCK:
        if _POOL is None or _POOL.pid != os.getpid():  # first use, or we are a forked child
            _POOL = VerifierPool(_NUM_WORKERS)
        return _POOL.judge(items, timeout_s)


def configure(num_workers: int | None = None) -> None:
    """Set the pool size (None: `default_num_workers()`); restarts the pool on next use."""
    global _NUM_WORKERS
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers: must be >= 1, got {num_workers}")
    close()
    _NUM_WORKERS = num_workers


def close() -> None:
    """Stop the worker processes (a later call starts them again)."""
    global _POOL
    with _LOCK:
        if _POOL is not None and _POOL.pid == os.getpid():
            _POOL.close()
        _POOL = None


def stats() -> dict[str, int]:
    """Counters of the current pool: items, timeouts, errors, restarts."""
    with _LOCK:
        return dict(_POOL.counts) if _POOL is not None else {}


atexit.register(close)
