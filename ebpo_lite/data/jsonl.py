"""JSON-lines files written a few rows at a time and read back after a crash: the resumable
outputs of `eval` (`<out>.partial.jsonl`) and of the labellers (`labels.py`); and `write_atomic`,
for the files a run rewrites whole (config.yaml, summary.json, eval results, labels)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ebpo_lite.errors import UserError


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of `path` (a line cut by a crash is dropped from the file)."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    rows, good = [], []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # the last line, cut mid-write: drop it
                path.write_text("".join(good), encoding="utf-8")
                break
            raise UserError(f"{path}:{n}: invalid JSON; delete the file to start over") from None
        rows.append(row)
        good.append(line if line.endswith("\n") else line + "\n")
    return rows


def append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text`: written beside it, then renamed over it, so a crash leaves the old
    file or the new one, never half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
