"""ebpo_lite's ChatFormat (ebpo_lite/env/chat.py) against TRL 1.16 itself, on TRL's own chat
templates (read from the installed trl's `chat_templates/` folder) and a tokenizer built here.

- whether a template can hold a tool conversation: `supports_tools` vs TRL's
  `supports_tool_calling`, on every template TRL ships;
- parsing: the calls TRL's `parse_response` (after `add_response_schema`) reads from a turn, and
  ChatFormat's, both through the tokenizer's parser and through our own Hermes / Llama parser;
- the answer tokens: `ChatFormat.tool_ids` vs `GRPOTrainer._get_tool_suffix_ids`, run as an
  unbound function on the attributes it reads, with the chat template GRPOTrainer's `__init__`
  would choose (its prefix-preserving training template where the original is not).

Needs trl (CI tier `.ci/tier_integrations.sh`) and jmespath (TRL's response schemas use it);
skipped where they are not installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.trl
trl = pytest.importorskip("trl")

from tokenizers import AddedToken, Regex, pre_tokenizers  # noqa: E402

from ebpo_lite.env import chat  # noqa: E402
from ebpo_lite.env.chat import ChatFormat  # noqa: E402
from ebpo_lite.env.formats import ToolCall  # noqa: E402
from ebpo_lite.model.tiny import build_tokenizer  # noqa: E402
from tests.test_env_chat import TOOLS  # noqa: E402 (the same two tools, add and weather)

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
CHATML = ("<|im_start|>", "<|im_end|>")
LLAMA = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)


CALLS = [ToolCall("add", {"a": 35, "b": 8}), ToolCall("weather", {"city": "Paris"})]


def tokenizer(name: str):
    """The tiny character tokenizer (every character a token, newlines too) with the template's
    control tokens added as special tokens, and TRL's template `name`."""
    llama = name.startswith("llama")
    tok = build_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    specials = LLAMA if llama else CHATML
    tok.add_tokens([AddedToken(t, special=True) for t in specials], special_tokens=True)
    tok.eos_token = "<|eot_id|>" if llama else "<|im_end|>"
    if llama:
        tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = (TEMPLATES / name).read_text()
    return tok


def with_schema(tok):
    from trl.chat_template_utils import add_response_schema

    pytest.importorskip("jmespath", reason="TRL's response schemas need jmespath")
    return add_response_schema(copy.deepcopy(tok))


def assistant(calls: list[ToolCall]) -> dict:
    fns = [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]
    return {"role": "assistant", "content": "", "tool_calls": fns}


def model_turn(tok, calls: list[ToolCall]) -> list[int]:
    """The ids a model writes for `calls` in this template's own form: the rendering of the
    conversation with the call turn, past the prompt's generation prompt."""
    user = [{"role": "user", "content": "35+8? And the weather in Paris?"}]
    kw = {"tools": TOOLS, "return_dict": False}
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, **kw)
    full = tok.apply_chat_template([*user, assistant(calls)], **kw)
    assert full[: len(prompt)] == prompt
    return full[len(prompt) :]


def test_supports_tools_agrees_with_trl_on_every_bundled_template():
    from trl.chat_template_utils import supports_tool_calling

    names = sorted(p.name for p in TEMPLATES.glob("*.jinja"))
    assert len(names) > 20
    for name in names:
        tok = tokenizer(name)
        reason = chat.supports_tools(tok)
        # ours says no also where TRL says yes but we have no parser for the call form (XML,
        # GPT-OSS channels, ...): those are read once the tokenizer has a response parser
        readable_but_unparsed = reason is not None and "cannot read" in reason
        assert supports_tool_calling(tok) == (reason is None or readable_but_unparsed), name
        if readable_but_unparsed and name in (
            "qwen3_5_think.jinja",
            "gptoss.jinja",
        ):  # TRL has schemas
            assert chat.supports_tools(with_schema(tok)) is None, name


