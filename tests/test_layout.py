"""The house rules of STYLE.md and issue 16 that a machine can check: no module over 600 lines,
a front door that imports without torch, a layout page naming every module. Import direction and
circles: tests/test_import_layers.py."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO

PACKAGE = REPO / "ebpo_lite"
MAX_LINES = 600


def test_no_module_over_600_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_front_door_and_the_package_import_without_torch():
    """`ebpo-lite --help`, `recipes` and the package itself start in a tenth of a second: no torch
    (about 1 s to import) until a module or name that needs it; the estimators still import."""
    code = (
        "import sys, ebpo_lite, ebpo_lite.__main__\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from ebpo_lite import EBPrior, ebpo_advantages\n"
        "assert ebpo_advantages.__module__ == 'ebpo_lite.algo.advantages' and 'torch' in sys.modules\n"
        "try:\n"
        "    ebpo_lite.no_such_name\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "module 'ebpo_lite' has no attribute 'no_such_name'"


def test_the_layout_page_names_every_module():
    """docs/layout.md (the README's Layout until issue 32) lists every module and subpackage of
    ebpo_lite (a new one is documented)."""
    text = (REPO / "docs" / "layout.md").read_text()
    block = text.split("# Layout", 1)[1].split("```")[1]
    listing = block.split("recipes/", 1)[0]
    named = set(re.findall(r"[A-Za-z_]\w*", listing))
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    missing = sorted((modules | packages) - named)
    assert not missing, f"docs/layout.md does not name: {missing}"
