"""Chat models' tool-call format, read through the model's own chat template (TRL 1.16's contract).

- `ChatFormat(tokenizer, tools)`: the `formats.ToolFormat` of a chat model.
  `parse(turn_ids)` reads one model turn with, in this order of preference:
  1. the tokenizer's own response parser (`tokenizer.parse_response`), where transformers has one
     for it: a `response_template` (transformers >= 5.13, given the generation prompt as
     `prefix=` and, from 5.15, the tool schemas as `tools=`) or a legacy `response_schema`
     (older transformers; TRL's `add_response_schema` sets either);
  2. else the form the chat template writes a call in (a dummy call conversation is rendered
     and looked at): Hermes / Qwen's `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
     (several per turn; the text around them is content), or Llama 3.1's bare JSON
     `{"name": ..., "parameters": {...}}` as the whole turn. A template that does not write tool
     calls at all (plain ChatML: SmolLM2) gets the Hermes form, which `prompt_text` teaches it.
  A malformed call (bad JSON, no name, arguments that are not an object, an unclosed tag, or a
  turn the tokenizer's parser rejects) is `ParsedTurn(problem=...)`. Model output only ever goes
  through `json.loads`.
  `tool_ids(results)`: TRL's `GRPOTrainer._get_tool_suffix_ids`: the template's rendering of a
  dummy conversation (user, then an assistant turn calling the first result's tool) with and
  without the tool messages (the longer one with the generation prompt), the shorter cut after
  its last end-of-turn id; the difference is the answer, checked to extend that prefix. Where it
  does not (a template that is not prefix-preserving: Qwen3's renders an empty think block into
  the LAST assistant turn only), the answer is what follows the call turn's end-of-turn id in
  the full rendering. TRL instead swaps in its own prefix-preserving training template
  (`get_training_chat_template`), whose answer tokens are the same (tests/test_env_trl.py).
- `supports_tools(tokenizer)`: None when the template renders a whole tool conversation
  (user -> assistant with tool_calls -> tool, name, arguments and result all visible, as TRL's
  `supports_tool_calling` checks) in a form `ChatFormat` can read; else a one-line reason.
- `prompt_text(tokenizer, messages, tools, thinking)`: the first prompt, with the tools shown.

Departure from TRL: a call TRL's `parse_response` cannot read falls back there to plain content (the
episode ends); here it is a `problem`, which the model is answered about (the episode goes on).
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from ebpo_lite.env.formats import ParsedTurn, ToolCall

_NAME, _KEY, _VALUE, _RESULT = (
    "tool_name_e1b7",
    "tool_arg_key_42c9",
    "tool_arg_val_9d03",
    "tool_result_5fa8",
)
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_RENDERED = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"' + _NAME)
_LLAMA_RENDERED = re.compile(r'\{\s*"name"\s*:\s*"' + _NAME + r'"\s*,\s*"parameters"\s*:')
_LLAMA_CALL = re.compile(r'\{\s*"name"\s*:')
_PYTHON_TAG = "<|python_tag|>"

HERMES_TOOLS_TEXT = (
    "# Tools\n\nYou can call the functions whose JSON signatures are listed inside <tools></tools>:"
    "\n<tools>\n{tools}\n</tools>\n\nTo call one, write a JSON object with the function's name "
    "and its arguments inside <tool_call></tool_call> tags (one block for each call):\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
    "</tool_call>"
)


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return [int(i) for i in out]


def _sentinel_conversation(arguments: Any) -> list[dict]:
    call = {"type": "function", "function": {"name": _NAME, "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": _NAME, "content": _RESULT},
    ]


def _rendered_tool_conversation(tokenizer) -> str:
    """The sentinel conversation rendered (arguments as a dict, else as a JSON string for the
    templates that reject a dict, as TRL does); raises the template's error."""
    try:
        return _render(tokenizer, _sentinel_conversation({_KEY: _VALUE}))
    except TypeError:
        return _render(tokenizer, _sentinel_conversation(json.dumps({_KEY: _VALUE})))


def _parser_kind(tokenizer) -> str | None:
    """'template' (new-style `response_template`, `parse_response(ids, prefix=...)`), 'schema'
    (the legacy `response_schema`), or None: which response parser this tokenizer runs."""
    method = getattr(tokenizer, "parse_response", None)
    if method is None:
        return None
    new_api = "prefix" in inspect.signature(method).parameters
    if new_api and getattr(tokenizer, "response_template", None) is not None:
        return "template"
    if not new_api and getattr(tokenizer, "response_schema", None) is not None:
        return "schema"
    return None


