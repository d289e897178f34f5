"""The tables behind `data.name` and the benchmarks: preset names, where each preset's files lie
under the shared data folder, hub ids, and which held-out set goes with which training preset.

A leaf module (no imports), so the config, the loaders and the eval can all read it.
"""

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
HUB_IDS = {  # preset name -> hub id (used when the local copy is absent)
    "gsm8k": "openai/gsm8k:main",
    "math500": "HuggingFaceH4/MATH-500",
    "dapo_math": "BytedTsinghua-SIA/DAPO-Math-17k",
    "deepscaler": "agentica-org/DeepScaleR-Preview-Dataset",
}
HUB_CONFIGS = {"openai/gsm8k": "main"}
HUB_SPLITS = {"math500": "test"}  # hub copies that only have a test split
BENCHMARKS = {  # name -> (file under the data root, preset)
    "math500": ("math500/test.jsonl", "math500"),
    "aime24": ("aime24/test.jsonl", "aime"),
    "aime25": ("aime25/test.jsonl", "aime"),
    "amc23": ("amc23/test.jsonl", "amc23"),
    "olympiadbench": ("olympiadbench/test.jsonl", "olympiadbench"),
    "gsm8k": ("gsm8k/test.jsonl", "gsm8k"),
}
EVAL_FOR = {"gsm8k": "gsm8k", "math": "math500", "aime": "aime24"}  # preset -> held-out set
