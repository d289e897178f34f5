"""The notebooks are thin clients of the package: valid, clean, calling APIs that exist, and
runnable top to bottom on a CPU in smoke mode (EBPO_NOTEBOOK_SMOKE=1: the tiny model, 3 steps)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import sys

import pytest

from tests.conftest import REPO

nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = REPO / "notebooks"
NAMES = ("quickstart_cpu", "colab_qwen3_gsm8k", "kaggle_qwen3_math")
GPU_NAMES = NAMES[1:]


def _read(name: str):
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def _code(book) -> list[str]:
    return [c.source for c in book.cells if c.cell_type == "code"]


def _setup(name: str, smoke: bool, monkeypatch) -> dict:
    """Run a notebook's first code cell (its settings) in a namespace."""
    if smoke:
        monkeypatch.setenv("EBPO_NOTEBOOK_SMOKE", "1")
    else:
        monkeypatch.delenv("EBPO_NOTEBOOK_SMOKE", raising=False)
    monkeypatch.delenv("EBPO_NOTEBOOK_OUT", raising=False)
    ns: dict = {}
    exec(_code(_read(name))[0], ns)
    return ns


def test_the_notebooks_are_these():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_valid_and_has_no_errors(name):
    book = _read(name)
    nbformat.validate(book)
    assert book.metadata["kernelspec"]["name"] == "python3"
    for cell in book.cells:
        for out in cell.get("outputs", []):
            assert out["output_type"] != "error", (name, out.get("ename"), out.get("evalue"))
            assert "Traceback (most recent call last)" not in out.get("text", ""), name
    assert "EBPO_NOTEBOOK_SMOKE" in _code(book)[0], "the first code cell sets smoke mode"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_calls_only_package_apis_that_exist(name):
    """Every `from ebpo_lite.x import y` in a code cell imports, and y exists (no magics:
    every cell is plain Python)."""
    used = 0
    for src in _code(_read(name)):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ebpo_lite"):
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(mod, alias.name):  # a submodule: `from ebpo_lite import config`
                        importlib.import_module(f"{node.module}.{alias.name}")
                    used += 1
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("ebpo_lite"):
                        importlib.import_module(alias.name)
    assert used >= 3, f"{name} calls the package in fewer than 3 names: not a client of it"


@pytest.mark.parametrize("name", GPU_NAMES)
@pytest.mark.parametrize("smoke", [False, True], ids=["gpu", "smoke"])
def test_gpu_notebook_settings_load(name, smoke, monkeypatch):
    """The recipe and overrides of each GPU notebook are valid config, in both modes."""
    from ebpo_lite import config

    ns = _setup(name, smoke, monkeypatch)
    assert (REPO / ns["RECIPE"]).is_file()
    cfg = config.load(REPO / ns["RECIPE"], [*ns["OVERRIDES"], *ns.get("SMOKE_OVERRIDES", [])])
    if smoke:
        assert (cfg.model.name, cfg.data.name, cfg.rollout.backend) == ("tiny", "arithmetic", "hf")
        assert cfg.train.steps <= 5 and not cfg.model.load_in_4bit
    else:
        assert cfg.model.name.startswith("Qwen/Qwen3-") and cfg.model.dtype == "float16"


def test_quickstart_is_committed_with_a_real_runs_outputs():
    """Committed executed, and its first cell names the mode the outputs show."""
    book = _read("quickstart_cpu")
    code = [c for c in book.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "every code cell executed"
    texts = "".join(o.get("text", "") for c in code for o in c.outputs)
    mode, steps = ("smoke", 3) if "smoke mode" in texts else ("full", 300)
    assert f"real run in {mode} mode" in book.cells[0].source
    assert f"done: {steps} steps" in texts and "== grpo" in texts and "== ebpo" in texts
    pngs = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert pngs, "the plots are in the committed outputs"


LOCAL_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|tmp)/")