def call_style(tokenizer) -> str | None:
    """How `ChatFormat.parse` reads this tokenizer's calls: 'parser' (its own response parser),
    'hermes', 'llama', or None (the template writes calls in a form we cannot read)."""
    if _parser_kind(tokenizer) is not None:
        return "parser"
    try:
        rendered = _rendered_tool_conversation(tokenizer)
    except Exception:  # a template that cannot render a call: nothing to learn the form from
        return "hermes"
    if _HERMES_RENDERED.search(rendered):
        return "hermes"
    if _LLAMA_RENDERED.search(rendered):
        return "llama"
    return "hermes" if _NAME not in rendered else None


def supports_tools(tokenizer, renders_calls: bool = True) -> str | None:
    """None when the chat template renders a whole tool conversation that `ChatFormat` can read;
    else a one-line reason (the caller words it as a ConfigError). `renders_calls=False`: a
    template that drops the assistant's tool_calls is enough (plain ChatML, SmolLM2's): the
    trainer never re-renders the history, so the model's own call tokens stand."""
    if not getattr(tokenizer, "chat_template", None):
        return "the tokenizer has no chat template"
    try:
        rendered = _rendered_tool_conversation(tokenizer)
    except Exception as e:  # jinja's TemplateError, or a template's own raise_exception
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"its chat template cannot render a tool conversation ({first})"
    dropped = _NAME not in rendered or _KEY not in rendered or _VALUE not in rendered
    if dropped and renders_calls:
        return "its chat template drops the assistant's tool_calls (they are never rendered)"
    if _RESULT not in rendered:
        return "its chat template drops tool messages (the result is never rendered)"
    if call_style(tokenizer) is None:
        return (
            "its chat template writes tool calls in a form ebpo_lite cannot read (neither "
            "<tool_call> JSON nor Llama 3.1's JSON) and the tokenizer has no response parser"
        )
    return None


def renders_tools(tokenizer) -> bool:
    """Whether the chat template shows the `tools=` it is given (plain ChatML ignores them)."""
    schema = {
        "type": "function",
        "function": {"name": _NAME, "description": "d", "parameters": {"type": "object"}},
    }
    try:
        return _NAME in _render(tokenizer, [{"role": "user", "content": "hi"}], tools=[schema])
    except Exception:
        return False


def prompt_text(
    tokenizer, messages: list[dict], tools: list[dict], thinking: bool | None = None
) -> str:
    """The first prompt: `messages` through the chat template with `tools=` and the generation
    prompt (`enable_thinking=thinking` unless None).

    A template that ignores `tools=` (`renders_tools` is False: plain ChatML, SmolLM2's) is given
    the schemas in the system message instead, Hermes style (`HERMES_TOOLS_TEXT`: the JSON
    signatures inside <tools></tools>, and how to write a <tool_call>), appended to the
    conversation's own system message or as a first one (which replaces a template's default
    system turn, such as SmolLM2's)."""
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    if not tools:
        return _render(tokenizer, messages, **kwargs)
    if renders_tools(tokenizer):
        return _render(tokenizer, messages, tools=tools, **kwargs)
    described = HERMES_TOOLS_TEXT.format(tools="\n".join(json.dumps(t) for t in tools))
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{described}"
    else:
        messages.insert(0, {"role": "system", "content": described})
    return _render(tokenizer, messages, **kwargs)


def _call(raw: Any) -> ToolCall | str:
    """A decoded call object -> ToolCall, or the problem with it."""
    if not isinstance(raw, dict):
        return "a tool call must be a JSON object"
    if isinstance(raw.get("function"), dict):  # {"type": "function", "function": {...}}
        raw = raw["function"]
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        return 'a tool call needs a "name" (a string)'
    args = raw.get("arguments", raw.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):  # some parsers keep the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError as e:
            return f"the arguments of {name} are not valid JSON ({e})"
    if not isinstance(args, dict):
        return f"the arguments of {name} must be a JSON object"
    return ToolCall(name, args)


def _turn(raws: list[Any], text: str) -> ParsedTurn:
    calls = []
    for raw in raws:
        call = _call(raw)
        if isinstance(call, str):
            return ParsedTurn(problem=call, text=text)
        calls.append(call)
    return ParsedTurn(calls, text=text)


def parse_hermes(text: str) -> ParsedTurn:
    """Every `<tool_call>JSON</tool_call>` block of a turn, in order."""
    if "<tool_call>" not in text:
        return ParsedTurn(text=text)
    if text.count("<tool_call>") != len(_HERMES_BLOCK.findall(text)):
        return ParsedTurn(problem="a <tool_call> is not closed by </tool_call>", text=text)
    raws = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            raws.append(json.loads(block))
        except ValueError as e:
            return ParsedTurn(problem=f"a <tool_call> does not hold valid JSON ({e})", text=text)
    return _turn(raws, text)


