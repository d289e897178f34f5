"""Real math data: presets for the public schemas, local files, the hub, benchmarks, prompts.

Sources (`DataConfig`):
- `data.path`: a local `.json` (one array, or JSON lines), `.jsonl` / `.ndjson` or `.parquet` file.
- `data.name`: a preset name (gsm8k, math, math500, aime, aime24, aime25, amc23, olympiadbench,
  dapo_math, deepscaler) or a hub dataset id. A preset is read from the local data folder when
  one is set up and holds its file (`data.data_dir`, else EBPO_LITE_DATA:
  `local_data_root`), else from its hub id (`presets.HUB`) with `datasets.load_dataset`, which
  shows its download progress and caches it; `aime` (AIME 1983-2023) is local only. A hub id is
  loaded with `load_dataset(id, split=data.split)`; write `id:config` for a dataset config
  (`openai/gsm8k` gets `main` by itself). Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or no
  connection) and not cached: one line naming the dataset and the settings that point at a
  local copy. Benchmarks (`load_benchmark`) resolve the same way.

Presets map each public schema to `Example(prompt, answer, topic, difficulty, meta)`:
  gsm8k          question; answer = text after `####` (commas removed)
  math, math500  problem; answer; topic = subject | type; difficulty = level | difficulty
                 ("Level 3" -> 3.0; MATH-train's 0.0 placeholder -> None)
  aime           problem | question | prompt (QwQ's trailing boxed instruction removed); answer
                 '025' or 25 -> '25'; difficulty when present (AIME 1983-2023)
  amc23          problem; answer 27.0 -> '27'
  olympiadbench  question; final_answer (list; elements joined by ', '); topic = subfield
  dapo_math      DAPO-Math-17k: prompt (chat list; the DAPO "Answer:" instructions around the
                 problem removed), answer = reward_model.ground_truth
  deepscaler     problem; answer (solution kept out of meta)
  generic        data.prompt_field / answer_field (dotted paths such as reward_model.ground_truth)
`data.topic_field` / `data.difficulty_field` override any preset's topic / difficulty.
`preset: auto` guesses from the name or path, then from the first record's fields (plain
`question` + `answer` is `generic`; with a `#### n` answer it is `gsm8k`); setting
`data.prompt_field` or `data.answer_field` with `auto` selects `generic`.

Bad rows. A record that is not valid JSON, not an object, lacks a field or has the wrong type
raises `UserError("FILE:LINE: field: problem")`; with `data.skip_bad_rows: true` it is skipped
instead, and the count is logged (logger `ebpo_lite.data.mathdata`) and stored on the returned list as
`.skipped` (`.first_error` holds the first message). A broken JSON *array* cannot be resumed
after the error, so it always raises. Rows whose answer is null or empty (two in MATH-train) are
unscorable, not malformed: always dropped, counted in `.unscorable` and logged.

Example.answer is the normalised gold string (`ebpo_lite.rewards.normalize_gold`); the original
row's short scalar fields go to `meta` (long texts such as solutions are left out).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ebpo_lite.data.datasource import hub_records, local_data_root
from ebpo_lite.data.example import Example, Examples
from ebpo_lite.data.prompts import prompt_digest
from ebpo_lite.errors import UserError
from ebpo_lite.presets import BENCHMARKS, EVAL_FOR, HUB, HUB_CONFIGS, LOCAL_FILES, PRESETS
from ebpo_lite.rewards.extract import last_boxed, normalize_gold

if TYPE_CHECKING:
    from ebpo_lite.config import DataConfig

log = logging.getLogger(__name__)

_QWQ_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:"'


class _RowError(Exception):
    """A malformed record; the message starts with the field name."""


# ----------------------------------------------------------------------------- reading records


def _read_json_array(text: str, path: Path) -> Iterator[tuple[str, Any]]:
    """Elements of a JSON array with the line each starts on (raw_decode, one pass)."""
    dec, ws = json.JSONDecoder(), re.compile(r"\s*")
    i, line, counted = ws.match(text, text.index("[") + 1).end(), 1, 0

    def where(pos: int) -> str:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return f"{path}:{line}"

    while i < len(text) and text[i] != "]":
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{where(e.pos)}: invalid JSON ({e.msg}); fix the file there (a JSON array "
                "cannot skip a bad row, JSON lines can)"
            ) from None
        yield where(i), obj
        i = ws.match(text, end).end()
        if i < len(text) and text[i] == ",":
            i = ws.match(text, i + 1).end()
        elif i >= len(text) or text[i] != "]":
            raise UserError(
                f"{where(i)}: invalid JSON (expected ',' or ']' after a record); fix the file there"
            )


def _read_json_lines(text: str, path: Path) -> Iterator[tuple[str, Any]]:
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(raw)
        except json.JSONDecodeError as e:
            yield f"{path}:{n}", _RowError(f"invalid JSON ({e.msg}, column {e.colno})")


def read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(location, record) pairs of a local file; a record that failed to parse is a _RowError."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a folder; set data.path to a .json, .jsonl or .parquet file")
    if not path.is_file():
        raise UserError(f"{path}: data file not found; check data.path")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(
                f"{path}: reading parquet needs pyarrow (pip install pyarrow)"
            ) from None
        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{path}:row {i}", row
        return
    if suffix not in (".json", ".jsonl", ".ndjson"):
        raise UserError(f"{path}: unsupported file type {suffix!r} (use .json, .jsonl or .parquet)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e})") from None
    if text.lstrip().startswith("["):
        yield from _read_json_array(text, path)
    else:
        yield from _read_json_lines(text, path)


# ----------------------------------------------------------------------------- field helpers


def _get(row: dict, key: str) -> Any:
    """row[key], with dotted paths into nested objects; _RowError names the field if missing."""
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise _RowError(f"{key}: missing field")
        node = node[part]
    return node


def _text(row: dict, key: str) -> str:
    value = _get(row, key)
    if isinstance(value, list):  # chat messages: the last user turn
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        value = users[-1].get("content") if users else None
    if not isinstance(value, str):
        raise _RowError(f"{key}: expected a string (or chat messages), got {type(value).__name__}")
    if not value.strip():
        raise _RowError(f"{key}: empty")
    return value


def _first_key(row: dict, keys: tuple[str, ...]) -> str:
    for k in keys:
        if k in row:
            return k
    raise _RowError(f"{keys[0]}: missing field (looked for {', '.join(keys)})")


def _answer(row: dict, key: str) -> str | None:
    """Normalised gold string; None = null / empty (unscorable); _RowError for a wrong type."""
    value = _get(row, key)
    ok = value is None or isinstance(value, (str, int, float)) and not isinstance(value, bool)
    if isinstance(value, list):
        ok = all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value)
    if not ok:
        raise _RowError(
            f"{key}: expected a string, number or list of strings, got {type(value).__name__}"
        )
    gold = normalize_gold(value)
    return ", ".join(gold) if gold else None


def _difficulty(row: dict, key: str) -> float | None:
    value = _get(row, key)
    if value is None:
        return None
    if isinstance(value, str):  # MATH's "Level 3"; a few are "Level ?"
        if re.fullmatch(r"\s*(?:level\s*)?\?\s*", value, flags=re.I):
            return None
        m = re.fullmatch(r"\s*(?:level\s*)?(-?\d+(?:\.\d+)?)\s*", value, flags=re.I)
        if not m:
            raise _RowError(f"{key}: expected a number or 'Level N', got {value!r}")
        return float(m.group(1))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _RowError(f"{key}: expected a number, got {type(value).__name__}")
    return float(value)


def _topic(row: dict, key: str) -> str | None:
    value = _get(row, key)
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise _RowError(f"{key}: expected a string, got {type(value).__name__}")


def _meta(row: dict, used: tuple[str, ...]) -> dict[str, Any]:
    return {
        k: v
        for k, v in row.items()
        if k not in used
        and (v is None or isinstance(v, (bool, int, float)) or isinstance(v, str) and len(v) <= 200)
    }


# ----------------------------------------------------------------------------- presets

Row = tuple[str, str | None, str | None, float | None, tuple[str, ...]]  # prompt, answer, topic,
# difficulty, fields used (left out of meta)


def _gsm8k(row: dict) -> Row:
    sol = _text(row, "answer")
    if "####" not in sol:
        raise _RowError("answer: no '####' final-answer marker")
    return _text(row, "question"), _answer(row, "answer"), None, None, ("question", "answer")


def _math(row: dict) -> Row:
    """MATH's schemas; rows without `answer` (the hub's MATH-lighteval) take the last `\\boxed{}`
    of their solution."""
    pk = _first_key(row, ("problem", "question"))
    tk = next((k for k in ("subject", "type") if k in row), None)
    dk = next((k for k in ("level", "difficulty") if k in row), None)
    diff = _difficulty(row, dk) if dk else None
    if "answer" not in row and "solution" in row:
        boxed = last_boxed(_text(row, "solution"))
        if boxed is None:
            raise _RowError("answer: missing field (and no \\boxed{} in the solution)")
        answer = _answer({"answer": boxed}, "answer")
    else:
        answer = _answer(row, "answer")
    return (
        _text(row, pk),
        answer,
        _topic(row, tk) if tk else None,
        diff if diff else None,
        (pk, "answer", "solution"),
    )


def _aime(row: dict) -> Row:
    pk = _first_key(row, ("problem", "question", "prompt"))
    prompt = _text(row, pk)
    if prompt.endswith(_QWQ_SUFFIX):
        prompt = prompt[: -len(_QWQ_SUFFIX)]
    diff = _difficulty(row, "difficulty") if "difficulty" in row else None
    return prompt, _answer(row, "answer"), None, diff, (pk, "answer", "question", "solution")


def _amc23(row: dict) -> Row:
    pk = _first_key(row, ("problem", "question"))
    return _text(row, pk), _answer(row, "answer"), None, None, (pk, "answer", "question")


def _olympiadbench(row: dict) -> Row:
    topic = _topic(row, "subfield") if "subfield" in row else None
    return (
        _text(row, "question"),
        _answer(row, "final_answer"),
        topic,
        None,
        ("question", "final_answer", "solution", "context"),
    )


def _dapo_math(row: dict) -> Row:
    text = _text(row, "prompt").strip()
    if text.startswith(_DAPO_HEAD) and "\n\n" in text:
        text = text.split("\n\n", 1)[1]
    text = text.split(_DAPO_TAIL, 1)[0].strip()
    return text, _answer(row, "reward_model.ground_truth"), None, None, ("prompt", "reward_model")


def _deepscaler(row: dict) -> Row:
    return (
        _text(row, "problem"),
        _answer(row, "answer"),
        None,
        None,
        ("problem", "answer", "solution"),
    )


_MAPPERS: dict[str, Callable[[dict], Row]] = dict(
    gsm8k=_gsm8k,
    math=_math,
    math500=_math,
    aime=_aime,
    aime24=_aime,
    aime25=_aime,
    amc23=_amc23,
    olympiadbench=_olympiadbench,
    dapo_math=_dapo_math,
    deepscaler=_deepscaler,
)


def _generic(cfg: DataConfig) -> Callable[[dict], Row]:
    def mapper(row: dict) -> Row:
        pk = cfg.prompt_field or _first_key(row, ("problem", "question", "prompt"))
        ak = cfg.answer_field or _first_key(row, ("answer", "final_answer", "ground_truth"))
        return _text(row, pk), _answer(row, ak), None, None, (pk.split(".")[0], ak.split(".")[0])

    return mapper


def guess_preset(source: str, row: dict | None = None) -> str | None:
    """Preset from a name / path (gsm8k, math500, ...), else from a record's fields."""
    s = "/".join(Path(source).parts[-2:]).lower().replace("-", "").replace("_", "")
    for token, preset in (
        ("gsm8k", "gsm8k"),
        ("dapo", "dapo_math"),
        ("deepscaler", "deepscaler"),
        ("olympiad", "olympiadbench"),
        ("amc", "amc23"),
        ("aime", "aime"),
        ("math500", "math500"),
        ("math", "math"),
    ):
        if token in s:
            return preset
    if not isinstance(row, dict):
        return None
    keys = set(row)
    if "final_answer" in keys and "question" in keys:
        return "olympiadbench"
    if "reward_model" in keys and "prompt" in keys:
        return "dapo_math"
    if {"question", "answer"} <= keys:  # GSM8K's answers end in "#### 42"; plain ones are plain
        return "gsm8k" if "####" in str(row.get("answer", "")) else "generic"
    if {"problem", "answer"} <= keys:
        return "math"
    if {"prompt", "answer"} <= keys:
        return "aime"
    return None


