"""Verification worker process: run as a script, speaks JSON lines on stdin / stdout.

Started by `ebpo_lite.rewards.verify_pool` as `python _verify_worker.py` (by path, so it needs
neither ebpo_lite on sys.path nor the caller's `__main__`; it imports only the standard library
and math-verify). Two levels:

- the *supervisor* (this process) imports math-verify once, then forks an *executor* child;
- the executor judges one (prediction, golds) pair at a time. The supervisor waits on it with the
  per-answer time limit; past the limit it SIGKILLs the executor and forks a fresh one, which is
  cheap (milliseconds: math-verify is already imported), and answers "timeout".

math-verify's own signal-based timeouts are disabled (they only interrupt Python bytecode, not a
long sympy integer power in C, and they raise outside a main thread); the executor also runs
under an address-space limit so a memory bomb fails fast with MemoryError ("error").

Two kinds of prediction (`"mode"`):
- "boxed": `pred` is an answer already extracted by `extract.py` (a box's content, a GSM8K
  number) and is parsed as `\\boxed{pred}`, as are the golds;
- "text": `pred` is the bounded tail of a completion with neither, and math-verify's own
  extraction finds the answer in it: `parse(text)` with its default
  `[LatexExtractionConfig(), ExprExtractionConfig()]`, as lighteval and math-verify's README do.
  The reply also carries `"a"`: math-verify's extracted string (the first string in `parse`'s
  result, i.e. the text of the first candidate it tried; null when it found nothing, and always
  null in "boxed" mode, where the caller has the answer).

Protocol. Request: {"id": int, "pred": str, "gold": [str, ...], "t": seconds, "mode": str}.
Reply: {"id": int, "r": 1.0 | 0.0 | null | "timeout" | "error", "a": str | null};
null r = gold unparsable. The first line written is {"ready": true}. EOF on stdin ends the worker.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

MAX_ANSWER_CHARS = 2000  # of the extracted string sent back (as extract.MAX_ANSWER_CHARS)


def _judge(pred: str, golds: list[str], mode: str = "boxed") -> tuple[float | None, str | None]:
    """(verdict, extracted string or None) for one prediction; see the module docstring."""
    from math_verify import parse, verify

    answer = None
    if mode == "text":  # math-verify's own extraction on free text
        parsed_pred = parse(pred, parsing_timeout=None)
        strings = [x for x in parsed_pred if isinstance(x, str)] or [str(x) for x in parsed_pred]
        answer = strings[0][:MAX_ANSWER_CHARS] if strings else None
    parsed_golds = [
        g for g in (parse("\\boxed{" + x + "}", parsing_timeout=None) for x in golds) if g
    ]
    if not parsed_golds:
        return None, answer
    if mode != "text":
        parsed_pred = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not parsed_pred:
        return 0.0, answer
    ok = any(verify(g, parsed_pred, timeout_seconds=None) for g in parsed_golds)
    return (1.0 if ok else 0.0), answer


def _executor_loop(rfd: int, wfd: int, mem_mb: int) -> None:
    if mem_mb > 0:
        import resource

        limit = mem_mb * 1024 * 1024
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ValueError, OSError):
            pass
    with os.fdopen(rfd, "rb") as inp:
        for line in inp:
            msg = json.loads(line)
            a = None
            try:
                r, a = _judge(msg["pred"], msg["gold"], msg.get("mode", "boxed"))
            except BaseException:  # MemoryError, RecursionError, bugs: never kill the loop
                r = "error"
            os.write(wfd, (json.dumps({"id": msg["id"], "r": r, "a": a}) + "\n").encode())


def _detach_child(keep: tuple[int, ...]) -> None:
    """In the executor: die with the supervisor; hold none of the trainer's pipes."""
    try:  # Linux: SIGKILL when the supervisor dies, so a runaway sympy call cannot outlive it
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    lo = 3
    for fd in sorted(keep):
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, 1 << 16)


class _Executor:
    """One forked child judging requests; replaced after a timeout or a crash."""

    def __init__(self, mem_mb: int):
        self.mem_mb = mem_mb
        self.pid: int | None = None

    def start(self) -> None:
        r1, w1 = os.pipe()  # supervisor -> executor
        r2, w2 = os.pipe()  # executor -> supervisor
        pid = os.fork()
        if pid == 0:  # child
            try:
                _detach_child(keep=(r1, w2))
                _executor_loop(r1, w2, self.mem_mb)
            finally:
                os._exit(0)
        os.close(r1)
        os.close(w2)
        self.pid, self.wfd, self.rfd, self.buf = pid, w1, r2, b""

    def stop(self) -> None:
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        os.close(self.wfd)
        os.close(self.rfd)
        self.pid = None

    def run(self, msg: dict, timeout_s: float) -> dict:
        if self.pid is None:
            self.start()
        try:
            os.write(self.wfd, (json.dumps(msg) + "\n").encode())
        except OSError:
            self.stop()
            return {"r": "error"}
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                return {"r": "timeout"}
            ready, _, _ = select.select([self.rfd], [], [], left)
            if ready:
                chunk = os.read(self.rfd, 65536)
                if not chunk:  # the executor died (e.g. killed by the OS)
                    self.stop()
                    return {"r": "error"}
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        reply = json.loads(line)
        return {"r": reply["r"], "a": reply.get("a")}


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we exit on EOF
    import logging

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    _judge("1", ["1"])  # import and warm math-verify once, before any fork
    _judge("so x = 1/2", ["1"], "text")
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    mem_mb = int(os.environ.get("EBPO_LITE_VERIFY_MEM_MB", "4096"))
    executor = _Executor(mem_mb)
    executor.start()
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        msg = json.loads(line)
        job = {k: msg[k] for k in ("id", "pred", "gold")}
        reply = executor.run({**job, "mode": msg.get("mode", "boxed")}, msg["t"])
        out.write((json.dumps({"id": msg["id"], **reply}) + "\n").encode())
        out.flush()
    executor.stop()


if __name__ == "__main__":
    main()
