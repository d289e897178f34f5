"""The Python API (ebpo_lite/api.py, docs/python.md): the names a notebook imports, a config
loaded or made in code with the command line's checks, mistakes raised as one-line errors,
library chatter silenced for the call only, and the example script run end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ebpo_lite
from ebpo_lite import api, cli, config
from ebpo_lite import eval as eval_command
from ebpo_lite.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_data.py"
DOC = REPO / "docs" / "python.md"
# what the libraries print when nothing silences them (seen from train.train called directly)
CHATTER = (
    "Failed to load CPU gemm_4bit_forward",  # bitsandbytes 0.50.2, backends/cpu/ops.py
    "Loading weights",  # transformers' load bar
    "Writing model shards",  # transformers' save bar (the tiny warm-up's first save)
    "FutureWarning",  # e.g. transformers' is_gradient_checkpointing deprecation
)


def _python(code: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **env},
    )


# ----------------------------------------------------------------------------- names


def test_the_api_names_import_from_the_package_without_torch():
    """`from ebpo_lite import ...` gives every name; none imports torch until it is called."""
    code = (
        "import sys\n"
        "from ebpo_lite import (load_config, train_run, evaluate, export_run, TrainResult,\n"
        "    Config, TrainConfig, DataConfig, RewardConfig, ConfigError, UserError)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"


def test_the_train_and_export_modules_do_not_shadow_the_functions():
    """Importing `ebpo_lite.train` sets the package attribute `train` to that module: the API's
    names differ from the modules', so they stay the functions whatever was imported."""
    import ebpo_lite.commands.export
    import ebpo_lite.train  # noqa: F401

    assert ebpo_lite.train_run is api.train_run and ebpo_lite.export_run is api.export_run
    assert set(ebpo_lite.__all__) <= set(dir(ebpo_lite))


def test_every_name_the_python_page_documents_exists():
    """docs/python.md names `ebpo_lite.X` and `from ebpo_lite import X, Y`; each must import."""
    text = DOC.read_text()
    names = set(re.findall(r"\bebpo_lite\.([A-Za-z_]\w*)", text))
    for paren, line in re.findall(r"from ebpo_lite import (?:\(([^)]*)\)|([^\n(]+))", text):
        names |= set(re.findall(r"\w+", paren or line))
    modules = {p.stem for p in (REPO / "ebpo_lite").glob("*.py")}
    modules |= {p.parent.name for p in (REPO / "ebpo_lite").glob("*/__init__.py")}  # commands/
    assert {"load_config", "train_run", "evaluate", "export_run"} <= names
    missing = [n for n in sorted(names) if n not in modules and not hasattr(ebpo_lite, n)]
    assert not missing, f"docs/python.md names what ebpo_lite does not have: {missing}"
    # every public name of the API module is on the page
    public = {n for n in ebpo_lite.__all__ if getattr(ebpo_lite, n).__module__ == "ebpo_lite.api"}
    missing = public - set(re.findall(r"\w+", text))
    assert not missing, f"not documented in docs/python.md: {sorted(missing)}"


# ----------------------------------------------------------------------------- config


def test_load_config_takes_sections_as_python_values(tmp_path):
    """Sections as dicts of Python values, then overrides (which win), through the command
    line's parser: floats, paths, lists, None and strings with YAML's special characters come
    through exactly, and the overrides are recorded as the command that would repeat them."""
    text = 'Answer: "with a colon", # no comment\nsecond line'
    cfg = api.load_config(
        "tiny_cpu",
        ["train.steps=7"],
        output_dir=tmp_path / "run",
        train={"steps": 5, "lr": 1e-4, "betas": (0.8, 0.99)},
        data={"system_prompt": text, "labels_path": None, "max_examples": 50},
        reward={"functions": ["my_rewards:score"]},
    )
    assert cfg.output_dir == str(tmp_path / "run")
    assert (cfg.train.steps, cfg.train.lr, cfg.train.betas) == (7, 1e-4, [0.8, 0.99])
    assert cfg.data.system_prompt == text and cfg.data.labels_path is None
    assert cfg.reward.functions == ["my_rewards:score"]
    assert cfg.model.sft_warmup_steps == 3000  # the recipe's, untouched
    recipe, overrides = config.origin(cfg)
    assert recipe == "tiny_cpu" and overrides[-1] == "train.steps=7"
    assert "train.steps=5" in overrides


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"train": {"stepz": 5}}, "train.stepz: unknown key"),
        ({"train": {"lr": "fast"}}, "train.lr: expected a float"),
        ({"trian": {"steps": 5}}, "trian: unknown section"),
        ({"reward": {"functions": [len]}}, "reward.functions: got a Python function"),
        ({"train": {"steps": object()}}, "train.steps: <object"),
        ({"overrides": "train.steps=5"}, "overrides: expected a list"),
        ({"overrides": ["train.steps"]}, "train.steps: overrides are written key=value"),
    ],
)
def test_load_config_mistakes_raise_one_line(kwargs, key):
    with pytest.raises(ConfigError) as info:
        api.load_config("tiny_cpu", **kwargs)
    assert str(info.value).startswith(key), str(info.value)
    assert "\n" not in str(info.value)