@pytest.mark.parametrize(
    "name, calls",
    [
        ("qwen3.jinja", CALLS[:1]),
        ("qwen3.jinja", CALLS),
        ("qwen2_5.jinja", CALLS),
        ("qwen3_instruct_2507.jinja", CALLS),
        ("llama3_1.jinja", CALLS[:1]),  # Llama 3.1 writes one call per turn
        ("qwen3_5_think.jinja", CALLS),  # XML calls: only the tokenizer's parser reads them
    ],
)
def test_ebpo_lite_and_trl_read_the_same_calls(name, calls):
    from trl.chat_template_utils import parse_response

    plain = tokenizer(name)
    parsing = with_schema(plain)
    ids = model_turn(plain, calls)
    trl_calls = [
        ToolCall(c["function"]["name"], c["function"]["arguments"])
        for c in parse_response(parsing, ids).get("tool_calls") or []
    ]
    assert trl_calls == calls  # TRL reads back what the template wrote
    ours = ChatFormat(parsing, TOOLS)
    assert ours.style == "parser" and ours.parse(ids).calls == trl_calls
    if chat.call_style(plain) is not None:  # our own parser, without the tokenizer's
        assert ChatFormat(plain, TOOLS).style in ("hermes", "llama")
        assert ChatFormat(plain, TOOLS).parse(ids).calls == trl_calls


@pytest.mark.parametrize("name", ["qwen3.jinja", "llama3_1.jinja"])
def test_a_plain_answer_has_no_calls_for_either(name):
    from trl.chat_template_utils import parse_response

    plain = tokenizer(name)
    parsing = with_schema(plain)
    ids = plain.encode("The answer is 43." + plain.eos_token, add_special_tokens=False)
    assert not parse_response(parsing, ids).get("tool_calls")
    for tok in (plain, parsing):
        turn = ChatFormat(tok, TOOLS).parse(ids)
        assert turn.calls == [] and turn.problem is None and turn.text == "The answer is 43."


def test_malformed_json_ends_trls_episode_but_is_a_problem_here():
    from trl.chat_template_utils import parse_response

    plain = tokenizer("qwen3.jinja")
    parsing = with_schema(plain)
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 35,}}\n</tool_call><|im_end|>'
    ids = plain.encode(text, add_special_tokens=False)
    assert not parse_response(parsing, ids).get("tool_calls")  # TRL: plain content
    for tok in (plain, parsing):
        assert ChatFormat(tok, TOOLS).parse(ids).problem  # here: the model is told


def trl_suffix(tok, results, template_kwargs) -> list[int]:
    """GRPOTrainer._get_tool_suffix_ids with the chat template its __init__ picks."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import get_training_chat_template
    from trl.chat_template_utils import is_chat_template_prefix_preserving as preserving

    trainer = SimpleNamespace(
        processing_class=tok,
        _tokenizer=tok,
        _is_vlm=False,
        chat_template=None if preserving(tok) else get_training_chat_template(tok),
        chat_template_kwargs=template_kwargs,
    )
    messages = [{"role": "tool", "name": n, "content": r} for n, r in results]
    return GRPOTrainer._get_tool_suffix_ids(trainer, messages)


@pytest.mark.parametrize("thinking", [None, False])
@pytest.mark.parametrize(
    "name",
    ["qwen3.jinja", "qwen3_training.jinja", "qwen2_5.jinja", "qwen3_instruct_2507.jinja"],
)
def test_tool_ids_are_trls_tool_suffix(name, thinking):
    from trl.chat_template_utils import is_chat_template_prefix_preserving

    tok = tokenizer(name)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    results = [("add", "43"), ("weather", "rain, 12 C")]
    fmt = ChatFormat(tok, TOOLS, thinking=thinking)
    ours = fmt.tool_ids(results)
    assert ours == trl_suffix(tok, results, kwargs)
    assert fmt.tool_ids(results[:1]) == trl_suffix(tok, results[:1], kwargs)
    assert tok.unk_token_id not in ours and "rain, 12 C" in tok.decode(ours)
    if name == "qwen3.jinja":  # not prefix-preserving: TRL swaps in its training template
        assert not is_chat_template_prefix_preserving(tok)


def test_llama_tool_ids_are_trls_tool_suffix():
    tok = tokenizer("llama3_1.jinja")
    ours = ChatFormat(tok, TOOLS).tool_ids([("add", "43")])
    assert ours == trl_suffix(tok, [("add", "43")], {})
    assert tok.decode(ours).startswith("<|start_header_id|>ipython<|end_header_id|>")