def _output_texts(book) -> list[str]:
    """The text of every output (streams, plain/html data, tracebacks); images left out, their
    base64 can hold any letters."""
    texts = []
    for cell in book.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text", ""))
            data = out.get("data", {})
            texts += [data.get(k, "") for k in ("text/plain", "text/html", "text/markdown")]
            texts += out.get("traceback", [])
    return ["".join(t) if isinstance(t, list) else t for t in texts]


@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_hold_no_local_path(name):
    """A committed output is read on other machines: no absolute path of the one that ran it
    (a warning once carried the venv's /work/... path; runs write under relative runs/)."""
    found = [m.group(0) for t in _output_texts(_read(name)) for m in LOCAL_PATH.finditer(t)]
    assert not found, f"{name}: committed outputs name local paths {found}"


WARNING = re.compile(r"\b\w*Warning: ")


@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_hold_no_library_warning(name):
    """A reader's first output was tqdm's 'TqdmWarning: IProgress not found' (issue 32 part 4),
    which `cli.quiet_libraries` now silences: no committed output is a library's warning."""
    found = [t.strip()[:80] for t in _output_texts(_read(name)) if WARNING.search(t)]
    assert not found, f"{name}: committed outputs hold warnings {found}"
    assert WARNING.search("tqdm/auto.py:21: TqdmWarning: IProgress not found")  # the check works


def test_the_path_check_catches_a_warning_line():
    line = "/home/u/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning: IProgress"
    assert LOCAL_PATH.search(line) and LOCAL_PATH.search("run: /tmp/x")
    assert not LOCAL_PATH.search("run: runs/quickstart/grpo, see docs/tmp/ and ~/tmp/")


def _execute(name: str, out, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("EBPO_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("EBPO_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the kernel (python3: ipykernel's, this interpreter) must import this checkout's package
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    book = _read(name)
    client = nbclient.NotebookClient(
        book,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    # library chatter stays quiet in a kernel as on the command line (tqdm.auto's "IProgress not
    # found" was the committed notebook's first output): no warning reaches a cell's stderr
    warned = [
        o["text"] for c in book.cells for o in c.get("outputs", [])
        if o.get("name") == "stderr" and "Warning" in o.get("text", "")
    ]  # fmt: skip
    assert not warned, f"{name}: warnings in the outputs: {warned}"
    return "".join(o.get("text", "") for c in book.cells for o in c.get("outputs", []))


@pytest.mark.slow
def test_quickstart_runs_in_smoke_mode(tmp_path, monkeypatch):
    text = _execute("quickstart_cpu", tmp_path / "nb", monkeypatch)
    assert "smoke mode" in text and "done: 3 steps" in text
    for est in ("grpo", "ebpo"):
        summary = json.loads((tmp_path / "nb" / est / "summary.json").read_text())
        assert summary["steps_done"] == 3
    assert list((tmp_path / "nb" / "plots").glob("*.png"))


@pytest.mark.slow
@pytest.mark.parametrize("name", GPU_NAMES)
def test_gpu_notebook_runs_in_smoke_mode(name, tmp_path, monkeypatch):
    out = tmp_path / "nb"
    text = _execute(name, out, monkeypatch)
    assert "smoke mode: install skipped" in text and "GPU check" in text and "skipped" in text
    assert json.loads((out / "summary.json").read_text())["steps_done"] == 3
    assert json.loads((out / "eval.json").read_text())["benchmarks"]["arithmetic"]
    assert list((out / "plots").glob("*.png"))
    assert list((out / "export").rglob("adapter_model.safetensors"))
    if name == GPU_NAMES[0]:  # Run all a second time in the same folder (it stopped at train)
        again = _execute(name, out, monkeypatch)
        assert f"run folder: continuing {out} from step_3" in again
        assert "training: nothing to do" in again and "adapter:" in again


def test_kernel_runs_this_interpreter():
    """nbclient's python3 kernel is ipykernel's native one: this interpreter, whatever venv."""
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] in (sys.executable, "python", "python3"), spec.argv
