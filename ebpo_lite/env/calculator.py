"""The built-in calculator tool (recipes/tiny_tools_cpu.yaml): integer `+ - *`, parentheses and
unary minus.

The expression is model output, so it is parsed, never evaluated: a small recursive-descent
parser over the grammar below, with limits that keep every call cheap (at most 64 characters,
operands of at most 12 digits, every intermediate value and the result below 10**24 in size).
Anything else raises `ValueError` with a message the model can read (the contained host turns
a tool's exception into an `{"error": ...}` message).

    expr    := term (("+" | "-") term)*
    term    := factor ("*" factor)*
    factor  := "-" factor | NUMBER | "(" expr ")"

Whitespace between tokens is allowed. The docstring of `calculator` is Google style, so
`transformers.utils.get_json_schema(calculator)` gives the tool's JSON schema.
"""

from __future__ import annotations

MAX_CHARS = 64
MAX_DIGITS = 12
MAX_ABS = 10**24
_DIGITS = "0123456789"


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: Integers combined with +, -, * and parentheses, for example "35+8" or
            "-(12-3)*4".

    Returns:
        The exact integer value of the expression, as decimal text.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression too long ({len(expression)} characters, at most {MAX_CHARS})")
    if not expression.strip():
        raise ValueError("empty expression")
    parser = _Parser(expression)
    value = parser.expr()
    parser.skip_space()
    if parser.pos != len(expression):
        raise ValueError(parser.unexpected())
    return str(value)


class _Parser:
    """One pass over the text; `pos` is the index of the next unread character."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def unexpected(self) -> str:
        if self.pos >= len(self.text):
            return "expression ends too early"
        return f"unexpected {self.text[self.pos]!r} at position {self.pos}"

    def expr(self) -> int:
        value = self.term()
        while (op := self.peek()) in ("+", "-"):
            self.pos += 1
            rhs = self.term()
            value = _bounded(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> int:
        value = self.factor()
        while self.peek() == "*":
            self.pos += 1
            value = _bounded(value * self.factor())
        return value

    def factor(self) -> int:
        c = self.peek()
        if c == "-":
            self.pos += 1
            return -self.factor()
        if c == "(":
            self.pos += 1
            value = self.expr()
            if self.peek() != ")":
                raise ValueError(self.unexpected() + " (expected ')')")
            self.pos += 1
            return value
        if c and c in _DIGITS:
            start = self.pos
            while self.pos < len(self.text) and self.text[self.pos] in _DIGITS:
                self.pos += 1
            digits = self.text[start : self.pos]
            if len(digits) > MAX_DIGITS:
                raise ValueError(f"number too long ({len(digits)} digits, at most {MAX_DIGITS})")
            return int(digits)
        raise ValueError(self.unexpected())


def _bounded(value: int) -> int:
    if abs(value) >= MAX_ABS:
        raise ValueError("result too large (at most 24 digits)")
    return value
