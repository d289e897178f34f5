"""The tiny model's supervised warm-up for the calculator task, and a decode to measure it.

The multi-turn recipe (recipes/tiny_tools_cpu.yaml) asks RL to learn WHEN to call the
calculator. For that the warmed model must already know HOW (the tag format of
`env.formats.TinyFormat`) and call it sometimes, but not know when it pays. So the warm-up of
`warmup.supervised_warmup` (the same teacher-forced cross-entropy, optimizer, schedule and carry
slip) gets one more coin: with probability `tool_share`, independent of the problem and of its
difficulty, the target is the tool trajectory instead of a direct answer:

    35+8=[calculator(35+8)]<eos>>43
    43<eos>
         ^^^^^^^^^^^^^^^^^^^^^^      the call turn: trained (mask 1)
                               ^^^^  the tool result `>43\\n`: written by the environment (mask 0)
                                   ^^^^^^ the final answer: trained (mask 1)

The loss mask is exactly the tool mask the RL trainer uses, and the result is the calculator's
(always correct). The warmed model calls the tool on about `tool_share` of problems whatever
their difficulty and answers the rest itself, slips included; RL has to learn that a call pays
on carry problems. `decode_turns` and `tool_behaviour` measure that starting point.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ebpo_lite.env.calculator import calculator
from ebpo_lite.env.formats import TinyFormat
from ebpo_lite.model.warmup import supervised_warmup

TOOL_WARMUP_VERSION = 1  # part of a tool warm-up's cache key: bump when this recipe changes
TOOL = "calculator"


def tiny_format(tokenizer) -> TinyFormat:
    """The tag format with the calculator as its one tool (its first parameter for `[calc(x)]`)."""
    first = next(iter(inspect.signature(calculator).parameters))
    return TinyFormat(tokenizer, {TOOL: first})


def expression_of(example) -> str:
    """`35+8=` -> `35+8`: the arithmetic task's prompt without its `=`."""
    if not example.prompt.endswith("="):
        raise ValueError(f"not an arithmetic prompt (no trailing '='): {example.prompt!r}")
    return example.prompt[:-1]


def tool_trajectory(tokenizer, example) -> tuple[list[int], list[int]]:
    """(ids after the prompt, loss mask) of the call turn, the tool result and the final answer.

    The mask is 1 on the model's tokens (the call turn and the final answer, each with its
    `<eos>`) and 0 on the tool result `>RESULT\\n`, which the environment writes."""
    fmt, eos = tiny_format(tokenizer), tokenizer.eos_token_id
    expr = expression_of(example)
    result = calculator(expr)
    call = tokenizer.encode(fmt.call_text(TOOL, expr), add_special_tokens=False) + [eos]
    tool = fmt.tool_ids([(TOOL, result)])
    final = tokenizer.encode(result, add_special_tokens=False) + [eos]
    return call + tool + final, [1] * len(call) + [0] * len(tool) + [1] * len(final)


def supervised_tool_warmup(
    model,
    tokenizer,
    examples,
    steps: int,
    seed: int,
    slip: float,
    tool_share: float = 0.3,
    on_step: Callable[[int], None] | None = None,
    batch: int = 64,
    lr: float = 3e-3,
) -> float:
    """`warmup.supervised_warmup` with tool trajectories (module docstring); returns the last
    batch's token accuracy on the trained tokens.

    Each draw is a tool trajectory with probability `tool_share`, else a direct answer, which is
    the slip (`meta["slip"]`) with probability `slip`. With `tool_share == 0` no coin is drawn
    for it, so the run is `supervised_warmup`'s step for step."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be in [0, 1], got {tool_share}")
    tools = [tool_trajectory(tokenizer, ex) for ex in examples] if tool_share > 0 else None
    return supervised_warmup(
        model, tokenizer, examples, steps, seed, batch, lr, slip, on_step, tools, tool_share
    )


@torch.no_grad()
def decode_turns(
    model,
    tokenizer,
    prefixes: list[list[int]],
    max_new: int = 24,
    temperature: float = 0.0,
    seed: int = 0,
    banned_first: list[int] | None = None,
) -> list[list[int]]:
    """One turn per prefix: greedy (`temperature == 0`) or sampled, up to and including `<eos>`
    (or `max_new` tokens). No KV cache: each step runs the whole left-padded batch, which for the
    tiny model is fast and leaves nothing to get wrong. `banned_first`: ids the first token may
    not be (`[`'s id forces a direct answer)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    width = max(len(p) for p in prefixes)
    ids = torch.full((len(prefixes), width), pad, dtype=torch.long)  # [B, P]
    attn = torch.zeros_like(ids)  # [B, P]
    for i, p in enumerate(prefixes):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    gen = torch.Generator().manual_seed(seed)
    done = torch.zeros(len(prefixes), dtype=torch.bool)  # [B]
    out: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    for step in range(max_new):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P + t]
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1]  # [B, V]
        logits = logits.float()
        if step == 0 and banned_first:
            logits[:, banned_first] = float("-inf")
        if temperature == 0:
            nxt = logits.argmax(-1)  # [B]
        else:
            probs = torch.softmax(logits / temperature, dim=-1)  # [B, V]
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)  # [B]
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        out.append(nxt)
        done |= nxt == eos
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        attn = torch.cat([attn, (~done | (nxt == eos)).long()[:, None]], dim=1)
    model.train(was_training)
    turns = []
    for row in torch.stack(out, dim=1).tolist():  # [B, T]
        turns.append(row[: row.index(eos) + 1] if eos in row else row)
    return turns


