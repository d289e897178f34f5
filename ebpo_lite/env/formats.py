"""How a model's turn is read for tool calls and how tool results become tokens.

A format has two methods: `parse(turn_ids)` -> `ParsedTurn` (the calls of one model turn, or
the problem with a malformed one) and `tool_ids(results)` -> the token ids that answer one turn's
calls (the tool messages, and whatever the format puts before the model's next turn). The loop
(`engine/episodes.py`) appends those ids to the episode's tokens as they are: the history is never
re-tokenised, so the trainer scores exactly the tokens the sampler saw.

`TinyFormat`, the built-in tiny model's tag format (no chat template, a character tokenizer):

    35+8=[calculator(35+8)]<eos>>43
    43<eos>

- a call is a whole model turn `[NAME(ARGS)]` ended by the stop id (`<eos>`), one call per turn;
  ARGS is a JSON object of keyword arguments (`[add({"a": 1, "b": 2})]`), or else the raw text
  of the tool's first parameter (`[calculator(35+8)]` is `calculator(expression="35+8")`);
- the result is `>` + the result text + a newline, written by the environment (tool mask 0);
- any other turn is the final answer (the episode ends). A turn that starts with `[` and ends
  with `]` but does not parse is malformed: answered with an error, the episode goes on.
Chat models' formats (Qwen3's `<tool_call>` JSON, ...) live in `chat.py`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

RESULT_PREFIX, RESULT_SUFFIX = ">", "\n"
_TINY_CALL = re.compile(r"\[([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\]", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """One model turn: its calls (empty: a final answer), or `problem` (a malformed call, which
    the model is answered about), and the turn's text."""

    calls: list[ToolCall] = field(default_factory=list)
    problem: str | None = None
    text: str = ""

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls) or self.problem is not None


class ToolFormat(Protocol):
    def parse(self, turn_ids: list[int]) -> ParsedTurn: ...

    def tool_ids(self, results: list[tuple[str, str]]) -> list[int]:
        """Token ids answering one turn's calls: `results` is [(tool name, result text)]."""
        ...


class TinyFormat:
    """The tiny model's tag format (module docstring). `first_params`: each tool's first
    parameter name, for the raw-text argument form."""

    def __init__(self, tokenizer, first_params: dict[str, str | None]):
        self.tokenizer = tokenizer
        self.first_params = dict(first_params)

    def call_text(self, name: str, argument: str) -> str:
        """The text of a call with a raw-text argument (the warm-up writes these)."""
        return f"[{name}({argument})]"

    @staticmethod
    def result_text(text: str) -> str:
        return f"{RESULT_PREFIX}{text}{RESULT_SUFFIX}"

    def parse(self, turn_ids: list[int]) -> ParsedTurn:
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True).strip()
        if not (text.startswith("[") and text.endswith("]")):
            return ParsedTurn(text=text)
        m = _TINY_CALL.fullmatch(text)
        if m is None:
            return ParsedTurn(problem="a call is written [name(arguments)]", text=text)
        name, raw = m.group(1), m.group(2)
        if raw.lstrip().startswith("{"):
            try:
                args = json.loads(raw)
            except ValueError as e:
                return ParsedTurn(problem=f"the arguments are not valid JSON ({e})", text=text)
            if not isinstance(args, dict):
                return ParsedTurn(problem="the arguments must be a JSON object", text=text)
            return ParsedTurn([ToolCall(name, args)], text=text)
        first = self.first_params.get(name)
        if first is None:  # an unknown tool, or one without parameters: the host answers
            return ParsedTurn([ToolCall(name, {} if not raw else {"": raw})], text=text)
        return ParsedTurn([ToolCall(name, {first: raw})], text=text)

    def tool_ids(self, results: list[tuple[str, str]]) -> list[int]:
        text = "".join(self.result_text(r) for _, r in results)
        return self.tokenizer.encode(text, add_special_tokens=False)
