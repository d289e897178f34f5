"""Training and evaluation prompts.

`Example` (ebpo_lite.data.example) is the one record every part of the project passes around. Two
sources:
- `arithmetic`: a generated task for the built-in tiny model (addition, subtraction and
  multiplication of small numbers). Each example carries a `topic` (add / sub / mul) and a
  `difficulty` level (1-3, see `_arithmetic_problem`), so the topic and difficulty curricula and the
  hierarchical prior have something real to work on. The eval split is held out: no problem in it
  appears in the train split.
- `arithmetic_chat`: the same problems asked as a chat model is asked them (`What is 35 - 8?`
  through the tokenizer's chat template, answer boxed as the system prompt says, scored by
  `math_answer`): the task of recipes/smollm2_cpu.yaml, for a real pretrained chat model.
- real math data (GSM8K, MATH, AIME, ...) and a user's own file: `ebpo_lite.data.mathdata`, from
  local files or the hub.

Held-out examples for the in-training eval (`load_train_eval`, docs/data.md): the arithmetic
task's own eval split; a preset's test set (gsm8k -> GSM8K test, ...); a separate file
(`data.eval_path`); or rows split off the training data (`data.eval_size`: a fraction or a count,
drawn with `data.seed`; by default 10% from 10 rows on, at most `data.num_eval`, of a user's data:
a file, or a hub dataset that is not a preset's; a preset without a test set, such as math500 or
dapo_math, holds nothing out unless asked). A training row whose prompt text is also a held-out
prompt is dropped, so the two never share a question.
"""

from __future__ import annotations

import dataclasses
import random
import re
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from ebpo_lite.config import parse_eval_size
from ebpo_lite.data.example import Example, Examples
from ebpo_lite.data.prompts import format_prompt
from ebpo_lite.errors import ConfigError

if TYPE_CHECKING:
    from ebpo_lite.config import DataConfig

TOPICS = ("add", "sub", "mul")


def _arithmetic_problem(rng: random.Random, topic: str) -> tuple[int, int]:
    """Sizes: add/sub 1d op 1d, 2d op 1d, 2d op 2d; mul 1d*1d, 2d*1d, 1d*2d."""
    size = rng.randint(1, 3)
    one, two = (0, 9), (10, 99)
    if topic == "mul":
        ra, rb = {1: (one, one), 2: (two, one), 3: (one, two)}[size]
    else:
        ra, rb = {1: (one, one), 2: (two, one), 3: (two, two)}[size]
    a, b = rng.randint(*ra), rng.randint(*rb)
    if topic == "sub" and b > a:
        a, b = b, a
    return a, b


def column_arithmetic(topic: str, a: int, b: int, carry: bool = True) -> tuple[int, int]:
    """(answer, number of carries) of `a op b` done digit by digit, as on paper.

    `carry=False` makes the classic slip: every carry is dropped (a sum digit is taken mod 10, a
    product digit mod 10) and subtraction takes the smaller digit from the larger instead of
    borrowing. The carry count is the same either way: the number of columns that carry or borrow.
    """
    digits, n_carry, c = [], 0, 0
    if topic == "mul":  # one factor has one digit: the other is written out digit by digit
        x, b = (a, b) if b < 10 else (b, a)
        while True:
            s = (x % 10) * b + c
            digits.append(s % 10)
            c = s // 10 if carry else 0
            n_carry += s >= 10
            x //= 10
            if not x:
                break
        if c:
            digits.append(c)
    else:
        x, y = a, b
        while x or y or c or not digits:
            if topic == "add":
                s = x % 10 + y % 10 + c
                digits.append(s % 10)
                n_carry += s >= 10
                c = s // 10 if carry else 0
            else:  # sub, a >= b
                d = x % 10 - y % 10 - c
                n_carry += d < 0
                if carry:
                    c = int(d < 0)
                    digits.append(d % 10)
                else:
                    digits.append(abs(x % 10 - y % 10))
            x, y = x // 10, y // 10
    return int("".join(map(str, reversed(digits)))), n_carry


def arithmetic_examples(n: int, seed: int, split: str) -> list[Example]:
    """`n` distinct problems, a third per topic; "eval" problems never occur in "train"
    (hash-split by the problem text).

    `difficulty` is 1 + the number of carries (or borrows), capped at 3: no carry, one, two or
    more. `meta["slip"]` is the answer with every carry dropped (`column_arithmetic`), equal to
    the answer exactly when no carry is needed; the tiny model's warm-up learns it on purpose.
    """
    rng = random.Random(f"arith-{seed}-{split}")
    out: list[Example] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 10_000:
            raise ValueError(f"arithmetic: cannot draw {n} distinct {split} problems")
        topic = TOPICS[len(out) % len(TOPICS)]  # topics in equal shares
        a, b = _arithmetic_problem(rng, topic)
        op = {"add": "+", "sub": "-", "mul": "*"}[topic]
        prompt = f"{a}{op}{b}="
        if prompt in seen or _is_eval(prompt) != (split == "eval"):
            continue
        seen.add(prompt)
        value, n_carry = column_arithmetic(topic, a, b)
        slip, _ = column_arithmetic(topic, a, b, carry=False)
        out.append(
            Example(
                prompt=prompt,
                answer=str(value),
                topic=topic,
                difficulty=float(1 + min(n_carry, 2)),
                meta={"slip": str(slip)},
            )
        )
    return out


