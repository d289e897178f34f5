"""Issue 13: user reward functions run contained; adversarial completions through every reward.

A user function (`module:function`) that raises, crashes, hangs or returns the wrong thing masks
the affected completions, is counted, is reported once, and the next call works. Adversarial
completions (huge numbers, pathological LaTeX, megabyte strings, invalid UTF-8, NUL bytes) get a
float or None from every reward within a bounded time, and no completion is ever executed.
"""

from __future__ import annotations

import ast
import math
import os
import sys
import time
import types

import numpy as np
import pytest

from ebpo_lite import rewards
from ebpo_lite.engine.metrics import read_metrics
from ebpo_lite.errors import UserError
from ebpo_lite.rewards import (
    ContainedReward,
    arithmetic_answer,
    combine_rewards,
    extract_answer,
    format_reward,
    format_think_reward,
    get_reward_fn,
    length_penalty,
    math_answer,
    take_error_counts,
)
from ebpo_lite.rewards.contained import check_result
from tests.conftest import REPO

MOD = "ebpo_test_user_rewards"
USER_MODULE = '''
import os
import time

import numpy as np


def length(completions, **kwargs):
    """Well-behaved: the length of each completion."""
    return [float(len(c)) for c in completions]


def picky(completions, **kwargs):
    """Well-behaved unless a completion asks for trouble."""
    if "raise" in completions:
        raise ValueError("user bug on purpose")
    if "crash" in completions:
        os._exit(3)
    if "hang" in completions:
        import subprocess

        child = subprocess.Popen(["sleep", "3600"])  # killed with the worker's process group
        with open(os.environ["EBPO_TEST_GRANDCHILD"], "w") as f:
            f.write(str(child.pid))
        time.sleep(3600)
    if "short" in completions:
        return [1.0]
    if "dict" in completions:
        return {"a": 1.0}
    if "2d" in completions:
        return np.ones((len(completions), 1))
    if "array" in completions:
        return np.arange(len(completions), dtype=np.float32)
    if "mixed" in completions:
        return [1.0, "1.0", {"a": 1}, 2 + 0j, None, True, np.int64(7), float("nan"),
                float("inf"), 10**400][: len(completions)]
    print("a stray print from the user function")  # must not corrupt the protocol
    return [float(len(c)) for c in completions]


def raising(completions, **kwargs):
    raise RuntimeError("always fails")


def trl_exact(completions, **columns):
    """TRL's documented signature: every column by name (arithmetic_answer's scores)."""
    assert len(columns["prompts"]) == len(completions)  # the prompts column comes too
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, columns["answer"])]


def hanging(completions, **kwargs):
    time.sleep(3600)


_CALLS = [0]


def raising_sometimes(completions, answer, **kwargs):
    """Raises on odd training calls (the first training step), scores like arithmetic_answer
    otherwise. A training call scores 4 prompts x 4 completions; the in-training eval, which
    scores every reward function too, sends its 8 held-out problems and is not counted."""
    if len(completions) == 16:
        _CALLS[0] += 1
    if _CALLS[0] % 2 and len(completions) == 16:
        raise ZeroDivisionError("odd call")
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]
'''