def test_a_config_made_in_code_is_checked_before_anything_is_written(tmp_path):
    """`Config(...)` and `dataclasses.replace` skip `config.load`; `train_run` checks them as a
    loaded config is checked, and the mistake is raised before the run folder exists."""
    out = tmp_path / "run"
    bad = config.Config(output_dir=str(out), train=config.TrainConfig(steps=-1))
    with pytest.raises(ConfigError, match=r"^train\.steps"):
        api.train_run(bad)
    loaded = api.load_config("tiny_cpu", output_dir=out)
    typo = dataclasses.replace(loaded, train=dataclasses.replace(loaded.train, lr="fast"))
    with pytest.raises(ConfigError, match=r"^train\.lr: expected a float"):
        api.train_run(typo)
    with pytest.raises(ConfigError, match=r"^config: expected an ebpo_lite Config"):
        api.train_run({"train": {"steps": 3}})
    assert not out.exists()
    # a good one comes back equal, recorded as the keys that differ from the defaults
    good = config.Config(output_dir=str(out), train=config.TrainConfig(steps=5, lr=1))
    checked = api._checked(good)
    assert checked == dataclasses.replace(good, train=config.TrainConfig(steps=5, lr=1.0))
    assert config.origin(checked) == (None, (f"output_dir={out}", "train.steps=5", "train.lr=1"))


def test_evaluate_passes_what_the_command_line_passes(monkeypatch):
    """`evaluate(...)`'s defaults are `ebpo-lite eval`'s, and each keyword is its flag: the
    Namespace both hand to `eval.evaluate` is the same (a drift in either fails here)."""
    seen = []
    monkeypatch.setattr(eval_command, "evaluate", lambda args: seen.append(vars(args)) or {})
    monkeypatch.setattr(cli, "quiet_libraries", lambda: None)  # the test process's own settings
    assert eval_command.main(["runs/x"]) == 0
    api.evaluate("runs/x")
    argv = ["runs/x", "train.seed=1", "--benchmark", "a.jsonl", "--k", "4", "--top-p", "0.9"]
    argv += ["--temperature", "0.7", "--max-new-tokens", "9", "--limit", "3", "--out", "o.json"]
    argv += ["--backend", "hf", "--batch-size", "2", "--seed", "5"]
    assert eval_command.main(argv) == 0
    api.evaluate(
        Path("runs/x"),
        "a.jsonl",
        overrides=["train.seed=1"],
        k=4,
        top_p=0.9,
        temperature=0.7,
        max_new_tokens=9,
        limit=3,
        out=Path("o.json"),
        backend="hf",
        batch_size=2,
        seed=5,
    )
    assert seen[0] == seen[1] and seen[2] == seen[3], seen
    with pytest.raises(UserError, match="^evaluate: k must be an integer, got '4'"):
        api.evaluate("runs/x", k="4")


def test_export_run_raises_instead_of_exiting(tmp_path):
    with pytest.raises(UserError, match="no config.yaml; not a training output_dir"):
        api.export_run(tmp_path)


# ----------------------------------------------------------------------------- chatter