def _is_eval(prompt: str) -> bool:
    """Deterministic 1-in-8 split by the problem text (stable across Python runs)."""
    return zlib.crc32(prompt.encode()) % 8 == 0


ARITHMETIC_CHAT = "arithmetic_chat"


def as_question(ex: Example) -> Example:
    """`35-8=` asked in words, `What is 35 - 8?`; answer, topic, difficulty and meta kept."""
    a, op, b = re.fullmatch(r"(\d+)([+*-])(\d+)=", ex.prompt).groups()
    return dataclasses.replace(ex, prompt=f"What is {a} {op} {b}?")


def is_generated(cfg: DataConfig) -> bool:
    """The built-in generator: `arithmetic` (raw text) or `arithmetic_chat` (chat questions)."""
    return cfg.name in ("arithmetic", ARITHMETIC_CHAT) and cfg.path is None


def is_arithmetic(cfg: DataConfig) -> bool:
    """True for the built-in generated task (raw-text prompts, exact-integer reward)."""
    return cfg.name == "arithmetic" and cfg.path is None


def raw_prompts(cfg: DataConfig) -> bool:
    """Whether prompts go to the model as they are (`data.prompt_format`; auto: the tiny task)."""
    if cfg.prompt_format == "auto":
        return is_arithmetic(cfg)
    return cfg.prompt_format == "raw"


def encode_prompt(
    tokenizer, ex: Example, cfg: DataConfig, raw: bool | None = None, truncate: bool = True
) -> list[int]:
    """Token ids of a prompt: the raw text for the tiny task, the chat template otherwise.

    `raw` defaults to `raw_prompts(cfg)`. With `truncate`, a templated prompt longer than
    `max_prompt_tokens` keeps the template whole (system turn, user header and footer,
    generation prompt) and loses the FRONT of the question text, its end (usually the question
    asked) kept; `encode_prompts` says how many prompts that happened to.
    """
    return _encode(tokenizer, ex, cfg, raw, truncate)[0]


def encode_prompts(
    tokenizer, examples: list[Example], cfg: DataConfig, log: Callable[[str], None] = print
) -> list[list[int]]:
    """`encode_prompt` of each example; one line says how many were truncated, if any."""
    out, cut = [], 0
    for ex in examples:
        ids, truncated = _encode(tokenizer, ex, cfg, None, True)
        out.append(ids)
        cut += truncated
    if cut:
        log(
            f"data.max_prompt_tokens: {cut} of {len(examples)} prompts were longer than "
            f"{cfg.max_prompt_tokens} tokens; the front of their question text was cut "
            "(the chat template is kept whole)"
        )
    return out


def _encode(tokenizer, ex: Example, cfg: DataConfig, raw: bool | None, truncate: bool):
    """(token ids, whether the question was truncated to fit `max_prompt_tokens`)."""
    if raw_prompts(cfg) if raw is None else raw:
        return tokenizer.encode(ex.prompt, add_special_tokens=False), False

    def encode(question: str) -> list[int]:
        text = format_prompt(
            tokenizer, dataclasses.replace(ex, prompt=question), cfg.system_prompt, cfg.thinking
        )
        return tokenizer.encode(text, add_special_tokens=False)

    ids, limit = encode(ex.prompt), cfg.max_prompt_tokens
    if not truncate or len(ids) <= limit:
        return ids, False
    question = tokenizer.encode(ex.prompt, add_special_tokens=False)
    excess = len(ids) - limit
    while len(ids) > limit:  # token counts need not add up across the template: re-check
        keep = len(question) - excess
        if keep <= 0:
            raise ConfigError(
                f"data.max_prompt_tokens: {limit} leaves no room for the question: the chat "
                f"template and system prompt alone take {len(encode(''))} tokens"
            )
        ids = encode(tokenizer.decode(question[-keep:]))
        excess += max(len(ids) - limit, 0)
    return ids, True


