"""`Example`, the one record every part of the project passes around, and `Examples`, a list of
them with its load report. A leaf module: the data loaders, the curriculum, the rewards and the
eval all import it, and it imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    prompt: str  # the user's question (chat-templated later for chat models)
    answer: str  # the gold final answer, as a string
    topic: str | None = None
    difficulty: float | None = None  # higher = harder: a level, or 1 - pass rate from labels
    meta: dict[str, Any] = field(default_factory=dict)  # other columns, passed to rewards


class Examples(list):
    """A list of Example with the load report: `skipped` bad rows, `unscorable` rows, `source`."""

    skipped: int = 0
    unscorable: int = 0
    first_error: str | None = None
    source: str = ""
