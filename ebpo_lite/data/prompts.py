"""The model input for one problem (`format_prompt`) and the digest that ties labels to prompts.

A leaf module: `data` (training prompts), `mathdata` (labels), the eval and the labellers use it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ebpo_lite.data.example import Example

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(
    tokenizer: Any, example: Example | str, system_prompt: str | None = None, thinking: bool = False
) -> str:
    """The model input for one problem.

    With a chat template: [system, user] messages through `apply_chat_template` with the
    generation prompt and `enable_thinking=thinking` (Qwen3's switch; other templates ignore it).
    A template that rejects the system role gets the system text prepended to the user turn.
    Without a chat template: "{system}\\n\\nQuestion: {problem}\\nAnswer:". `system_prompt`
    None means DEFAULT_SYSTEM_PROMPT; "" means none.
    """
    system = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    question = example.prompt if isinstance(example, Example) else str(example)
    if not getattr(tokenizer, "chat_template", None):
        return (f"{system}\n\n" if system else "") + f"Question: {question}\nAnswer:"
    user = {"role": "user", "content": question}
    kwargs = dict(tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    if not system:
        return tokenizer.apply_chat_template([user], **kwargs)
    try:
        return tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, user], **kwargs
        )
    except Exception:  # e.g. "System role not supported" raised by the template
        merged = {"role": "user", "content": f"{system}\n\n{question}"}
        return tokenizer.apply_chat_template([merged], **kwargs)


def prompt_digest(prompt: str) -> str:
    """16 hex characters of sha1(prompt): lets a labels file prove it belongs to this data."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]
