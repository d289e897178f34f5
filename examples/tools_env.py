"""A tool environment written for TRL 1.16 (`GRPOTrainer(environment_factory=...)`), as a
recipe's `env.factory: examples.tools_env:CalculatorEnv` uses it (recipes/smollm2_tools_cpu.yaml).

TRL's contract, nothing of ebpo_lite's: the class is built with no arguments, one instance per
episode; `reset(**columns)` gets the example's columns (`prompt`, `answer`, the data's fields)
and returns a text to append to the question, or None; every other public method is a tool the
model may call, described to it by `transformers.utils.get_json_schema` (so each needs type
hints and a Google-style docstring with `Args:`). A `get_reward(self) -> float` would add the
environment's own reward; this one has none: the answer is scored by the run's reward
(math_answer on arithmetic_chat), so calling the tool pays only where it gets the answer right.

`multiply` is the other kind of tool: a plain function without state, offered in every episode
(`env.tools: [examples.tools_env:multiply]`).

The expressions are model output: `calculator` parses them (integer + - * and parentheses) and
never evaluates text. The module is imported by name from where the run starts (the repository
root: `examples` is a namespace package there), in the trainer and in the tool worker.
"""

from __future__ import annotations

from ebpo_lite.env.calculator import calculator


class CalculatorEnv:
    """One episode's calculator: counts the calls it answered (read them through the reward
    functions' `environments` argument, or a `get_reward` of your own)."""

    def __init__(self):
        self.calls = 0
        self.answer: str | None = None

    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        self.answer = kwargs.get("answer")  # kept, never shown to the model
        return None  # nothing to add to the question

    def calculate(self, expression: str) -> str:
        """Compute an integer arithmetic expression exactly.

        Args:
            expression: Integers combined with +, -, * and parentheses, for example "35+8".

        Returns:
            The value of the expression, as decimal text.
        """
        self.calls += 1
        return calculator(expression)  # a bad expression raises: the model reads the error


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product, as decimal text.
    """
    return str(_integer(a, "a") * _integer(b, "b"))


def _integer(value: object, name: str) -> int:
    """An integer argument; the model may send "12" for 12, but never 1.5 (int() would cut it)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)  # "1.5" raises ValueError: the model reads it
