"""A catalogue of user mistakes: each is one line on stderr, exit status 2, and leaves no trace.

One table, `MISTAKES`, across recipes, `key=value` overrides (unknown keys, wrong types, bad
choices, out-of-range numbers, incompatible combinations), data files, model names and paths, and
output directories. Every row runs `train.main` in-process and checks what a user sees and keeps:
- the return value is 2 and stderr is exactly one line, `error: ...`, without a traceback;
- the line names the culprit (the key, `file:line` or the path: `culprit`) and says what to do
  (`advice`);
- nothing is written anywhere: every mistake is caught before the output folder is made, so the
  whole test folder (a run folder with another run's checkpoints included) and the repository's
  `recipes/` and `runs/` are byte for byte as before.
All rows fail before the model loads (no tiny-model warm-up), so the table runs in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ebpo_lite import config
from tests.conftest import REPO

R = "recipes/tiny_cpu.yaml"


@dataclass(frozen=True)
class Mistake:
    id: str
    argv: tuple[str, ...]  # "{tmp}" is the test's folder; output_dir={tmp}/run unless given
    culprit: str  # the key, file:line or path, as the line must name it
    advice: str  # part of what the line says to do
    setup: Callable[[Path, pytest.MonkeyPatch], None] | None = None


# ----------------------------------------------------------------------------- setups


def _write(name: str, text: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)

    return setup


def _jsonl(name: str, *rows: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    return _write(name, "".join(r + "\n" for r in rows))


def _module(name: str, source: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """A Python module `name` on sys.path (a user's reward functions)."""

    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        (tmp / "py").mkdir(exist_ok=True)
        (tmp / "py" / f"{name}.py").write_text(source)
        mp.syspath_prepend(str(tmp / "py"))
        mp.delitem(sys.modules, name, raising=False)

    return setup


def _hide(module: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """The machine without `module` installed (an import of it then fails)."""

    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        mp.setitem(sys.modules, module, None)

    return setup


def _two_cores(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setattr("ebpo_lite.engine.checks.cpu_cores", lambda: 2)
    _hide("vllm")(tmp, mp)


def _offline(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """No network and downloads switched off, also for libraries that read the flag at import."""
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    for module, attr in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
    ):
        try:
            mp.setattr(f"{module}.{attr}", True)
        except (ImportError, AttributeError):
            pass


def set_hub_endpoint(mp: pytest.MonkeyPatch, url: str) -> None:
    """HF_ENDPOINT as huggingface_hub reads it at import: the endpoint and the file URL template."""
    mp.setattr("huggingface_hub.constants.ENDPOINT", url)
    template = url + "/{repo_id}/resolve/{revision}/{filename}"
    mp.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE", template)


def unreachable_hub(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """Downloads on, but no hub answers: HF_ENDPOINT at a closed local port (refused at once, as
    a machine without a route is)."""
    mp.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    set_hub_endpoint(mp, "http://127.0.0.1:9")
    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.delenv(flag, raising=False)
    mp.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


def _no_shared_data(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    (tmp / "nodata").mkdir()
    mp.setenv("EBPO_LITE_DATA", str(tmp / "nodata"))


def _both(*setups: Callable[[Path, pytest.MonkeyPatch], None]):
    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        for s in setups:
            s(tmp, mp)

    return setup


def _run_with_checkpoints(*recorded: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """`{tmp}/run` as another run left it: config.yaml (with `recorded` overrides), metrics and a
    complete-looking checkpoint `step_3`."""

    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        out = tmp / "run"
        step = out / "checkpoints" / "step_3"
        step.mkdir(parents=True)
        cfg = config.load(REPO / R, [f"output_dir={out}", *recorded])
        (out / "config.yaml").write_text(config.dump(cfg))
        (out / "metrics.jsonl").write_text(json.dumps({"step": 3, "train/loss": 0.1}) + "\n")
        (step / "adapter_config.json").write_text(json.dumps({"r": cfg.model.lora_rank}))
        for name in ("adapter_model.safetensors", "trainable.safetensors", "trainer_state.pt"):
            (step / name).write_bytes(os.urandom(256))
        (step / "prior.json").write_text("null")
        (step / "sampler.json").write_text("{}")

    return setup


def _file(name: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    return _write(name, "not a folder\n")


# ----------------------------------------------------------------------------- the table

MISTAKES = [
    # recipes
    Mistake("recipe_missing", ("{tmp}/nope.yaml",), "nope.yaml: recipe file not found", "give the path of a YAML recipe"),
    Mistake("recipe_is_a_folder", ("{tmp}",), "is a folder", "give the path of a YAML recipe"),
    Mistake("recipe_yaml_syntax", ("{tmp}/bad.yaml",), "bad.yaml:3: not valid YAML", "fix the indentation", _write("bad.yaml", "train:\n  steps: 3\n   lr: 1\n")),
    Mistake("recipe_top_level_list", ("{tmp}/list.yaml",), "list.yaml", "mapping of sections", _write("list.yaml", "- train\n- model\n")),
    Mistake("recipe_empty", ("{tmp}/empty.yaml",), "empty.yaml: the recipe is empty", "ebpo-lite recipes lists them", _write("empty.yaml", "# nothing yet\n")),
    Mistake("recipe_section_twice", ("{tmp}/r.yaml",), "r.yaml:4: 'train' is set a second time", "merge the two or delete one", _write("r.yaml", "train:\n  steps: 1\nmodel: {}\ntrain:\n  lr: 0.01\n")),
    Mistake("recipe_key_twice", ("{tmp}/r.yaml",), "r.yaml:3: 'steps' is set a second time", "merge the two", _write("r.yaml", "train:\n  steps: 1\n  steps: 2\n")),
    Mistake("recipe_unknown_key", ("{tmp}/r.yaml",), "train.stepz: unknown key", "did you mean train.steps", _write("r.yaml", "train:\n  stepz: 3\n")),
    Mistake("recipe_wrong_type", ("{tmp}/r.yaml",), "train.lr", "expected a float", _write("r.yaml", "train:\n  lr: fast\n")),
    # overrides: syntax, unknown names, types
    Mistake("override_without_equals", (R, "train"), "train", "key=value"),
    Mistake("unknown_key", (R, "train.stepz=3"), "train.stepz: unknown key", "did you mean train.steps"),
    Mistake("unknown_section", (R, "trainer.steps=3"), "trainer: unknown section", "did you mean train"),
    Mistake("value_used_as_section", (R, "train.steps.x=1"), "train.steps.x", "write train.steps=VALUE"),
    Mistake("section_given_a_value", (R, "train=3"), "train:", "set its keys one by one"),
    Mistake("int_wrong_type", (R, "train.steps=abc"), "train.steps", "expected an integer"),
    Mistake("float_wrong_type", (R, "train.lr=fast"), "train.lr", "expected a float"),
    Mistake("bool_wrong_type", (R, "train.resume=maybe"), "train.resume", "expected true or false"),
    Mistake("list_expected", (R, "train.betas=0.9"), "train.betas", "expected a list"),
    Mistake("list_element_type", (R, "reward.weights=[x]"), "reward.weights[0]", "expected a float"),
    # overrides: choices
    Mistake("bad_estimator", (R, "algo.estimator=ppo"), "algo.estimator", "expected one of grpo, dr_grpo, rloo, ebpo"),
    Mistake("bad_sampler", (R, "curriculum.sampler=random"), "curriculum.sampler", "expected one of shuffle"),
    Mistake("bad_backend", (R, "rollout.backend=sglang"), "rollout.backend", "expected one of hf, vllm"),
    Mistake("bad_loss_agg", (R, "algo.loss_agg=mean"), "algo.loss_agg", "expected one of token_mean"),
    Mistake("old_loss_agg_name", (R, "algo.loss_agg=dr_grpo"), "algo.loss_agg", "is now 'token_sum_norm'"),
    Mistake("bad_dtype", (R, "model.dtype=fp16"), "model.dtype", "expected one of auto, float32"),
    Mistake("bad_preset", (R, "data.preset=bogus"), "data.preset", "expected one of auto, generic"),
    Mistake("bad_benchmark", (R, "eval.benchmarks=[math501]"), "eval.benchmarks", "did you mean math500"),
    # overrides: ranges
    Mistake("group_size_1", (R, "rollout.group_size=1"), "rollout.group_size", "must be >= 2"),
    Mistake("lr_zero", (R, "train.lr=0"), "train.lr", "must be > 0"),
    Mistake("temperature_zero", (R, "rollout.temperature=0"), "rollout.temperature", "must be > 0"),
    Mistake("top_p_above_1", (R, "rollout.top_p=1.5"), "rollout.top_p", "must be in (0, 1]"),
    Mistake("clip_eps_negative", (R, "algo.clip_eps_low=-0.1"), "algo.clip_eps_low", "must be >= 0"),
    Mistake("decay_1", (R, "algo.decay=1.0"), "algo.decay", "must be in (0, 1)"),
    Mistake("keep_checkpoints_0", (R, "train.keep_checkpoints=0"), "train.keep_checkpoints", "must be >= 1"),
    Mistake("beta_1_5", (R, "train.betas=[0.9,1.5]"), "train.betas", "two numbers in [0, 1)"),
    # overrides: combinations, and the config against this machine
    Mistake("weights_per_function", (R, "reward.weights=[1,2]"), "reward.weights", "one per reward.functions"),
    Mistake("prompt_prior_needs_ebpo", (R, "algo.estimator=grpo", "algo.prompt_prior=true"), "algo.prompt_prior", "set algo.estimator=ebpo"),
    Mistake("resume_and_overwrite", (R, "train.resume=true", "train.overwrite=true"), "train.overwrite", "not both"),
    Mistake("threads_above_cores", (R, "train.threads=100000"), "train.threads", "use at most train.threads="),
    Mistake("vllm_cpu_all_threads", (R, "rollout.backend=vllm", "model.device=cpu", "train.threads=2"), "train.threads", "use train.threads=1", _two_cores),
    Mistake("vllm_not_installed", (R, "rollout.backend=vllm", "model.device=cpu", "train.threads=1"), "rollout.backend=vllm", "use rollout.backend=hf", _two_cores),
    Mistake("four_bit_without_bitsandbytes", (R, "model.load_in_4bit=true"), "model.load_in_4bit", "model.load_in_4bit=false", _hide("bitsandbytes")),
    Mistake("unknown_reward", (R, "reward.functions=[nope]"), "reward.functions", "expected one of math_answer"),
    Mistake("reward_module_missing", (R, "reward.functions=[no_such_module_x:score]"), "no_such_module_x", "PYTHONPATH"),
    Mistake("reward_function_missing", (R, "reward.functions=[os:no_such_fn]"), "no_such_fn", "name a function"),
    Mistake("topic_field_missing", (R, "data.path={tmp}/d.jsonl", "data.topic_field=area"), "d.jsonl:1: area: missing field", "fix the row", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2"}')),
    Mistake("difficulty_field_not_a_number", (R, "data.path={tmp}/d.jsonl", "data.difficulty_field=level"), "d.jsonl:1: level: expected a number or 'Level N'", "fix the row", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2", "level": "hard"}')),
    Mistake("topic_sampler_without_topics", (R, "data.path={tmp}/d.jsonl", "curriculum.sampler=topic"), "curriculum.sampler: topic needs a topic per example", "data.topic_field, or data.labels_path=auto", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2"}', '{"problem": "2+2?", "answer": "4"}')),
    Mistake("difficulty_sampler_without_levels", (R, "data.path={tmp}/d.jsonl", "curriculum.sampler=difficulty"), "curriculum.sampler: difficulty needs a difficulty", "set curriculum.sampler=shuffle", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2"}', '{"problem": "2+2?", "answer": "4"}')),
    Mistake("reward_reads_a_missing_column", (R, "data.path={tmp}/d.jsonl", "reward.functions=[mistake_rewards:by_source]"), "reward.functions: mistake_rewards:by_source reads 'source'", "add the field to every row", _both(_jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2", "level": 1}'), _module("mistake_rewards", "def by_source(completions, source, **columns):\n    return [0.0] * len(completions)\n"))),
    # data files
    Mistake("data_file_missing", (R, "data.path={tmp}/missing.jsonl"), "missing.jsonl: data file not found", "check data.path"),
    Mistake("data_path_is_a_folder", (R, "data.path={tmp}"), "is a folder", "set data.path to a .json"),
    Mistake("data_file_type", (R, "data.path={tmp}/d.csv"), "d.csv", "use .json, .jsonl or .parquet", _write("d.csv", "problem,answer\n")),
    Mistake("data_file_empty", (R, "data.path={tmp}/empty.jsonl"), "empty.jsonl: no records", "one JSON object per line", _write("empty.jsonl", "")),
    Mistake("data_bad_json_line", (R, "data.path={tmp}/d.jsonl"), "d.jsonl:2: invalid JSON", "data.skip_bad_rows=true", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2"}', '{"problem": "2+2?", "answer": 4')),
    Mistake("data_bad_json_array", (R, "data.path={tmp}/d.json"), "d.json:3: invalid JSON", "fix the file there", _write("d.json", '[\n  {"problem": "1+1?", "answer": "2"},\n  {"problem": "2+2?" "answer": "4"}\n]\n')),
    Mistake("data_missing_answer", (R, "data.path={tmp}/d.jsonl", "data.preset=math"), "d.jsonl:1: answer: missing field", "fix the row", _jsonl("d.jsonl", '{"problem": "1+1?", "solution": "2"}')),
    Mistake("data_wrong_type", (R, "data.path={tmp}/d.jsonl"), "d.jsonl:2: problem: expected a string", "fix the row", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2"}', '{"problem": 42, "answer": "2"}')),
    Mistake("data_record_not_object", (R, "data.path={tmp}/d.jsonl", "data.preset=math"), "d.jsonl:2: record: expected a JSON object", "fix the row", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2"}', '"1+1=2"')),
    Mistake("data_all_answers_null", (R, "data.path={tmp}/d.jsonl"), "d.jsonl: no usable examples", "data.answer_field", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": null}')),
    Mistake("data_schema_unknown", (R, "data.path={tmp}/d.jsonl"), "d.jsonl: cannot guess the schema", "set data.preset", _jsonl("d.jsonl", '{"q": "1+1?", "a": "2"}')),
    Mistake("data_generic_field_missing", (R, "data.path={tmp}/d.jsonl", "data.prompt_field=text", "data.answer_field=gold"), "d.jsonl:1: text: missing field", "fix the row", _jsonl("d.jsonl", '{"problem": "1+1?", "answer": "2"}')),
    Mistake("labels_missing", (R, "data.labels_path={tmp}/labels.jsonl"), "data.labels_path", f"ebpo-lite label difficulty {R} --out {{tmp}}/labels.jsonl", None),
    Mistake("labels_missing_topic", (R, "curriculum.sampler=topic", "data.labels_path={tmp}/t.jsonl"), "data.labels_path", f"ebpo-lite label topics {R} curriculum.sampler=topic --out {{tmp}}/t.jsonl", None),
    Mistake("preset_without_shared_data", (R, "data.name=aime"), "data.name", "set EBPO_LITE_DATA", _no_shared_data),
    Mistake("preset_offline_without_local_copy", (R, "data.name=gsm8k"), "openai/gsm8k", "folder holding gsm8k/train.jsonl", _both(_no_shared_data, _offline)),
    Mistake("hub_dataset_offline", (R, "data.name=nobody/no-such-dataset"), "data.name", "set data.path", _offline),
    Mistake("wandb_not_installed", (R, "log.wandb=true"), "log.wandb", 'pip install "ebpo-lite[wandb]"', _hide("wandb")),
    Mistake("tensorboard_not_installed", (R, "log.tensorboard=true"), "log.tensorboard", 'pip install "ebpo-lite[tensorboard]"', _hide("tensorboard")),
    # model names and paths
    Mistake("model_path_missing", (R, "model.name=/nonexistent/model"), "/nonexistent/model: no such folder", "a hub id such as"),
    Mistake("model_folder_without_config", (R, "model.name={tmp}/weights"), "has no config.json", "folder save_pretrained wrote", _write("weights/model.safetensors", "x")),
    Mistake("model_path_is_a_file", (R, "model.name={tmp}/model.bin"), "model.bin is a file", "holds config.json", _file("model.bin")),
    Mistake("model_name_invalid", (R, "model.name=not@a@model"), "not@a@model", "give owner/name"),
    Mistake("model_hub_id_offline", (R, "model.name=nobody/no-such-model"), "nobody/no-such-model", "HF_HUB_OFFLINE", _offline),
    Mistake("model_hub_id_no_network", (R, "model.name=nobody/no-such-model"), "model.name: nobody/no-such-model", "connect to the network", unreachable_hub),
    # output directories
    Mistake("output_dir_not_writable", (R, "output_dir=/proc/ebpo_lite_forbidden/run"), "/proc/ebpo_lite_forbidden/run", "pick a folder you can write to"),
    Mistake("output_dir_is_a_file", (R, "output_dir={tmp}/taken"), "{tmp}/taken is a file", "pick another output_dir", _file("taken")),
    Mistake("output_dir_inside_a_file", (R, "output_dir={tmp}/taken/run"), "{tmp}/taken is a file", "pick another output_dir", _file("taken")),
    Mistake("output_dir_holds_another_run", (R,), "{tmp}/run already holds checkpoints (newest step_3)", "train.resume=true", _run_with_checkpoints()),
    Mistake("resume_other_lora_rank", (R, "train.resume=true"), "model.lora_rank: 16 differs", "resume with model.lora_rank=8", _run_with_checkpoints("model.lora_rank=8")),
    Mistake("resume_other_sampler", (R, "train.resume=true", "curriculum.sampler=topic"), "curriculum.sampler: topic differs", "or pick another output_dir", _run_with_checkpoints()),
    Mistake("override_list_unclosed", (R, "model.trainable_extra=[norm"), "model.trainable_extra: '[norm' is not a valid list", "model.trainable_extra=[a,b]"),
    Mistake("resume_other_lora_alpha", (R, "train.resume=true"), "model.lora_alpha: 32 differs", "resume with model.lora_alpha=64", _run_with_checkpoints("model.lora_alpha=64")),
    Mistake("resume_other_data_seed", (R, "train.resume=true"), "data.seed: 1234 differs", "resume with data.seed=7", _run_with_checkpoints("data.seed=7")),
    Mistake("resume_other_warmup", (R, "train.resume=true", "model.sft_warmup_steps=30"), "model.sft_warmup_steps: 30 differs", "resume with model.sft_warmup_steps=3000", _run_with_checkpoints()),
    Mistake("resume_fewer_steps", (R, "train.resume=true", "train.steps=2"), "train.steps: 2 is below the 3 steps", "resume with train.steps=3 or more", _run_with_checkpoints()),
]  # fmt: skip

_NEED_CPU_ONLY = {"model_device_cuda", "flash_attention_on_cpu", "unsloth_on_cpu", "nf4_vllm_recipe_on_cpu"}  # fmt: skip
_CPU_ONLY = [
    Mistake("model_device_cuda", (R, "model.device=cuda"), "model.device", "use model.device=cpu or auto"),
    Mistake("flash_attention_on_cpu", (R, "model.attn_implementation=flash_attention_2"), "model.attn_implementation", "use sdpa"),
    Mistake("unsloth_on_cpu", (R, "rollout.backend=unsloth"), "rollout.backend: unsloth needs a CUDA GPU", "use rollout.backend=hf"),
    Mistake("nf4_vllm_recipe_on_cpu", ("recipes/qwen3_8b_lora.yaml",), "model.load_in_4bit: Qwen/Qwen3-8B", "run it on a CUDA GPU"),
]  # fmt: skip


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a folder)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
    }


def _stat_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and mtime (the repository's folders can be big)."""
    if not root.exists():
        return {}
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _argv(m: Mistake, tmp: Path) -> list[str]:
    argv = [a.replace("{tmp}", str(tmp)) for a in m.argv]
    if not any(a.startswith("output_dir=") for a in argv):
        argv.append(f"output_dir={tmp / 'run'}")
    return argv


def test_the_catalogue_is_large_and_distinct():
    ids = [m.id for m in MISTAKES + _CPU_ONLY]
    assert len(ids) == len(set(ids)) and len(MISTAKES) >= 30


@pytest.mark.parametrize("m", MISTAKES + _CPU_ONLY, ids=lambda m: m.id)
def test_mistake_is_one_line_exit_2_and_leaves_no_trace(m, capsys, monkeypatch, tmp_path):
    from ebpo_lite.train import main

    if m.id in _NEED_CPU_ONLY and _cuda():
        pytest.skip("needs a machine without CUDA")
    monkeypatch.chdir(REPO)
    if m.setup is not None:
        m.setup(tmp_path, monkeypatch)
    before, repo_before = _tree(tmp_path), [_stat_tree(REPO / d) for d in ("recipes", "runs")]
    capsys.readouterr()
    assert main(_argv(m, tmp_path)) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    line, culprit = lines[0], m.culprit.replace("{tmp}", str(tmp_path))
    advice = m.advice.replace("{tmp}", str(tmp_path))
    assert "Traceback" not in err
    assert culprit in line, line
    assert advice in line, line
    assert len(line) > len("error: ") + len(culprit) + len(advice), line  # says more than both
    assert _tree(tmp_path) == before  # no folder made, no checkpoint of another run touched
    assert [_stat_tree(REPO / d) for d in ("recipes", "runs")] == repo_before


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ebpo_lite.train", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_process_exit_status_for_a_bad_data_line_and_another_runs_folder(tmp_path, monkeypatch):
    """The real process: status 2, one line, no traceback; the other run's folder as it was."""
    bad = {m.id: m for m in MISTAKES}["data_bad_json_line"]
    bad.setup(tmp_path, monkeypatch)
    r = _cli(*_argv(bad, tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == r.stderr.strip().splitlines()[0]
    assert f"{tmp_path}/d.jsonl:2: invalid JSON" in r.stderr
    _run_with_checkpoints()(tmp_path, monkeypatch)
    before = _tree(tmp_path)
    r = _cli(R, f"output_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: output_dir:") and len(r.stderr.strip().splitlines()) == 1
    assert _tree(tmp_path) == before
