"""The float16 patch of vllm-bnb-plugin's 4-bit matmul (`rollout/bnb_dtype.py`): its version
window and no-op paths, without vLLM (the default venv has neither vLLM nor the plugin; an
installed plugin is a dist-info folder on sys.path, read as pip's are). What the patched method
computes in, in the engine's process and in its own: tests/test_vllm_nf4.py (vllm tier)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from ebpo_lite.rollout import bnb_dtype
from tests.conftest import REPO


def _plant_plugin(tmp: Path, monkeypatch, version: str) -> None:
    info = tmp / f"vllm_bnb_plugin-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm-bnb-plugin\nVersion: {version}\n"
    )
    monkeypatch.syspath_prepend(str(tmp))


def test_the_entry_point_is_declared_under_its_name():
    text = (REPO / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    section = text.split('[project.entry-points."vllm.general_plugins"]\n', 1)[1]
    assert section.splitlines()[0] == (
        f'{bnb_dtype.ENTRY_POINT} = "ebpo_lite.rollout.bnb_dtype:register"'
    )


def test_a_bfloat16_engine_or_no_plugin_needs_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bnb_dtype.engine_env(torch.bfloat16, in_process=True) == {}
        if bnb_dtype.plugin_version() is None:  # the default venv
            assert bnb_dtype.engine_env(torch.float16, in_process=True) == {}
    assert "vllm_bnb_plugin" not in sys.modules


def test_another_plugin_release_is_not_patched_and_says_so(tmp_path, monkeypatch):
    _plant_plugin(tmp_path, monkeypatch, "0.0.4")
    assert bnb_dtype.plugin_version() == "0.0.4"
    with pytest.warns(UserWarning, match=r"vllm-bnb-plugin 0\.0\.4: .* may compute in bfloat16"):
        assert bnb_dtype.engine_env(torch.float16, in_process=False) == {}
    monkeypatch.setenv(bnb_dtype.ENV, "1")
    bnb_dtype.register()  # asked, but not a release read: no import, no patch
    assert "vllm_bnb_plugin" not in sys.modules


def test_the_entry_point_is_a_no_op_unless_asked(tmp_path, monkeypatch):
    _plant_plugin(tmp_path, monkeypatch, bnb_dtype.PATCHED_RELEASES[0])
    monkeypatch.delenv(bnb_dtype.ENV, raising=False)
    bnb_dtype.register()  # what vLLM runs in every process it starts, for any user
    assert "vllm_bnb_plugin" not in sys.modules
