"""Prompt truncation to `data.max_prompt_tokens` cuts the question, never the chat template."""

from __future__ import annotations

import pytest

from ebpo_lite.config import DataConfig
from ebpo_lite.data.loader import Example, encode_prompt, encode_prompts
from ebpo_lite.errors import ConfigError
from ebpo_lite.model.tiny import build_tokenizer
from tests.test_mathdata import TINY_TEMPLATE

HEAD, TAIL = "<system>Box it.\n<user>", "\n<assistant>"  # thinking on: no empty think block


def _tok():
    tok = build_tokenizer()  # one token per character (but "\n\n" is one unknown token)
    tok.chat_template = TINY_TEMPLATE
    return tok


def test_long_prompt_loses_the_front_of_the_question_not_the_template_header():
    tok = _tok()
    cfg = DataConfig(name="gsm8k", system_prompt="Box it.", thinking=True, max_prompt_tokens=60)
    question = "A long story about apples. " * 4 + "What is 1+1?"
    ids = encode_prompt(tok, Example(prompt=question, answer="2"), cfg)
    text = tok.decode(ids)
    assert len(ids) == 60
    assert text.startswith(HEAD) and text.endswith("What is 1+1?" + TAIL)
    assert text == HEAD + question[-(60 - len(HEAD) - len(TAIL)) :] + TAIL
    # short prompts are untouched, and truncate=False keeps everything
    short = Example(prompt="What is 1+1?", answer="2")
    assert tok.decode(encode_prompt(tok, short, cfg)) == HEAD + "What is 1+1?" + TAIL
    full = encode_prompt(tok, Example(prompt=question, answer="2"), cfg, truncate=False)
    assert tok.decode(full) == HEAD + question + TAIL


def test_encode_prompts_says_once_how_many_were_truncated():
    tok, lines = _tok(), []
    cfg = DataConfig(name="gsm8k", system_prompt="Box it.", thinking=True, max_prompt_tokens=60)
    exs = [Example(prompt=p, answer="1") for p in ("short", "x" * 40, "y" * 60)]
    ids = encode_prompts(tok, exs, cfg, log=lines.append)
    assert [len(i) <= 60 for i in ids] == [True, True, True]
    assert len(lines) == 1 and lines[0].startswith("data.max_prompt_tokens: 2 of 3 prompts")
    encode_prompts(tok, exs[:1], cfg, log=lines.append)
    assert len(lines) == 1  # nothing to say when nothing was cut


def test_a_limit_below_the_template_itself_names_the_key():
    cfg = DataConfig(name="gsm8k", system_prompt="Box it.", thinking=True, max_prompt_tokens=10)
    with pytest.raises(ConfigError, match=r"^data\.max_prompt_tokens: 10 leaves no room"):
        encode_prompt(_tok(), Example(prompt="What is 1+1?", answer="2"), cfg)