@pytest.fixture(scope="module")
def user_mod(tmp_path_factory):
    """The user module in a tmp dir on sys.path (the worker gets the trainer's sys.path)."""
    d = tmp_path_factory.mktemp("user_rewards")
    (d / f"{MOD}.py").write_text(USER_MODULE)
    sys.path.insert(0, str(d))
    os.environ["EBPO_TEST_GRANDCHILD"] = str(d / "grandchild.pid")
    yield d
    rewards.close_contained()
    sys.path.remove(str(d))
    sys.modules.pop(MOD, None)
    os.environ.pop("EBPO_TEST_GRANDCHILD", None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


# ----------------------------------------------------------------------------- result checks


def test_check_result_rules():
    assert check_result([1, 2.5, None, True, np.float32(0.5), np.int64(3)], 6) == (
        [1.0, 2.5, None, 1.0, 0.5, 3.0],
        0,
        None,
    )
    assert check_result(np.array([1.0, 2.0]), 2)[:2] == ([1.0, 2.0], 0)
    assert check_result((0, 1), 2)[:2] == ([0.0, 1.0], 0)
    values, masked, _ = check_result([math.nan, math.inf, -math.inf], 3)  # not masked here
    assert masked == 0 and math.isnan(values[0]) and values[1:] == [math.inf, -math.inf]
    for whole in ([1.0], None, {"a": 1}, "11", 1.0, np.ones((2, 1)), np.float64(1.0)):
        values, masked, problem = check_result(whole, 2)
        assert (values, masked) == ([None, None], 2) and problem, whole
    values, masked, problem = check_result(["1.0", 1.0, {"a": 1}, 1j, 10**400, None], 6)
    assert values == [None, 1.0, None, None, None, None] and masked == 4
    assert "4 of 6" in problem and "'1.0'" in problem


# ----------------------------------------------------------------------------- failures


def test_exception_masks_the_call_logs_once_and_next_call_works(user_mod, capfd):
    fn = get_reward_fn(f"{MOD}:picky")
    assert isinstance(fn, ContainedReward)
    assert fn(["ab", "c"]) == [2.0, 1.0]  # the worker imported the module from the tmp dir
    assert fn(completions=["raise", "xy", "z"]) == [None, None, None]
    assert fn(["raise"]) == [None]
    assert fn(["abc"]) == [3.0]
    err = capfd.readouterr().err
    assert "stray print" in err  # the user's prints go to stderr, not into the protocol
    assert err.count(f"reward function '{MOD}:picky' raised an exception") == 1
    assert "all its 3 completions in this call are masked" in err and "run continues" in err
    assert err.count("ValueError: user bug on purpose") == 1  # the traceback, once
    assert take_error_counts([("picky", fn)]) == {"reward/errors": 4, "reward/timeouts": 0}
    assert take_error_counts([fn]) == {"reward/errors": 0, "reward/timeouts": 0}  # taken
    assert fn.counts["calls"] == 4 and fn.counts["restarts"] == 0
    # combine_rewards: a masked completion has a None total
    total, per = combine_rewards({"len": fn, "fmt": format_reward}, None, ["raise", "ab"])
    assert total == [None, None] and per["len"] == [None, None]


def test_bad_results_mask_what_they_must(user_mod, capsys):
    fn = get_reward_fn(f"{MOD}:picky")
    assert fn(["short", "b", "c"]) == [None, None, None]  # wrong length: the whole call
    assert fn(["dict", "b"]) == [None, None]  # not a sequence
    assert fn(["2d", "b"]) == [None, None]  # not 1-D
    assert fn(["array", "b", "c"]) == [0.0, 1.0, 2.0]  # a numpy array is fine
    out = fn(["mixed"] + ["x"] * 9)  # bad elements: only those completions
    assert out[:2] == [1.0, None] and out[2:7] == [None, None, None, 1.0, 7.0]
    assert math.isnan(out[7]) and out[8] == math.inf and out[9] is None  # NaN / inf pass
    assert take_error_counts([fn])["reward/errors"] == 3 + 2 + 2 + 4
    err = capsys.readouterr().err
    assert err.count("returned a bad result") == 1  # the first bad result only
    assert "returned 1 values for 3 completions" in err


def test_hang_is_cut_at_timeout_and_costs_one_batch(user_mod, capsys):
    fn = get_reward_fn(f"{MOD}:picky")
    assert fn(["warm"]) == [4.0]  # worker started outside the timed part
    old = fn._worker.proc.pid
    t0 = time.monotonic()
    assert fn(["hang", "a", "b"], timeout_s=1.0) == [None, None, None]
    took = time.monotonic() - t0
    assert 0.9 < took < 4.0, took
    assert not _alive(old)
    grandchild = int((user_mod / "grandchild.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)  # what the hung function started is killed too
    t0 = time.monotonic()
    assert fn(["abc", "de"], timeout_s=1.0) == [3.0, 2.0]  # a fresh worker, the next batch
    print(f"fresh worker + call: {time.monotonic() - t0:.3f} s", file=sys.__stderr__)
    assert fn._worker.proc.pid != old
    assert take_error_counts([fn]) == {"reward/errors": 3, "reward/timeouts": 3}
    assert fn.counts["restarts"] == 1
    err = capsys.readouterr().err
    assert err.count("hit the time limit") == 1 and "timeout_s = 1 s" in err


def test_hanging_and_raising_functions_every_call(user_mod, capsys):
    hang, boom = get_reward_fn(f"{MOD}:hanging"), get_reward_fn(f"{MOD}:raising")
    t0 = time.monotonic()
    for _ in range(2):
        assert hang(["a", "b"], timeout_s=0.5) == [None, None]
        assert boom(["a", "b"]) == [None, None]
    assert time.monotonic() - t0 < 2 * 0.5 + 6.0
    counts = take_error_counts([("h", hang), ("b", boom), ("builtin", format_reward)])
    assert counts == {"reward/errors": 8, "reward/timeouts": 4}
    err = capsys.readouterr().err
    assert err.count("hit the time limit") == 1 and err.count("RuntimeError: always fails") == 1


def test_crash_masks_and_restarts(user_mod, capsys):
    fn = get_reward_fn(f"{MOD}:picky")
    assert fn(["crash", "a"]) == [None, None]
    assert fn(["a"]) == [1.0]
    assert fn.counts["restarts"] == 1 and take_error_counts([fn])["reward/errors"] == 2
    assert "crashed its worker process" in capsys.readouterr().err
    fn.close()
    assert fn._worker.proc is None
    assert fn(["ab"]) == [2.0]  # closed: the next call starts a fresh worker


def test_import_problems_are_user_errors(user_mod):
    with pytest.raises(ValueError, match="__main__ cannot be imported"):
        get_reward_fn("__main__:f")
    # a function that cannot take fn(completions, **columns) would mask every score: refused
    with pytest.raises(ValueError, match=r"'os:system': cannot be called as fn\(completions"):
        get_reward_fn("os:system")
    with pytest.raises(ValueError, match="TRL's signature"):
        get_reward_fn("os.path:join")  # join(a, *p): no `completions` keyword
    sys.modules["ebpo_test_only_here"] = types.SimpleNamespace(f=lambda completions, **k: [])
    try:
        fn = get_reward_fn("ebpo_test_only_here:f")  # the trainer can import it, a fresh one not
        with pytest.raises(UserError, match="imports in the trainer but not in its worker"):
            fn(["a"])
    finally:
        sys.modules.pop("ebpo_test_only_here")


# ----------------------------------------------------------------------------- adversarial


def _adversarial() -> dict[str, str]:
    invalid = b"caf\xe9 \xff\xfe \x80\xc3( \xed\xa0\x80 " + "é".encode()
    return {
        "huge_int": "9" * 100_000,
        "huge_exp": "1e999999",
        "huge_boxed_int": r"\boxed{" + "9" * 100_000 + "}",
        "boxed_exp": r"\boxed{1e999999}",
        "power_tower": r"\boxed{9^{9^{9^{9}}}}",
        "frac_nest_open": r"\boxed{" + r"\frac{" * 5000,
        "frac_nest_closed": r"\boxed{" + r"\frac{1}{" * 5000 + "2" + "}" * 5001,
        "frac_nest_short": r"\boxed{" + r"\frac{1}{" * 150 + "2" + "}" * 151,
        "unbalanced": "}{" * 50_000 + r"\boxed{{{{",
        "boxed_repeated": r"\boxed{" * 100_000,
        "boxed_repeated_closed": r"\boxed{1}" * 100_000,
        "two_mb": "a" * 2_000_000,
        "two_mb_numbers": "1 " * 1_000_000,
        "two_mb_commas": "1," * 1_000_000,
        "two_mb_think": "</think>" * 250_000,
        "two_mb_spaces_after_box": r"\boxed" + " " * 2_000_000,
        "two_mb_backslashes": "\\" * 2_000_000,
        "two_mb_dollars": "$" * 2_000_000,
        "two_mb_hashes": "####" * 500_000,
        "lone_surrogates": "\udcff\ud800 \\boxed{\udcff} 5 \udfff",
        "utf8_replaced": invalid.decode("utf-8", errors="replace"),
        "utf8_surrogateescape": invalid.decode("utf-8", errors="surrogateescape"),
        "nul_bytes": "\x00" * 1000 + r"\boxed{5}" + "\x00",
        "nul_in_box": "\\boxed{\x005\x00}",
        "empty": "",
    }


def _is_score(v) -> bool:
    return v is None or isinstance(v, float)


def test_adversarial_completions_through_every_reward(user_mod):
    adv = _adversarial()
    comps = list(adv.values())
    n = len(comps)
    length, picky = get_reward_fn(f"{MOD}:length"), get_reward_fn(f"{MOD}:picky")
    hang, boom = get_reward_fn(f"{MOD}:hanging"), get_reward_fn(f"{MOD}:raising")
    assert math_answer(["\\boxed{2}"], ["2"]) == [1.0]  # verify pool up before the clock starts
    t0 = time.monotonic()
    for fn in (math_answer, arithmetic_answer, format_reward, format_think_reward):
        out = fn(comps, answer=["5"] * n, timeout_s=1.0)
        assert len(out) == n and all(_is_score(v) for v in out), fn.__name__
        want = {math_answer: 1.0, format_reward: 1.0}.get(fn, 0.0)  # NULs around \\boxed{5}
        assert out[list(adv).index("nul_bytes")] == want, fn.__name__
    t_builtin = time.monotonic() - t0
    t1 = time.monotonic()  # what runs in the trainer: extraction must be linear, never stall
    for c in comps:
        extract_answer(c), arithmetic_answer([c], ["5"]), format_think_reward([c])
    t_in_process = time.monotonic() - t1
    assert t_in_process < 5.0  # measured 0.1 s on 2 cores
    total, per = combine_rewards(
        {"math": math_answer, "fmt": format_reward, "len": length, "picky": picky},
        [1.0, 0.5, 0.0, 0.0],
        comps,
        answer=["5"] * n,
        timeout_s=1.0,  # math: per answer; the user functions: per batch (18 M chars: 0.1 s)
    )
    assert per["len"] == [float(len(c)) for c in comps]  # 2 MB strings and surrogates survive
    assert per["picky"] == per["len"]
    assert len(total) == n and all(_is_score(v) for v in total)
    pen = length_penalty([len(c) for c in comps], max_new_tokens=4096, coef=1.0, start_frac=0.8)
    assert all(-1.0 <= p <= 0.0 for p in pen)
    assert hang(comps, timeout_s=1.0) == [None] * n
    assert boom(comps, answer=["5"] * n) == [None] * n
    took = time.monotonic() - t0
    print(
        f"adversarial batch ({n}): built-ins {t_builtin:.2f} s (in-process {t_in_process:.2f} s), "
        f"all {took:.2f} s",
        file=sys.__stderr__,
    )
    assert took < 60.0
    assert t_builtin < 30.0


# ----------------------------------------------------------------------------- never executed


def test_completions_are_never_executed(user_mod, tmp_path):
    marker = tmp_path / "pwned"
    cmd = f"touch {marker}"
    attacks = [
        f"__import__('os').system('{cmd}')",
        f'"; import os; os.system("{cmd}")',
        f"\\boxed{{__import__('os').system('{cmd}')}}",
        f"exec(\"import os; os.system('{cmd}')\")",
        f"eval(compile('import os; os.system(\"{cmd}\")', 'x', 'exec'))",
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"{{{{ ''.__class__.__mro__[1].__subclasses__() }}}}; os.system('{cmd}')",
        "cos(x)**2 + sin(x)**2 = 1; " + f"__import__('subprocess').call(['touch', '{marker}'])",
    ]
    n = len(attacks)
    for fn in (math_answer, arithmetic_answer, format_reward, format_think_reward):
        out = fn(attacks, answer=["5"] * n, timeout_s=2.0)
        assert all(_is_score(v) for v in out)
    assert get_reward_fn(f"{MOD}:length")(attacks) == [float(len(a)) for a in attacks]
    time.sleep(0.2)
    assert not marker.exists()


def test_package_never_calls_eval_or_exec():
    found = []
    for path in sorted((REPO / "ebpo_lite").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("eval", "exec", "compile", "__import__")
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.id}(")
    assert not found, found


# ----------------------------------------------------------------------------- in the loop


def test_tiny_run_goes_on_and_logs_reward_errors(user_mod, tmp_path):
    from ebpo_lite import config
    from ebpo_lite.train import train
    from tests.conftest import TINY_RECIPE, fast_overrides

    out = tmp_path / "run"
    overrides = fast_overrides(
        out,
        **{
            "train.steps": 2,
            "train.prompts_per_step": 4,
            "eval.num_examples": 8,
            "reward.functions": f"[arithmetic_answer, '{MOD}:raising_sometimes']",
        },
    )
    t0 = time.monotonic()
    summary = train(config.load(TINY_RECIPE, overrides))
    print(f"tiny run: {time.monotonic() - t0:.1f} s", file=sys.__stderr__)
    assert summary["steps_done"] == 2
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "reward/errors" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["reward/errors"] == 4 * 4 and steps[0]["train/unscored_frac"] == 1.0
    assert steps[1]["reward/errors"] == 0 and steps[1]["reward/timeouts"] == 0
    assert steps[1]["train/unscored_frac"] < 1.0


def test_a_trl_signature_reward_first_also_scores_the_in_training_eval(user_mod, tmp_path):
    """`score(completions, **columns)` as the first reward: the held-out eval calls it as
    training does (it once passed the answers positionally: every eval score masked, NaN)."""
    from ebpo_lite import config
    from ebpo_lite.train import train
    from tests.conftest import TINY_RECIPE, fast_overrides

    out = tmp_path / "run"
    extra = {"train.steps": 1, "train.prompts_per_step": 4, "eval.num_examples": 8}
    extra["reward.functions"] = f"['{MOD}:trl_exact']"
    train(config.load(TINY_RECIPE, fast_overrides(out, **extra)))
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for r in evals:
        assert r["eval/reward_errors"] == 0 and 0.0 <= r["eval/accuracy"] <= 1.0
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "reward/errors" in r]
    assert steps[0]["reward/errors"] == 0
