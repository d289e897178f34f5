"""`data.name: arithmetic_chat`: the built-in arithmetic problems asked as a chat model is asked
them (recipes/smollm2_cpu.yaml): the same problems, answers and labels as `arithmetic`, prompts
through the chat template instead of raw text, scored by `math_answer`."""

from __future__ import annotations

from ebpo_lite import config, rewards
from ebpo_lite.data.loader import describe_source, encode_prompt, load_train_eval
from ebpo_lite.data.prompts import DEFAULT_SYSTEM_PROMPT, format_prompt
from ebpo_lite.engine.run import reward_functions
from ebpo_lite.model.tiny import build_tokenizer


def _data(name: str):
    return config.load(None, [f"data.name={name}", "data.num_train=60", "data.num_eval=12"]).data


def test_the_same_problems_asked_in_words():
    raw_train, raw_held = load_train_eval(_data("arithmetic"))
    train, held = load_train_eval(_data("arithmetic_chat"))
    for raw, chat in zip(raw_train + raw_held, train + held, strict=True):
        a, b = raw.prompt.rstrip("=").replace("+", " + ").replace("*", " * "), chat.prompt
        assert b == f"What is {a.replace('-', ' - ')}?", (raw.prompt, b)
        assert (chat.answer, chat.topic, chat.difficulty) == (raw.answer, raw.topic, raw.difficulty)
    assert not {e.prompt for e in train} & {e.prompt for e in held}  # still held out
    assert describe_source(_data("arithmetic_chat"), train).endswith("through the chat template")


def test_prompts_go_through_the_template_and_math_answer_scores():
    cfg = _data("arithmetic_chat")
    ex = load_train_eval(cfg)[0][0]
    tok = build_tokenizer()  # no chat template: format_prompt's plain fallback, not raw text
    text = format_prompt(tok, ex, cfg.system_prompt)
    assert text == f"{DEFAULT_SYSTEM_PROMPT}\n\nQuestion: {ex.prompt}\nAnswer:"
    assert encode_prompt(tok, ex, cfg) == tok.encode(text, add_special_tokens=False)
    raw = _data("arithmetic")
    assert tok.decode(encode_prompt(tok, load_train_eval(raw)[0][0], raw)).endswith("=")
    full = config.load(None, ["data.name=arithmetic_chat"])
    assert [name for name, _ in reward_functions(full.reward, full.data)[0]] == ["math_answer"]
    boxed = rewards.math_answer([f"so \\boxed{{{ex.answer}}}", "\\boxed{}"], answer=ex.answer)
    assert boxed == [1.0, 0.0]
