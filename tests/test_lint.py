"""ruff (lint and format) is part of the test suite, so CI enforces it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

PATHS = ["ebpo_lite", "tests", "benchmarks", "scripts"]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(REPO / ".venv" / "bin")) or shutil.which("ruff")
    if exe is None:
        try:
            import ruff  # noqa: F401
        except ImportError:
            pytest.skip("ruff is not installed (pip install -e '.[dev]')")
        return [sys.executable, "-m", "ruff"]
    return [exe]


def test_ruff_check_is_clean():
    r = subprocess.run([*_ruff(), "check", *PATHS], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]


def test_ruff_format_is_clean():
    r = subprocess.run(
        [*_ruff(), "format", "--check", *PATHS], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-3000:]
