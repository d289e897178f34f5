"""Answer extraction and gold normalisation: pure string functions, no math-verify.

Everything here runs in the trainer process, so every function is linear in the input length
and bounded: a megabyte of adversarial text costs milliseconds, never a stall.

Extraction order for a completion (`extract_answer_and_method`; the method names are what
`rewards.judge` reports per completion):
1. `boxed`: the content of the last balanced `\\boxed{...}` or `\\fbox{...}` (escaped braces
   `\\{ \\}` are not counted; a box whose content is longer than `MAX_ANSWER_CHARS` or never
   closes is ignored and the box before it is tried, up to `MAX_BOX_CANDIDATES` boxes from the
   end; so is an empty one, `\\boxed{}` or `\\boxed{ $ }`: SmolLM2-135M-Instruct copies the
   system prompt's "within \\boxed{}." into its answers, and such a box is no answer, so the
   rules below read the text instead);
2. `gsm8k_marker`: else the first number after the last `####` (GSM8K's marker; `-?` digits with
   optional `,ddd` thousands groups, removed, and a decimal part);
3. `math_verify`: else nothing here. The caller hands `verify_tail(text)` (the last
   `TAIL_CHARS` characters) to math-verify's own free-text extraction, in the verifier's worker
   process under its time limit (`_verify_worker.py`), so that unboxed answers (`1/2`,
   `The answer is 0.5.`, `$\\frac{\\sqrt{3}}{2}$`) are judged as math-verify's default `parse`
   judges them (LatexExtractionConfig + ExprExtractionConfig, as in lighteval's math metrics).
   Until issue 15 this step took the last number, so `1/2` scored as `2`. TRL's example
   `accuracy_reward` parses with a stricter LaTeX-only config and would give plain `1/2` 0.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_ANSWER_CHARS = 2000  # longer boxed contents are not answers (and never reach the verifier)
MAX_BOX_CANDIDATES = 8  # boxes tried from the end when the last ones are unbalanced
TAIL_CHARS = 4096  # math-verify's free-text extraction reads only the end of the text

BOXED, GSM8K_MARKER, MATH_VERIFY, NO_ANSWER = "boxed", "gsm8k_marker", "math_verify", "none"
EXTRACTION_METHODS = (BOXED, GSM8K_MARKER, MATH_VERIFY, NO_ANSWER)

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"(?<!\\)[{}]")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_INT = re.compile(r"[+-]?\d+")
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or chat messages (the last assistant content).

    Chat messages are a list of {"role", "content"} dicts (TRL's conversational format); a content
    that is a list of parts ({"type": "text", "text": ...}) is joined. No assistant message: the
    last message's content.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        if not messages:
            return ""
        assistant = [m for m in messages if m.get("role") == "assistant"]
        return _content_text((assistant or messages)[-1].get("content"))
    return "" if completion is None else str(completion)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in content]
        return "".join(p for p in parts if isinstance(p, str))
    return str(content)


def _box_end(text: str, open_brace: int) -> int | None:
    """Index of the brace closing the one at `open_brace`, scanning at most MAX_ANSWER_CHARS."""
    depth = 0
    stop = min(len(text), open_brace + MAX_ANSWER_CHARS + 2)
    for m in _BRACE.finditer(text, open_brace, stop):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return None


def boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the contents of the balanced boxes, for the last MAX_BOX_CANDIDATES opens."""
    opens = [m.end() - 1 for m in _BOX_OPEN.finditer(text)]  # index of each "{"
    spans = []
    for brace in opens[-MAX_BOX_CANDIDATES:]:
        end = _box_end(text, brace)
        if end is not None:
            spans.append((brace + 1, end))
    return spans


def last_boxed(text: str) -> str | None:
    """Content of the last balanced, non-empty `\\boxed{}` / `\\fbox{}`; None when there is none
    (`clean_answer` decides emptiness: whitespace and `$` only is empty)."""
    for start, end in reversed(boxed_spans(text)):
        if clean_answer(text[start:end]):
            return text[start:end].strip()
    return None


def count_boxes(text: str) -> int:
    """Number of `\\boxed{` / `\\fbox{` openings (balanced or not)."""
    return sum(1 for _ in _BOX_OPEN.finditer(text))


def marker_number(text: str) -> str | None:
    """GSM8K's answer: the first number in the 200 characters after the last `####`, else None."""
    mark = text.rfind("####")
    if mark < 0:
        return None
    m = _NUMBER.search(text, mark + 4, min(len(text), mark + 200))
    return m.group().replace(",", "") if m else None


def extract_answer_and_method(text: str) -> tuple[str | None, str]:
    """(answer, "boxed") or (answer, "gsm8k_marker"); (None, "math_verify") when neither applies.

    The last case means: hand `verify_tail(text)` to math-verify (see the module docstring).
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, BOXED
    number = marker_number(text)
    if number is not None:
        return number, GSM8K_MARKER
    return None, MATH_VERIFY


def extract_answer(text: str) -> str | None:
    """The last box's content, else the `####` number, else None (math-verify's turn)."""
    return extract_answer_and_method(text)[0]


def verify_tail(text: str) -> str:
    """What math-verify reads of an unboxed completion: at most its last TAIL_CHARS characters.

    A cut text starts after the first newline in the first half of the tail, if there is one,
    so that math-verify never sees half of an inline `$...$` (inline math is single-line).
    """
    if len(text) <= TAIL_CHARS:
        return text
    tail = text[-TAIL_CHARS:]
    newline = tail.find("\n", 0, TAIL_CHARS // 2)
    return tail[newline + 1 :] if newline >= 0 else tail


def clean_answer(s: str) -> str:
    """Strip whitespace and unescaped `$`; drop thousands commas from a plain number."""
    s = _UNESCAPED_DOLLAR.sub("", s).strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def canonical_int(s: str) -> str | None:
    """'-007' -> '-7', '+12' -> '12'; None unless `s` is a plain integer."""
    s = clean_answer(s)
    if not _INT.fullmatch(s):
        return None
    sign = "-" if s[0] == "-" else ""
    digits = s.lstrip("+-").lstrip("0") or "0"
    return "0" if digits == "0" else sign + digits


def normalize_gold(answer: Any) -> list[str] | None:
    """Gold answers as a list of strings (alternatives); None when there is nothing to judge.

    - str: the text after the last `####` (GSM8K), else the last box if the string has one; `$`
      removed; thousands commas removed from plain numbers; zero-padded integers ('025') -> '25'.
    - int -> str; float: 27.0 -> '27', 0.5 -> '0.5' (NaN / inf -> None); bool -> None.
    - list / tuple (OlympiadBench's `final_answer`): every element normalised; any of them may
      match (OlympiadBench lists always have one element; a multi-part answer is one string).
    """
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, (list, tuple)):
        out = []
        for a in answer:
            g = normalize_gold(a)
            if g:
                out.extend(g)
        return out or None
    if isinstance(answer, int):
        return [str(answer)]
    if isinstance(answer, float):
        if not math.isfinite(answer):
            return None
        return [str(int(answer))] if answer.is_integer() else [repr(answer)]
    if not isinstance(answer, str):
        return None
    s = answer
    if "####" in s:
        s = s[s.rfind("####") + 4 :]
    elif "\\boxed" in s or "\\fbox" in s:
        s = last_boxed(s) or s
    s = clean_answer(s)
    if not s:
        return None
    as_int = canonical_int(s)
    return [as_int if as_int is not None else s]