def test_quieted_silences_for_the_call_and_restores_the_callers_settings():
    """Inside `cli.quieted()` a FutureWarning and a bitsandbytes warning are silent; after it,
    the caller's warning filters, logging level, transformers verbosity and bars are back."""
    code = (
        "import logging, warnings\n"
        "from transformers.utils import logging as hf_logging\n"
        "from ebpo_lite import cli\n"
        "warnings.simplefilter('always')\n"
        "logging.getLogger('bitsandbytes').setLevel(logging.DEBUG)\n"
        "hf_logging.set_verbosity_info()\n"
        "before = (list(warnings.filters), hf_logging.get_verbosity(),\n"
        "          hf_logging.is_progress_bar_enabled())\n"
        "with cli.quieted():\n"
        "    warnings.warn('inside-future', FutureWarning)\n"
        "    logging.getLogger('bitsandbytes.backends.cpu.ops').warning('inside-bnb')\n"
        "assert (list(warnings.filters), hf_logging.get_verbosity(),\n"
        "        hf_logging.is_progress_bar_enabled()) == before\n"
        "assert logging.getLogger('bitsandbytes').level == logging.DEBUG\n"
        "warnings.warn('after-future', FutureWarning)\n"
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('after-bnb')\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "inside" not in proc.stderr, proc.stderr
    assert "after-future" in proc.stderr and "after-bnb" in proc.stderr, proc.stderr


def test_train_run_and_export_run_are_as_quiet_as_the_command_line(tmp_path):
    """A run and an export through the API print none of the known chatter, while loading the
    same policy directly afterwards, in the same process, shows it (this stack does chatter)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tests.conftest import fast_overrides\n"
        "from ebpo_lite import export_run, load_config, train_run\n"
        f"out = Path({str(tmp_path)!r})\n"
        "over = {'train.steps': 1, 'eval.num_examples': 4}\n"
        "cfg = load_config('tiny_cpu', fast_overrides(out / 'api', **over))\n"
        "export_run(train_run(cfg))\n"
        "print('=== direct', file=sys.stderr, flush=True)\n"
        "from ebpo_lite.engine.run import load_policy\n"
        "load_policy(cfg)\n"
    )
    proc = _python(code, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    quiet, direct = proc.stderr.split("=== direct")
    assert "Loading weights" in direct, direct  # the control: unsilenced, transformers chatters
    heard = [c for c in CHATTER if c in quiet + proc.stdout]
    assert not heard, quiet
    assert (tmp_path / "api" / "export" / "adapter_model.safetensors").is_file()


@pytest.mark.slow  # 116 s on a busy 2-core host with a warm cache (3,000-step tiny warm-up)
def test_the_example_script_trains_evaluates_and_exports(tmp_path):
    """examples/custom_data.py, run as a user runs it: its held-out before -> after line, the
    same number from `evaluate`, no library chatter from the API calls, and an export that
    loads back with peft and answers as the script says it does."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in order: the API calls' part is what is checked
        text=True,
        timeout=1200,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    text = proc.stdout
    assert "240 rows" in text and "48 held out for the eval" in text, text[:2000]
    line = re.search(r"^eval/accuracy \(greedy\): (\d\.\d+) -> (\d\.\d+)", text, re.M)
    assert line, text[-3000:]
    assert f"held-out accuracy: {line[1]} -> {line[2]}" in text
    after = float(line[2])
    result = json.loads((out / "eval.json").read_text())["benchmarks"]["held-out"]
    assert result["num_problems"] == 48
    assert abs(result["pass@1"] - after) <= 1 / 48 + 1e-9  # the same greedy eval, batched anew
    folder = out / "export"
    api_part, _, users_part = text.partition(f"exported: {folder}\n")  # then the script's own
    assert users_part, text[-2000:]
    assert not [c for c in CHATTER if c in api_part], api_part
    # the export, loaded here as the model card says, answers as the script printed
    answer = re.search(r"47\+38= -> (\S*)$", users_part, re.M)
    assert answer, users_part
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    ids = torch.tensor([tokenizer.encode("47+38=", add_special_tokens=False)])
    got = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert tokenizer.decode(got, skip_special_tokens=True).strip() == answer[1]


# ----------------------------------------------------------------------------- run again


def test_resume_or_new_continues_or_starts_beside_never_refuses(tmp_path):
    """A notebook's train cell run twice (issue 38 item 8: it stopped with 'output_dir already
    holds checkpoints'): the same settings continue the run; a setting resume cannot change
    starts a new run beside it; RESUME=False always does; each says so in one line."""
    from tests.conftest import TINY_RECIPE, fast_overrides

    out = tmp_path / "run"
    lines: list[str] = []
    first = api.resume_or_new(config.load(TINY_RECIPE, fast_overrides(out)), log=lines.append)
    assert first.output_dir == str(out) and not first.train.resume
    assert lines == [f"run folder: {out} (a new run)"]
    api.train_run(dataclasses.replace(first, train=dataclasses.replace(first.train, steps=1)))
    with pytest.raises(ConfigError, match="already holds checkpoints"):  # what the cell did
        api.train_run(config.load(TINY_RECIPE, fast_overrides(out)))

    again = api.resume_or_new(config.load(TINY_RECIPE, fast_overrides(out)), log=lines.append)
    assert again.output_dir == str(out) and again.train.resume
    assert lines[-1] == f"run folder: continuing {out} from step_1 (resume=False starts a new run)"
    changed = config.load(TINY_RECIPE, fast_overrides(out, **{"model.lora_rank": 4}))
    beside = api.resume_or_new(changed, log=lines.append)
    assert beside.output_dir == f"{out}-2" and not beside.train.resume
    assert lines[-1].startswith(f"run folder: a new run in {out}-2, since {out} holds a run")
    assert "model.lora_rank" in lines[-1] and "\n" not in lines[-1]
    with pytest.raises(ConfigError, match="model.lora_rank"):
        api.resume_or_new(changed, resume=True)
    new = api.resume_or_new(config.load(TINY_RECIPE, fast_overrides(out)), resume=False, log=print)
    assert new.output_dir == f"{out}-2" and not new.train.resume


@pytest.mark.parametrize("name", ["colab_qwen3_gsm8k", "kaggle_qwen3_math"])
def test_the_gpu_notebooks_train_cell_runs_again(name):
    """Their train cell goes through resume_or_new and hands its folder to the cells below."""
    book = json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())
    cells = ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]
    (train_cell,) = [c for c in cells if "summary = train(cfg)" in c]
    assert "resume_or_new(" in train_cell and "OUT = cfg.output_dir" in train_cell
