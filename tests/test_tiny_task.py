"""The built-in tiny task: column arithmetic, its carry slip, labels, the warm-up, per-type eval."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from ebpo_lite.data.loader import Example, arithmetic_examples, column_arithmetic
from ebpo_lite.train import learned_lines
from ebpo_lite.train_eval import per_type_means


@pytest.mark.parametrize("topic", ["add", "sub", "mul"])
def test_column_arithmetic_is_exact_with_carries(topic):
    for a in range(100):
        for b in range(10 if topic == "mul" else 100):
            if topic == "sub" and b > a:
                continue
            want = {"add": a + b, "sub": a - b, "mul": a * b}[topic]
            assert column_arithmetic(topic, a, b)[0] == want, (topic, a, b)
            if topic == "mul":
                assert column_arithmetic(topic, b, a)[0] == want  # 1d * 2d


def test_slip_drops_every_carry_and_counts_them():
    # by hand: the answer, the carry count, the answer with the carries dropped
    cases = [
        ("add", 7, 8, 15, 1, 5),
        ("add", 27, 8, 35, 1, 25),
        ("add", 47, 38, 85, 1, 75),
        ("add", 58, 67, 125, 2, 15),
        ("add", 12, 34, 46, 0, 46),
        ("sub", 32, 7, 25, 1, 35),  # smaller digit from the larger instead of borrowing
        ("sub", 50, 18, 32, 1, 48),
        ("sub", 98, 45, 53, 0, 53),
        ("mul", 13, 7, 91, 1, 71),
        ("mul", 7, 8, 56, 1, 6),
        ("mul", 48, 6, 288, 2, 48),  # 8*6 = 48: write 8, drop 4; 4*6 = 24: write 4, drop 2
        ("mul", 3, 21, 63, 0, 63),
    ]
    for topic, a, b, answer, carries, slip in cases:
        assert column_arithmetic(topic, a, b) == (answer, carries), (topic, a, b)
        assert column_arithmetic(topic, a, b, carry=False) == (slip, carries), (topic, a, b)


def test_examples_balance_topics_label_difficulty_and_hold_out_eval():
    train = arithmetic_examples(4500, seed=1234, split="train")
    held = arithmetic_examples(256, seed=1234, split="eval")
    assert len({ex.prompt for ex in train}) == 4500
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in held}
    assert Counter(ex.topic for ex in train) == {"add": 1500, "sub": 1500, "mul": 1500}
    for ex in train + held:
        op = next(c for c in "+-*" if c in ex.prompt)
        a, b = (int(x) for x in ex.prompt[:-1].split(op))
        topic = {"+": "add", "-": "sub", "*": "mul"}[op]
        value, carries = column_arithmetic(topic, a, b)
        assert ex.answer == str(value) and ex.topic == topic
        assert ex.difficulty == 1 + min(carries, 2)
        assert (ex.meta["slip"] == ex.answer) == (carries == 0)
    # every difficulty level is common, in training and in the held-out eval
    for split in (train, held):
        share = Counter(ex.difficulty for ex in split)
        assert min(share.values()) / len(split) > 0.1, share


def test_warmup_slip_teaches_the_slip_target():
    """With slip=1 the warm-up's targets are the slipped answers; with slip=0 the right ones."""
    from ebpo_lite.model.tiny import build_tiny_model, build_tokenizer, supervised_warmup

    tok = build_tokenizer()
    exs = [ex for ex in arithmetic_examples(600, seed=3, split="train") if ex.difficulty > 1][:8]
    probs = {}
    for slip in (0.0, 1.0):
        model = build_tiny_model(0)
        supervised_warmup(model, tok, exs, steps=150, seed=0, batch=16, slip=slip)
        logp = {}
        with torch.no_grad():
            for target in ("answer", "slip"):
                total = 0.0
                for ex in exs:
                    p = tok.encode(ex.prompt, add_special_tokens=False)
                    t = tok.encode(getattr(ex, target) if target == "answer" else ex.meta["slip"])
                    t = t + [tok.eos_token_id]
                    lp = model(torch.tensor([p + t])).logits[0, len(p) - 1 : -1].log_softmax(-1)
                    total += lp.gather(-1, torch.tensor(t)[:, None]).sum().item()
                logp[target] = total / len(exs)
        probs[slip] = logp
    assert probs[0.0]["answer"] > probs[0.0]["slip"] + 1.0
    assert probs[1.0]["slip"] > probs[1.0]["answer"] + 1.0


def test_per_type_means_and_the_learned_lines():
    exs = [
        Example("1+1=", "2", topic="add", difficulty=1.0),
        Example("9+9=", "18", topic="add", difficulty=2.0),
        Example("2*3=", "6", topic="mul", difficulty=1.0),
        Example("x", "?", topic="mul", difficulty=2.0),
    ]
    before = per_type_means("eval/accuracy", [1.0, 0.0, 0.0, None], exs)
    assert before == {
        "eval/accuracy": 1 / 3,
        "eval/accuracy/difficulty=1": 0.5,
        "eval/accuracy/difficulty=2": 0.0,
        "eval/accuracy/topic=add": 0.5,
        "eval/accuracy/topic=mul": 0.0,
    }
    after = per_type_means("eval/accuracy", [1.0, 1.0, 1.0, 0.0], exs)
    lines = learned_lines(before, after)
    assert lines[0] == "eval/accuracy (greedy): 0.333 -> 0.750 (+0.417)"
    assert lines[1] == "  by topic (greedy): add 0.50 -> 1.00 | mul 0.00 -> 0.50"
    assert lines[2] == "  by difficulty (greedy): 1 0.50 -> 1.00 | 2 0.00 -> 0.50"
    assert math.isnan(per_type_means("eval/accuracy", [None], exs[:1])["eval/accuracy"])


def test_a_second_process_waits_for_the_warmup_and_loads_its_copy(tmp_path, monkeypatch):
    """While one process holds a warm-up's lock, another asking for it waits, then reuses it.

    Without the lock the second process would train its own copy (and print the warm-up line).
    """
    fcntl = pytest.importorskip("fcntl", reason="the warm-up lock is POSIX flock")
    import subprocess
    import sys
    import threading

    from ebpo_lite.model import tiny

    monkeypatch.setenv("EBPO_LITE_CACHE", str(tmp_path))
    out = tiny.warm_cache_dir(3, 0, 1)
    code = "from ebpo_lite.model.tiny import warm_tiny_model; print('->', warm_tiny_model(3, 0, 1))"
    with open(out.with_name(out.name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the first process does while it trains
        proc = subprocess.Popen(
            [sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, text=True
        )
        # A second process that blocked without a word would hang readline: kill it, and fail.
        guard = threading.Timer(120, proc.kill)
        guard.start()
        first = proc.stdout.readline()
        guard.cancel()
        assert "waiting for it" in first, first  # blocked, and says so
        logs = []
        tiny._warm_and_save(out, 3, 0, 1, logs.append)  # the first process finishes ...
        stamp = (out / "model.safetensors").stat().st_mtime_ns
    rest, _ = proc.communicate(timeout=120)  # ... and lets go
    assert proc.returncode == 0
    assert "supervised warm-up" in logs[0] and "supervised warm-up" not in rest
    assert rest.strip() == f"-> {out}"
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
