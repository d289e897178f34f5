"""`python -m ebpo_lite.train --help`: every config key, written from `config.py` itself.

The keys, types and defaults come from the dataclasses; each key's note is the `# comment` after
its field in `config.py`'s source, and comment lines standing alone above a field (a sub-heading
such as `# loss`, or a note too long for one line) are printed above it. A new field therefore
shows up in the help with no second place to edit.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
from typing import Any

from ebpo_lite import config

USAGE = """\
usage: python -m ebpo_lite.train RECIPE [section.key=value ...]
       ebpo-lite train RECIPE [section.key=value ...]

RECIPE is a YAML file or the name of a packaged recipe (`ebpo-lite recipes` lists them); each
`section.key=value` replaces one key of it (a YAML scalar; lists as [a, b] or a,b).
example: python -m ebpo_lite.train recipes/tiny_cpu.yaml train.steps=20 algo.estimator=grpo"""


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str  # section.key (or a top-level key such as output_dir)
    type: str  # the annotation as written in config.py
    default: str  # as it would be written in a recipe or an override
    comment: str  # the trailing `# ...` in the source, or ""
    above: tuple[str, ...]  # comment lines standing alone right above the field


def format_value(value: Any) -> str:
    """A default as a recipe or an override writes it: true, null, [a, b], 0.001."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line (without '#')."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string[1:].strip()
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def field_docs(cls: type, section: str = "") -> list[FieldDoc]:
    """One `FieldDoc` per non-section field of `cls`, in source order."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments = _comments(source)
    annotated = {
        node.target.id: node
        for node in ast.parse(source).body[0].body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            continue  # a section: documented by its own class
        node = annotated[f.name]
        above = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        out.append(
            FieldDoc(
                key=f"{section}{f.name}",
                type=ast.unparse(node.annotation),
                default=format_value(_default(f)),
                comment=comments.get(node.end_lineno, ""),
                above=tuple(above),
            )
        )
    return out


def sections() -> list[tuple[str, list[FieldDoc]]]:
    """(section name, its fields) for every config dataclass; the top-level keys first as ''."""
    out = [("", field_docs(config.Config))]
    for f in dataclasses.fields(config.Config):
        if dataclasses.is_dataclass(f.default_factory):
            out.append((f.name, field_docs(f.default_factory, section=f"{f.name}.")))
    return out


def train_help() -> str:
    """The usage, then every key grouped by section: `key  type = default  # comment`."""
    parts = [
        USAGE,
        "",
        "Config keys (section.key  type = default  # note), from ebpo_lite/config.py:",
    ]
    for name, docs in sections():
        parts.append("")
        parts.append(f"{name}:" if name else "top level:")
        width = max(len(d.key) for d in docs)
        twidth = max(len(d.type) for d in docs)
        for d in docs:
            parts.extend(f"  # {a}" for a in d.above)
            line = f"  {d.key:<{width}}  {d.type:<{twidth}} = {d.default}"
            parts.append(f"{line}  # {d.comment}" if d.comment else line)
    return "\n".join(parts)
