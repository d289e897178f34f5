"""The calculator tool and the tiny model's tool warm-up (ebpo_lite/env/calculator.py,
ebpo_lite/model/tiny_tools.py): the calculator agrees with Python's integers and refuses what it
should without evaluating anything; a tool trajectory is TinyFormat's strings with the loss mask
0 exactly on the tool result; the plain warm-up's cache key is what it was; a short tool warm-up
learns."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch

from ebpo_lite.data.loader import arithmetic_examples
from ebpo_lite.env.calculator import calculator
from ebpo_lite.env.formats import TinyFormat
from ebpo_lite.model import tiny
from ebpo_lite.model.tiny_tools import (
    decode_turns,
    supervised_tool_warmup,
    tool_behaviour,
    tool_trajectory,
)


def _random_expression(rng: random.Random, depth: int = 0) -> tuple[str, int]:
    """A random expression of + - *, parentheses and unary minus, and its value computed with
    Python's integers as it is built (no text is evaluated)."""
    pick = rng.random()
    if depth >= 3 or pick < 0.35:
        n = rng.randint(0, 10 ** rng.randint(1, 4))
        return str(n), n
    if pick < 0.45:
        text, value = _random_expression(rng, depth + 1)
        return f"-({text})", -value
    if pick < 0.55:
        text, value = _random_expression(rng, depth + 1)
        return f"({text})", value
    op = rng.choice(["+", "-", "*", " + ", " * "])
    (lt, lv), (rt, rv) = _random_expression(rng, depth + 1), _random_expression(rng, depth + 1)
    if op.strip() == "*":  # parenthesise sums under a product, as the value is computed
        lt, rt = f"({lt})", f"({rt})"
        return f"{lt}{op}{rt}", lv * rv
    rt = f"({rt})"  # a - (b + c): the right operand is one value
    return f"{lt}{op}{rt}", lv + rv if op.strip() == "+" else lv - rv


def test_calculator_matches_python_integers():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        expr, value = _random_expression(rng)
        if len(expr) > 64:
            continue
        assert calculator(expr) == str(value), expr
        checked += 1
    assert checked > 300
    assert calculator("35+8") == "43"
    assert calculator("-(12-3)*4") == "-36"
    assert calculator("--5") == "5"
    assert calculator("-3*4") == "-12"
    assert calculator("2*-3+1") == "-5"
    assert calculator("2-3-4") == "-5"  # left-associative
    assert calculator("2+3*4") == "14"  # * binds tighter


@pytest.mark.parametrize(
    "expr, words",
    [
        ("__import__('os')", "unexpected '_'"),
        ("1+", "ends too early"),
        ("(1+2", "expected ')'"),
        ("1+2)", "unexpected ')'"),
        ("", "empty"),
        ("7/2", "unexpected '/'"),
        ("2**3", "unexpected '*'"),
        ("1.5", "unexpected '.'"),
        ("9" * 13, "13 digits"),
        ("1+" * 32 + "1", "too long"),
        ("999999999999*999999999999*999999999999", "too large"),
    ],
)
def test_calculator_refuses(expr, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        calculator(expr)


def test_calculator_schema():
    from transformers.utils import get_json_schema

    fn = get_json_schema(calculator)["function"]
    assert fn["name"] == "calculator"
    assert fn["parameters"]["required"] == ["expression"]
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert list(fn["parameters"]["properties"]) == ["expression"]


def test_tool_trajectory_is_the_format_with_the_tool_result_masked():
    tok = tiny.build_tokenizer()
    fmt = TinyFormat(tok, {"calculator": "expression"})
    eos = tok.eos_token_id
    for ex in arithmetic_examples(60, seed=1, split="train"):
        ids, mask = tool_trajectory(tok, ex)
        expr = ex.prompt[:-1]
        call = tok.encode(fmt.call_text("calculator", expr), add_special_tokens=False) + [eos]
        result = tok.encode(fmt.result_text(ex.answer), add_special_tokens=False)
        final = tok.encode(ex.answer, add_special_tokens=False) + [eos]
        assert ids == call + result + final
        assert mask == [1] * len(call) + [0] * len(result) + [1] * len(final)
        # the masked span decodes to exactly `>ANSWER\n`, and the format reads the call back
        masked = [t for t, m in zip(ids, mask) if m == 0]
        assert tok.decode(masked) == f">{ex.answer}\n"
        parsed = fmt.parse(ids[: len(call)])
        assert parsed.calls and parsed.calls[0].name == "calculator"
        assert parsed.calls[0].arguments == {"expression": expr}
        assert tok.decode(ids[len(call) :]) == f">{ex.answer}\n{ex.answer}<eos>"


def _plain_key(steps, seed, data_seed):
    """The cache folder of a plain warm-up as tiny.py named it before tool warm-ups existed."""
    key = json.dumps(dict(v=tiny.TINY_VERSION, steps=steps, seed=seed, data_seed=data_seed))
    return tiny.cache_root() / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def test_cache_key_unchanged_without_tools_and_distinct_with():
    for steps, seed, data_seed in [(3000, 0, 0), (100, 1, 7)]:
        plain = tiny.warm_cache_dir(steps, seed, data_seed)
        assert plain == _plain_key(steps, seed, data_seed)
        assert tiny.warm_cache_dir(steps, seed, data_seed, tool_share=0.0) == plain
        with_tools = {tiny.warm_cache_dir(steps, seed, data_seed, tool_share=s) for s in (0.2, 0.3)}
        assert plain not in with_tools and len(with_tools) == 2


def test_tool_share_zero_is_the_plain_warmup():
    tok = tiny.build_tokenizer()
    train = arithmetic_examples(300, seed=0, split="train")
    a, b = tiny.build_tiny_model(3), tiny.build_tiny_model(3)
    tiny.supervised_warmup(a, tok, train, steps=5, seed=2, batch=16, slip=0.5)
    supervised_tool_warmup(b, tok, train, steps=5, seed=2, slip=0.5, tool_share=0.0, batch=16)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_short_tool_warmup_learns_the_format():
    torch.manual_seed(0)
    tok = tiny.build_tokenizer()
    train = arithmetic_examples(600, seed=0, split="train")
    model = tiny.build_tiny_model(0)
    losses = []

    def loss_now() -> float:
        """Masked CE of a fixed batch of tool trajectories."""
        from ebpo_lite.model.tiny import pack_masked

        rows = []
        for ex in train[:32]:
            rows.append(
                (tok.encode(ex.prompt, add_special_tokens=False), *tool_trajectory(tok, ex))
            )
        ids, labels, attn = pack_masked(rows, tok.pad_token_id)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        ).item()

    losses.append(loss_now())
    acc = supervised_tool_warmup(
        model, tok, train, steps=150, seed=0, slip=0.5, tool_share=0.5, batch=32
    )
    losses.append(loss_now())
    assert losses[1] < 0.5 * losses[0], losses
    assert 0.0 < acc <= 1.0
    # sampled first turns: some calls and some direct answers (the coin is learned, not a rule)
    prompts = [tok.encode(ex.prompt, add_special_tokens=False) for ex in train[:64]]
    turns = decode_turns(model, tok, prompts, temperature=1.0, seed=0)
    starts = {tok.decode(t[:1]) == "[" for t in turns}
    assert starts == {True, False}
    stats = tool_behaviour(model, tok, train[:32])
    assert stats[0]["n"] == 32 and 0.0 <= stats[0]["call"] <= 1.0
    assert sum(stats[k]["n"] for k in stats if k) == 32
