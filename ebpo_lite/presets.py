"""The tables behind `data.name` and the benchmarks: preset names, where each preset's files lie
under a local data folder (`data.data_dir` / EBPO_LITE_DATA, laid out as `LOCAL_FILES` below),
where each lies on the Hugging Face hub, and which held-out set goes with which training preset.

A leaf module (it imports only `errors`), so the config, the loaders and the eval can all read it;
the held-out rules the config checks (`data.eval_size`, `data.eval_path`) are here too.
"""

import re
from typing import Any

from ebpo_lite.errors import ConfigError

PRESETS = tuple(
    "auto generic gsm8k math math500 aime amc23 olympiadbench dapo_math deepscaler".split()
)
# preset name used as data.name -> (split -> file under the data root); "*" = any split
LOCAL_FILES = {
    "gsm8k": {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"},
    "math": {"train": "math_train/math.json", "test": "math500/test.jsonl"},
    "math500": {"*": "math500/test.jsonl"},
    "aime": {"train": "aime_1983_2023/aime.json", "test": "aime24/test.jsonl"},
    "aime24": {"*": "aime24/test.jsonl"},
    "aime25": {"*": "aime25/test.jsonl"},
    "amc23": {"*": "amc23/test.jsonl"},
    "olympiadbench": {"*": "olympiadbench/test.jsonl"},
}
# data set name -> (hub repo, config, split; None: data.split), read when no local copy is set up
HUB = {
    "gsm8k": ("openai/gsm8k", "main", None),
    "math": ("DigitalLearningGmbH/MATH-lighteval", "default", None),  # answers: solution's box
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "aime25": ("yentinglin/aime_2025", None, "train"),
    "amc23": ("math-ai/amc23", None, "test"),
    "olympiadbench": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
    "dapo_math": ("BytedTsinghua-SIA/DAPO-Math-17k", None, None),
    "deepscaler": ("agentica-org/DeepScaleR-Preview-Dataset", None, None),
}
HUB_CONFIGS = {"openai/gsm8k": "main"}  # a hub id given as data.name gets its config
BENCHMARKS = {  # name -> (file under the data root, preset, hub split)
    "math500": ("math500/test.jsonl", "math500", "test"),
    "aime24": ("aime24/test.jsonl", "aime", "train"),
    "aime25": ("aime25/test.jsonl", "aime", "train"),
    "amc23": ("amc23/test.jsonl", "amc23", "test"),
    "olympiadbench": ("olympiadbench/test.jsonl", "olympiadbench", "train"),
    "gsm8k": ("gsm8k/test.jsonl", "gsm8k", "test"),
}
EVAL_FOR = {"gsm8k": "gsm8k", "math": "math500", "aime": "aime24"}  # preset -> held-out set


def parse_eval_size(value: str) -> float | int | None:
    """`data.eval_size` as a fraction (float in (0, 1)), a count (int >= 0), or None (auto)."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if re.fullmatch(r"\d+", text):
        return int(text)
    try:
        frac = float(text)
    except ValueError:
        frac = None
    if frac is None or frac < 0:
        raise ConfigError(
            f"data.eval_size: expected auto, a fraction in (0, 1) or a count >= 0, got {value!r}"
        )
    if not 0 < frac < 1:
        raise ConfigError(
            f"data.eval_size: a fraction must be in (0, 1), got {value!r}; write a count "
            "without a decimal point (data.eval_size=50)"
        )
    return frac


def check_held_out(cfg: Any) -> None:
    """`data.eval_size` / `data.eval_path`: each well formed, and not set against each other or
    against the built-in task (config validation: one line naming the key)."""
    size = parse_eval_size(cfg.eval_size)
    if size is not None and cfg.eval_path:
        raise ConfigError(
            f"data.eval_size: {cfg.eval_size} together with data.eval_path; hold rows out of the "
            "training data (eval_size) or read them from a file (eval_path), not both"
        )
    if size is not None and cfg.name in ("arithmetic", "arithmetic_chat") and cfg.path is None:
        raise ConfigError(
            f"data.eval_size: the built-in {cfg.name} task holds out its own problems; set "
            "data.num_eval instead"
        )
    if cfg.eval_path is not None and not cfg.eval_path.strip():
        raise ConfigError("data.eval_path: must not be empty (null: none)")
