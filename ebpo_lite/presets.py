"""The tables behind `data.name` and the benchmarks: preset names, where each preset's files lie
under a local data folder (`data.data_dir` / EBPO_LITE_DATA, laid out as `LOCAL_FILES` below),
where each lies on the Hugging Face hub, and which held-out set goes with which training preset.

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
