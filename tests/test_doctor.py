"""`ebpo-lite doctor [RECIPE]` (issue 30, part 5): one screen about the machine and the packages,
then the recipe judged: exit 0 when it can run here, 1 with every reason when it cannot, 2 for a
bad command line. Nothing loads: each case takes a second or two.

Run for real on this CPU machine; the one GPU case fakes only the CUDA device queries (no CUDA
exists here). The hub is switched off (HF_HUB_OFFLINE) except in the timeout test, which asks a
local socket that never answers.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import socket
import time
from pathlib import Path

import pytest
import torch

from ebpo_lite.__main__ import main as front_door
from ebpo_lite.commands import doctor
from ebpo_lite.engine import checks
from ebpo_lite.rollout import stack
from tests.conftest import REPO

no_cuda_here = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)


def _doctor(capsys, *argv: str) -> tuple[int, str, str]:
    status = front_door(["doctor", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_the_tiny_recipe_can_run_here_and_the_screen_names_everything(capsys, tmp_path):
    t0 = time.perf_counter()
    status, out, err = _doctor(capsys, "tiny_cpu", f"output_dir={tmp_path / 'run'}")
    seconds = time.perf_counter() - t0
    assert status == 0 and err == "", err
    lines = out.splitlines()
    for start in ("  python ", "  torch ", "  /dev/shm ", "  disk ", "  hub          offline"):
        assert any(line.startswith(start) for line in lines), (start, out)
    assert f"CUDA build: {torch.version.cuda or 'none'}" in out
    assert ("  GPUs         none visible" in lines) != torch.cuda.is_available()
    assert f"free at {tmp_path}" in out  # the output_dir's nearest existing folder
    for name in {p for ps in stack.EXTRAS.values() for p in ps}:  # every extra's packages
        row = next(line for line in lines if line.startswith(f"  {name} "))
        assert (stack.installed(name) or " - ") in row, row
        if name in stack.WINDOW:
            assert stack.WINDOW[name].high in row, row
    assert any(line.startswith("vLLM bitsandbytes method: ") for line in lines)
    assert (
        lines[-2:]
        == [
            "  plan         no GPU here and none named (--gpu 24): no memory plan",
            "verdict: can run here",
        ]
        or torch.cuda.is_available()
    )
    assert len(lines) <= 40 and seconds < 20, (len(lines), seconds)  # one screen, nothing loads


@no_cuda_here
def test_a_4bit_vllm_gpu_recipe_on_this_cpu_machine_fails_with_every_reason(capsys, tmp_path):
    status, out, err = _doctor(capsys, "qwen3_8b_lora", f"output_dir={tmp_path / 'run'}")
    assert status == 1 and err == ""
    found = [line[4:] for line in out.splitlines() if line.startswith("  x ")]
    assert found[0].startswith("model.load_in_4bit: Qwen/Qwen3-8B with rollout.backend=vllm")
    assert any(p.startswith("data.labels_path: ") for p in found)  # not only the first failure
    assert any(p.startswith("model.name: Qwen/Qwen3-8B is not in the local") for p in found)
    assert out.splitlines()[-1] == f"verdict: cannot run here ({len(found)} to fix)"
    plan = next(line for line in out.splitlines() if line.startswith("  plan "))
    assert "of 24 (24 GiB, the recipe's GPU; none here): fits" in plan


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_logger_without_its_package_is_a_problem(capsys, tmp_path):
    """`checks.loggers` reads the log section (doctor hands it `cfg.log`): a missing wandb is a
    problem line, not a traceback."""
    status, out, _ = _doctor(capsys, "tiny_cpu", "log.wandb=true", f"output_dir={tmp_path / 'r'}")
    found = [line[4:] for line in out.splitlines() if line.startswith("  x ")]
    assert status == 1 and any(p.startswith("log.wandb: needs the wandb package") for p in found)


@no_cuda_here
def test_every_refusal_is_listed_not_only_the_first(capsys, tmp_path, monkeypatch):
    """An old vLLM planted on sys.path (a dist-info folder as pip leaves one; none can be
    installed here): its refusal comes after the CPU one, which alone stops checks.machine."""
    info = tmp_path / "site" / "vllm-0.27.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.27.1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    status, out, _ = _doctor(capsys, "qwen3_8b_lora", f"output_dir={tmp_path / 'run'}")
    found = [line[4:] for line in out.splitlines() if line.startswith("  x ")]
    assert status == 1 and found[0].startswith("model.load_in_4bit: Qwen/Qwen3-8B")
    assert found[1].startswith("rollout.backend=vllm: vllm 0.27.1 is older than the tested")
    assert "  vllm                 0.27.1       0.29.0 - 0.34.0        older than the window" in out


def test_a_recipe_that_does_not_fit_the_gpu_here_is_a_problem(capsys, tmp_path, monkeypatch):
    """CUDA faked: one 24 GB L4 (22.5 GiB as the driver reports it), 20 GiB free."""
    monkeypatch.setattr("ebpo_lite.model.device._cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L4")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (20 * 2**30, int(22.5 * 2**30)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    status, out, _ = _doctor(capsys, "paper_qwen3_8b", f"output_dir={tmp_path / 'run'}")
    assert status == 1
    assert "  GPU 0        NVIDIA L4, 22.5 GiB, 20.0 free" in out.splitlines()
    assert "(NVIDIA L4, this GPU): does not fit" in out
    assert any(line.startswith("  x plan: ") and "does not fit 22.5 GiB" in line
               for line in out.splitlines())  # fmt: skip


def test_doctor_runs_every_check_before_load_makes():
    """A check added to checks.before_load must reach the doctor too."""
    called = {
        node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        for node in ast.walk(ast.parse(inspect.getsource(checks.before_load)))
        if isinstance(node, ast.Call)
    }
    source = inspect.getsource(doctor.problems_of)
    assert called and all(name in source for name in called), called


def test_the_hub_check_never_waits_past_its_timeout():
    with socket.socket() as server:  # accepts the connection, never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/"
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("HF_HUB_OFFLINE", raising=False)
            mp.delenv("TRANSFORMERS_OFFLINE", raising=False)
            t0 = time.perf_counter()
            said = doctor.hub_status(url, timeout=0.5)
    assert said.startswith("unreachable") and time.perf_counter() - t0 < 1.5, said


def test_without_a_recipe_the_machine_alone(capsys):
    status, out, _ = _doctor(capsys)
    assert status == 0 and "recipe" not in out.splitlines()[-1]
    assert out.splitlines()[-1].startswith("vLLM bitsandbytes method: ")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["no_such_recipe"], "no_such_recipe: no such recipe file or packaged recipe"),
        (["tiny_cpu", "train.stepz=3"], "train.stepz: unknown key"),
        (["tiny_cpu", "--gpu"], "argument --gpu: expected one argument"),
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_2(capsys, argv, says):
    status, out, err = _doctor(capsys, *argv)
    assert status == 2 and out == "" and err.count("\n") == 1 and says in err, err


def test_the_output_dir_room_is_read_at_its_nearest_existing_folder(tmp_path):
    where, gib = doctor.gib_free(tmp_path / "a" / "b")
    assert where == tmp_path and gib > 0
    assert doctor.gib_free(Path("relative/never/made"))[0] == Path(".")