def parse_llama(text: str) -> ParsedTurn:
    """A whole turn that is one JSON object starting with "name" is a call."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not _LLAMA_CALL.match(body):
        return ParsedTurn(text=text)
    try:
        raw = json.loads(body)
    except ValueError as e:
        return ParsedTurn(problem=f"the tool call is not valid JSON ({e})", text=text)
    return _turn([raw], text)


class ChatFormat:
    """A chat model's `formats.ToolFormat` (module docstring). `tools`: the JSON schemas
    (transformers' `get_json_schema`); `thinking`: `enable_thinking` for the template (None:
    not passed); `stop_ids`: end-of-turn ids besides the tokenizer's eos (the cut of
    `tool_ids`' prefix, and the ids dropped from a turn's end before it is read)."""

    def __init__(
        self,
        tokenizer,
        tools: list[dict],
        thinking: bool | None = None,
        stop_ids: tuple[int, ...] = (),
    ):
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.template_kwargs = {} if thinking is None else {"enable_thinking": thinking}
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = frozenset([*stop_ids, *([eos] if eos is not None else [])])
        self.style = call_style(tokenizer)
        if self.style is None:
            raise ValueError(supports_tools(tokenizer))
        self._prefixes: dict[str, list[int]] = {}
        user = [{"role": "user", "content": "hi"}]
        bare = _ids(tokenizer, user, **self.template_kwargs)
        asked = _ids(tokenizer, user, add_generation_prompt=True, **self.template_kwargs)
        # what the template pre-writes of the model's turn (`<|im_start|>assistant\n`, ...)
        self.generation_prompt = asked[len(bare) :] if asked[: len(bare)] == bare else []

    def _text(self, turn_ids: list[int]) -> str:
        ids = list(turn_ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def parse(self, turn_ids: list[int]) -> ParsedTurn:
        text = self._text(turn_ids)
        if self.style == "hermes":
            return parse_hermes(text)
        if self.style == "llama":
            return parse_llama(text)
        try:
            parsed = self._parse_response(list(turn_ids))
        except (ValueError, TypeError, KeyError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return ParsedTurn(problem=f"the tool call could not be read ({first})", text=text)
        raws = (parsed or {}).get("tool_calls") or []
        if not isinstance(raws, list):
            return ParsedTurn(problem="the tool calls could not be read", text=text)
        return _turn(raws, text)

    def _parse_response(self, ids: list[int]) -> dict:
        tok = self.tokenizer
        if _parser_kind(tok) == "schema":
            return tok.parse_response(ids)
        if "tools" in inspect.signature(tok.parse_response).parameters:  # transformers >= 5.15
            return tok.parse_response(ids, prefix=self.generation_prompt, tools=self.tools or None)
        return tok.parse_response(ids, prefix=self.generation_prompt)

    def _prefix(self, name: str) -> list[int]:
        """The dummy conversation up to the end of the assistant's call turn (cut after its last
        end-of-turn id); it depends only on the tool's name (GPT-OSS writes it in the header)."""
        if name not in self._prefixes:
            self._prefixes[name] = self._cut(
                _ids(self.tokenizer, self._dummy(name), **self.template_kwargs)
            )
        return self._prefixes[name]

    @staticmethod
    def _dummy(name: str) -> list[dict]:
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        return [
            {"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]

    def tool_ids(self, results: list[tuple[str, str]]) -> list[int]:
        if not results:
            raise ValueError("tool_ids: no results to write")
        name = results[0][0]
        prefix = self._prefix(name)
        tool_messages = [{"role": "tool", "name": n, "content": str(t)} for n, t in results]
        full = _ids(
            self.tokenizer,
            self._dummy(name) + tool_messages,
            add_generation_prompt=True,
            **self.template_kwargs,
        )
        if full[: len(prefix)] == prefix:
            return full[len(prefix) :]
        # Not prefix-preserving: the call turn renders differently once an answer follows
        # (Qwen3's writes an empty think block into the last assistant turn only). What follows
        # that turn's end-of-turn id in the full rendering is the answer.
        head = self._cut(_ids(self.tokenizer, self._dummy(name)[:1], **self.template_kwargs))
        ends = [i for i in range(len(head), len(full)) if full[i] in self.stop_ids]
        if full[: len(head)] == head and ends:
            return full[ends[0] + 1 :]
        raise ValueError(
            "the chat template's rendering with the tool messages does not extend the one "
            "without them (cut after the last end-of-turn token): tool results cannot be "
            "appended as tokens"
        )

    def _cut(self, ids: list[int]) -> list[int]:
        """`ids` up to its last end-of-turn id (all of it when there is none)."""
        ends = [i for i, t in enumerate(ids) if t in self.stop_ids]
        return ids[: ends[-1] + 1] if ends else ids