# ----------------------------------------------------------------------------- loading


def default_data_root() -> Path | None:
    """`local_data_root()`'s folder, without a `data.data_dir`."""
    return local_data_root()[0]


def _local_preset_file(name: str, split: str, root: Path | None) -> Path | None:
    files = LOCAL_FILES.get(name)
    rel = files and (files.get(split) or files.get("*"))
    if not rel or root is None or not (root / rel).is_file():
        return None
    return root / rel


def _source(cfg: DataConfig) -> tuple[str, Iterator[tuple[str, Any]]]:
    """(description used for guessing and messages, records): `data.path`, else the preset's
    file in the local data folder, else the hub (a preset's known id, or `data.name` as an id)."""
    if cfg.path:
        return cfg.path, read_records(cfg.path)
    root, where = local_data_root(cfg.data_dir)
    local = _local_preset_file(cfg.name, cfg.split, root)
    if local is not None:
        return str(local), read_records(local)
    files = LOCAL_FILES.get(cfg.name, {})
    rel = files.get(cfg.split) or files.get("*") or ""
    if cfg.name in LOCAL_FILES and cfg.name not in HUB:
        raise UserError(
            f"data.name: preset {cfg.name!r} is read from a local data folder only, and "
            f"{where or 'none is set'} holds no {rel or cfg.split + ' split'}; set EBPO_LITE_DATA "
            "(or data.data_dir) to a folder holding it, or set data.path"
        )
    if cfg.name in HUB:
        repo, config, split = HUB[cfg.name]
        split = split or cfg.split
    else:
        repo, _, config = cfg.name.partition(":")
        config, split = config or HUB_CONFIGS.get(repo) or None, cfg.split
    note = f"{where} has no {rel}; loaded {repo} from the hub" if root is not None and rel else ""
    what = f"data.name: {cfg.name}" if cfg.name in HUB else "data.name"
    source = f"the hub's {repo}" + (f" ({config}, {split})" if config else f" ({split})")
    return source, hub_records(what, repo, config, split, rel, note)