def tool_behaviour(
    model, tokenizer, examples, temperature: float = 0.0, seed: int = 0
) -> dict[int, dict[str, float]]:
    """The warmed model's first move and its outcome, per difficulty level (and `0`: all).

    Per level: `n`; `call` share whose first turn is a call (any turn the format reads as one);
    `call_exact` share of calls that are exactly `[calculator(PROBLEM)]`; `after_call` accuracy
    of the final answer after a call, given the calculator's (correct) result of the call's
    argument (a call the calculator refuses counts as wrong); `direct` accuracy of the first
    turns that answer directly; `forced_direct` accuracy when the first token may not be `[`
    (the model answering on its own); `episode` the share of whole episodes rewarded."""
    fmt = tiny_format(tokenizer)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc(ex.prompt) for ex in examples]
    first = decode_turns(model, tokenizer, prompts, temperature=temperature, seed=seed)
    forced = decode_turns(model, tokenizer, prompts, banned_first=enc("["))
    parsed = [fmt.parse(t) for t in first]
    calls = [i for i, p in enumerate(parsed) if p.wants_tools]
    results: dict[int, str | None] = {}
    for i in calls:
        p = parsed[i]
        try:
            ok = p.calls and p.calls[0].name == TOOL and len(p.calls[0].arguments) == 1
            results[i] = calculator(next(iter(p.calls[0].arguments.values()))) if ok else None
        except ValueError:
            results[i] = None
    asked = [i for i in calls if results[i] is not None]
    finals = decode_turns(
        model,
        tokenizer,
        [prompts[i] + first[i] + fmt.tool_ids([(TOOL, results[i])]) for i in asked] or [[0]],
        temperature=temperature,
        seed=seed + 1,
    )
    final_text = {i: tokenizer.decode(f, skip_special_tokens=True) for i, f in zip(asked, finals)}
    said = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    rows = []
    for i, ex in enumerate(examples):
        is_call = i in results
        right_call = is_call and said(first[i]) == fmt.call_text(TOOL, expression_of(ex))
        after = final_text.get(i, "").strip() == ex.answer if is_call else None
        direct = None if is_call else said(first[i]) == ex.answer
        rows.append(
            (
                int(ex.difficulty or 0),
                is_call,
                right_call,
                after,
                direct,
                said(forced[i]) == ex.answer,
            )
        )
    return {lvl: _summary([r for r in rows if lvl in (0, r[0])]) for lvl in _levels(rows)}


def _levels(rows) -> list[int]:
    return [0] + sorted({r[0] for r in rows})


def _summary(rows) -> dict[str, float]:
    def mean(xs) -> float:
        xs = [float(x) for x in xs]
        return sum(xs) / len(xs) if xs else float("nan")

    calls = [r for r in rows if r[1]]
    directs = [r for r in rows if not r[1]]
    return dict(
        n=float(len(rows)),
        call=mean(r[1] for r in rows),
        call_exact=mean(r[2] for r in calls),
        after_call=mean(r[3] for r in calls),
        direct=mean(r[4] for r in directs),
        forced_direct=mean(r[5] for r in rows),
        episode=mean(r[3] if r[1] else r[4] for r in rows),
    )