def load_train_eval(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """The training examples and the held-out examples for the in-training eval (the module
    docstring says which); the held-out list's `source` says where it came from."""
    if is_generated(cfg):
        train = arithmetic_examples(cfg.num_train, seed=cfg.seed, split="train")
        held = (
            arithmetic_examples(cfg.num_eval, seed=cfg.seed, split="eval") if cfg.num_eval else []
        )
        if cfg.name == ARITHMETIC_CHAT:
            train, held = [as_question(e) for e in train], [as_question(e) for e in held]
        held = _examples(held, "" if held else "data.num_eval=0")
    else:
        from ebpo_lite.data import mathdata

        train = mathdata.load_examples(cfg)
        train, held = _held_out(cfg, train)
    if cfg.eval_path:
        held = _eval_file(cfg)
        train = _examples([e for e in train if e.prompt not in {h.prompt for h in held}], train)
    source = getattr(train, "source", "")
    if cfg.max_examples:
        train = train[: cfg.max_examples]
    if cfg.labels_path and cfg.labels_path != "auto":  # auto: made by the run (`labels.py`)
        from ebpo_lite.data import mathdata

        train = mathdata.apply_labels(train, cfg.labels_path)
    out = Examples(train)
    out.source = source
    return out, held


# ----------------------------------------------------------------------------- held-out split

AUTO_FRACTION, AUTO_MIN_ROWS = 0.1, 10  # data.eval_size=auto: 10%, from 10 rows on


def is_preset(cfg: DataConfig) -> bool:
    """A preset or a preset's hub dataset, not a file (`data.path`) or a hub dataset of one's own."""
    from ebpo_lite.presets import HUB, LOCAL_FILES

    repos = {repo for repo, _, _ in HUB.values()}
    name = cfg.name.partition(":")[0]
    return not cfg.path and (cfg.name in LOCAL_FILES or cfg.name in HUB or name in repos)


def _examples(items: list[Example], like: list | str) -> Examples:
    """`items` as Examples whose `source` is `like` (a string, or another list's source)."""
    out = Examples(items)
    out.source = like if isinstance(like, str) else getattr(like, "source", "")
    return out


def _held_out(cfg: DataConfig, rows: list[Example]) -> tuple[Examples, Examples]:
    """(training, held-out) of a loaded source by `data.eval_size` (see the module docstring)."""
    from ebpo_lite.data import mathdata

    size = parse_eval_size(cfg.eval_size)
    if cfg.eval_path:
        return _examples(rows, rows), _examples([], "")
    if size is None:
        test = mathdata.load_eval_examples(cfg)
        if test:
            return _examples(rows, rows), _examples(test, f"the preset's test set, {test.source}")
        if is_preset(cfg):  # its rows stay as they were: a benchmark, or a paper's training set
            why = (
                f"{cfg.name} has no test set here; data.eval_size or data.eval_path holds some out"
            )
            return _examples(rows, rows), _examples([], why)
    n = len(rows)
    if size is None and n < AUTO_MIN_ROWS:
        why = (
            f"{n} rows are too few for data.eval_size=auto, which holds out 10% from "
            f"{AUTO_MIN_ROWS} rows on; set data.eval_size=COUNT or data.eval_path"
        )
        return _examples(rows, rows), _examples([], why)
    if size is None:
        k, how = min(max(1, round(n * AUTO_FRACTION)), cfg.num_eval), "data.eval_size=auto"
    elif isinstance(size, float):
        k, how = max(1, round(n * size)), f"data.eval_size={cfg.eval_size}"
    else:
        k, how = size, f"data.eval_size={size}"
    if k == 0:
        return _examples(rows, rows), _examples([], f"{how}: none")
    if k >= n:
        raise ConfigError(
            f"data.eval_size: {cfg.eval_size} holds out {k} of the {n} examples, leaving none to "
            "train on; hold out fewer"
        )
    picked = set(random.Random(f"held-out-{cfg.seed}").sample(range(n), k))
    held = [rows[i] for i in sorted(picked)]
    prompts = {e.prompt for e in held}
    train = [e for i, e in enumerate(rows) if i not in picked and e.prompt not in prompts]
    dropped = n - k - len(train)
    what = f"{k} of {n} rows of {getattr(rows, 'source', '') or 'the data'}, {how}, data.seed {cfg.seed}"
    if dropped:
        what += f"; {dropped} training rows that repeat a held-out prompt dropped"
    return _examples(train, rows), _examples(held, what)


def _eval_file(cfg: DataConfig) -> Examples:
    """The examples of `data.eval_path`, read with the training data's mapping."""
    from pathlib import Path

    from ebpo_lite.data import mathdata

    path = Path(cfg.eval_path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise ConfigError(
            f"data.eval_path: {path} {what}; give a .json, .jsonl or .parquet file of held-out "
            "examples (null: none)"
        )
    held = mathdata.load_examples(dataclasses.replace(cfg, path=str(path), max_examples=0))
    return _examples(list(held), f"{path}, data.eval_path")


def describe_held(held: list[Example]) -> str:
    """Where the held-out examples came from (or why there are none), for the start-up line."""
    return getattr(held, "source", "")


def describe_source(cfg: DataConfig, examples: list[Example]) -> str:
    """Where the examples came from, for the run's start-up line."""
    if is_arithmetic(cfg):
        return "the built-in arithmetic task"
    if is_generated(cfg):
        return "the built-in arithmetic task, asked through the chat template"
    return str(getattr(examples, "source", None) or cfg.path or cfg.name)