def _resolve_preset(cfg: DataConfig, source: str, first: Any) -> str:
    preset = cfg.preset
    if preset not in PRESETS:
        raise UserError(f"data.preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
    if preset == "auto" and (cfg.prompt_field or cfg.answer_field):
        return "generic"
    if preset == "auto":
        guessed = guess_preset(cfg.name if cfg.name in _MAPPERS else source, first)
        if guessed is None and isinstance(first, dict):
            guessed = guess_preset("", first)
        if guessed is None:
            fields = ", ".join(first) if isinstance(first, dict) else "none"
            raise UserError(
                f"{source}: cannot guess the schema (fields: {fields}); set "
                "data.preset or data.prompt_field and data.answer_field"
            )
        return guessed
    return preset


def _load(cfg: DataConfig, source: str, records: Iterator[tuple[str, Any]]) -> Examples:
    out = Examples()
    out.source = source
    mapper: Callable[[dict], Row] | None = None
    rows = 0
    for where, row in records:
        rows += 1
        try:
            if isinstance(row, _RowError):
                raise row
            if not isinstance(row, dict):
                raise _RowError(f"record: expected a JSON object, got {type(row).__name__}")
            if mapper is None:
                preset = _resolve_preset(cfg, source, row)
                mapper = _generic(cfg) if preset == "generic" else _MAPPERS[preset]
            prompt, answer, topic, diff, used = mapper(row)
            if cfg.topic_field:
                topic = _topic(row, cfg.topic_field)
            if cfg.difficulty_field:
                diff = _difficulty(row, cfg.difficulty_field)
        except _RowError as e:
            msg = f"{where}: {e}"
            if not cfg.skip_bad_rows:
                raise UserError(
                    f"{msg} (fix the row, or set data.skip_bad_rows=true to skip such rows)"
                ) from None
            out.skipped += 1
            out.first_error = out.first_error or msg
            continue
        if answer is None:
            out.unscorable += 1
            continue
        out.append(
            Example(
                prompt=prompt, answer=answer, topic=topic, difficulty=diff, meta=_meta(row, used)
            )
        )
    if not out:
        raise UserError(_nothing_usable(source, rows, out))
    if out.skipped:
        log.warning("%s: skipped %d bad rows (first: %s)", source, out.skipped, out.first_error)
    if out.unscorable:
        log.warning("%s: dropped %d rows with a null or empty answer", source, out.unscorable)
    return out


def _nothing_usable(source: str, rows: int, out: Examples) -> str:
    """The one line for a source that gave no example: empty, or every row dropped and why."""
    if not rows:
        return f"{source}: no records (an empty file?); give a file with one JSON object per line"
    why = []
    if out.unscorable:
        why.append(f"{out.unscorable} with a null or empty answer")
    if out.skipped:
        why.append(f"{out.skipped} malformed (first: {out.first_error})")
    return (
        f"{source}: no usable examples among {rows} rows ({'; '.join(why)}); check "
        "data.preset and data.answer_field"
    )


def load_examples(cfg: DataConfig) -> list[Example]:
    """The training examples of `cfg` (see the module docstring for sources and presets)."""
    source, records = _source(cfg)
    return _load(cfg, source, records)


def load_eval_examples(cfg: DataConfig) -> list[Example]:
    """Held-out examples for the in-training eval: the preset's test set, [] when it has none.

    gsm8k -> GSM8K test, math -> MATH-500, aime -> AIME 2024 (when training on their train
    split); a local file or an unknown hub dataset -> [].
    """
    if cfg.path or cfg.split != "train":
        return []
    preset = cfg.name if cfg.name in _MAPPERS else guess_preset(cfg.name)
    bench = EVAL_FOR.get(preset or "")
    if bench is None:
        return []
    try:
        return load_benchmark(bench, data_dir=cfg.data_dir)
    except UserError as e:
        log.warning("no held-out examples for %s: %s", cfg.name, e)
        return []


def load_benchmark(
    name: str, data_root: Path | None = None, data_dir: str | None = None
) -> list[Example]:
    """A benchmark: math500, aime24, aime25, amc23, olympiadbench, gsm8k (its test split), from
    the local data folder when it holds the file (`data_root`, default `local_data_root(data_dir)`),
    else from the hub (`presets.HUB`)."""
    if name not in BENCHMARKS:
        raise UserError(f"benchmark {name!r}: unknown (expected one of {', '.join(BENCHMARKS)})")
    rel, preset, hub_split = BENCHMARKS[name]
    from ebpo_lite.config import DataConfig

    cfg = DataConfig(name=name, preset=preset)
    root = data_root if data_root is not None else local_data_root(data_dir)[0]
    path = root / rel if root is not None else None
    if path is not None and path.is_file():
        return _load(cfg, str(path), read_records(path))
    repo, config, _ = HUB[name]
    records = hub_records(f"benchmark {name}", repo, config, hub_split, rel)
    return _load(cfg, f"the hub's {repo}", records)


# ----------------------------------------------------------------------------- labels


def apply_labels(examples: list[Example], labels_path: str | Path) -> list[Example]:
    """Set topic / difficulty from a labels file (JSON lines, one object per labelled example).

    Keys: `index` (int, position in the loaded training list, required); `topic` (str);
    `pass_rate` (float in [0, 1]: difficulty = 1 - pass_rate, so higher is harder as for MATH
    levels, and meta["pass_rate"] keeps the rate); `difficulty` (float, used as is, wins over
    pass_rate); `prompt_sha1` (optional, `prompt_digest(example.prompt)`: checked, so labels
    computed for other data fail loudly). Unlabelled examples are unchanged; a later line for the
    same index wins.
    """
    path = Path(labels_path)
    if not path.is_file():
        raise UserError(
            f"data.labels_path: {path} not found; write it with ebpo-lite label difficulty, "
            "or set data.labels_path=null"
        )
    out = list(examples)
    for where, row in _read_json_lines(path.read_text(encoding="utf-8"), path):
        try:
            if isinstance(row, _RowError):
                raise row
            if not isinstance(row, dict):
                raise _RowError("record: expected a JSON object")
            out_i = _label_one(out, row)
        except _RowError as e:
            raise UserError(f"{where}: {e}") from None
        out[out_i[0]] = out_i[1]
    return out


def _label_one(examples: list[Example], row: dict) -> tuple[int, Example]:
    idx = _get(row, "index")
    if isinstance(idx, bool) or not isinstance(idx, int):
        raise _RowError(f"index: expected an integer, got {idx!r}")
    if not 0 <= idx < len(examples):
        raise _RowError(f"index: {idx} out of range ({len(examples)} examples)")
    ex = examples[idx]
    if "prompt_sha1" in row and row["prompt_sha1"] != prompt_digest(ex.prompt):
        raise _RowError(f"prompt_sha1: does not match example {idx}; labels for other data?")
    changes: dict[str, Any] = {}
    if "topic" in row:
        changes["topic"] = _topic(row, "topic")
    if row.get("pass_rate") is not None:
        rate = row["pass_rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise _RowError(f"pass_rate: expected a number in [0, 1], got {rate!r}")
        changes["difficulty"] = 1.0 - float(rate)
        changes["meta"] = {**ex.meta, "pass_rate": float(rate)}
    if row.get("difficulty") is not None:
        changes["difficulty"] = _difficulty(row, "difficulty")
    return idx, dataclasses.replace(ex, **changes)
