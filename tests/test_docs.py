"""docs/algorithm.md is the page the code cites, and the package stands alone.

- No file of the package, its recipes, benchmarks, tests or docs cites the spec that is not in the
  repository (a clone has no `../shared`); they cite docs/algorithm.md, by sections that exist.
- The package, recipes, docs, README and notebooks never name `../shared` (the data folder comes
  from EBPO_LITE_DATA, which tests and CI set).
- The constants and defaults docs/algorithm.md states are the code's, and every `section.key` it
  names is a config field.
"""

from __future__ import annotations

import re
from pathlib import Path

from ebpo_lite import config
from ebpo_lite.algo import advantages
from ebpo_lite.engine import labels
from tests.conftest import REPO
from tests.test_readme import _fields, keys_named

DOC = REPO / "docs" / "algorithm.md"
SPEC = "ALGORITHM" + ".md"  # spelt in two parts so this file does not cite it
SHARED = re.compile(r"\.\./shared|shared/(?:data|PLATFORM|ALGORITHM|STYLE)")
# "docs/algorithm.md section 4", "sections 2-4", across a line break or a comment's '#'
CITE = re.compile(r"docs/algorithm\.md[\s#,:]*sections?\s+(\d+)(?:\s*-\s*(\d+))?")
HEADING = re.compile(r"^## (\d+)\. ", re.M)


def _files(*patterns: str) -> list[Path]:
    """Files under the repository matching the glob patterns (the package's symlinked
    recipes/ and notebooks/ are read where they really are)."""
    out = set()
    for pattern in patterns:
        out.update(p.resolve() for p in REPO.glob(pattern) if p.is_file())
    return sorted(out)


def _package_docs() -> list[Path]:
    return _files(
        "ebpo_lite/**/*.py",
        "ebpo_lite/*.json",
        "recipes/*.yaml",
        "docs/**/*.md",
        "README.md",
        "notebooks/*.ipynb",
    )


def _citing() -> list[Path]:
    return _package_docs() + _files("benchmarks/*.py", "benchmarks/*.md", "tests/*.py", ".ci/*")


def _flat(text: str) -> str:
    return " ".join(text.split())


def spec_citations(files: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in files if SPEC in p.read_text()]


def shared_mentions(files: list[Path]) -> list[str]:
    return [
        f"{p.relative_to(REPO)}: {m.group(0)}"
        for p in files
        for m in SHARED.finditer(p.read_text())
    ]


def cited_sections(text: str) -> list[int]:
    out = []
    for m in CITE.finditer(text):
        first = int(m.group(1))
        out.extend(range(first, int(m.group(2) or first) + 1))
    return out


def test_nothing_cites_the_spec_outside_the_repository():
    files = _citing()
    assert len(files) > 80, "the scan reads the package, recipes, benchmarks and tests"
    assert spec_citations(files) == []


def test_package_and_docs_never_name_the_shared_folder():
    files = _package_docs()
    assert any(p.suffix == ".ipynb" for p in files) and DOC.resolve() in files
    assert shared_mentions(files) == []


def test_cited_sections_exist():
    sections = {int(n) for n in HEADING.findall(DOC.read_text())}
    assert sections == set(range(1, max(sections) + 1)), "sections numbered 1..n"
    cited = {
        str(p.relative_to(REPO)): cited_sections(p.read_text())
        for p in _citing()
        if p not in (DOC.resolve(), Path(__file__).resolve())  # this file plants a bad one
    }
    assert sum(len(v) for v in cited.values()) >= 20, "the code cites the page by section"
    missing = {f: [n for n in ns if n not in sections] for f, ns in cited.items()}
    assert not {f: ns for f, ns in missing.items() if ns}, "cites sections the page lacks"


def test_the_checks_catch_a_planted_citation():
    text = "see docs/algorithm.md section 12, and\n    # docs/algorithm.md\n    # sections 2-4"
    assert cited_sections(text) == [12, 2, 3, 4]
    assert SHARED.search("else ../shared/data") and SHARED.search("see shared/PLATFORM.md")
    assert not SHARED.search("shared prompts, shared/ memory")


def test_docs_config_keys_exist():
    found = keys_named(DOC.read_text())
    assert len(found) > 15
    missing = sorted({f"{s}.{k}" for s, k in found if k not in _fields(s)})
    assert not missing, f"docs/algorithm.md names config keys that do not exist: {missing}"


def _eps(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")  # 1e-04 -> 1e-4


def test_the_pages_constants_and_defaults_are_the_codes():
    """Each number the page states about the code, built from the code's own value."""
    a, c = config.AlgoConfig(), config.CurriculumConfig()
    prior = advantages.EBPrior()
    text = _flat(DOC.read_text())
    stated = [
        f"A = (R - mean_g) / (std_g + {_eps(advantages.GRPO_EPS)})",
        f"(std(A_raw) + {_eps(advantages.EBPO_EPS)})",
        f"at most `{_eps(advantages.S_DENOM_MIN)}`",
        f"`algo.grpo_scale: {a.grpo_scale}` (default)",
        f"`tau2: moments`** (default `{a.tau2}`)",
        f"`sigma2: within`** (default `{a.sigma2}`)",
        f"`center: false`** (default `{str(a.center).lower()}`)",
        f"**`min_count`** (default {a.min_count})",
        f"`algo.tau2_min` (default `{_eps(a.tau2_min)}`)",
        f"**`prompt_capacity`** (default {a.prompt_capacity:,})",
        f"`curriculum.max_extra_draws` (default {c.max_extra_draws})",
        f"`curriculum.run_length` (default {c.run_length})",
        f"`curriculum.repeat` (default {str(c.repeat).lower()})",
        f"both {a.clip_eps_low} by default",
        f"`algo.loss_agg`: `{a.loss_agg}` (default;",
        f"`algo.is_correction`, default `{a.is_correction}`; `algo.is_cap`, default {a.is_cap}",
        f"`algo.kl_coef` (default {a.kl_coef:g},",
        f"{labels.K} samples per prompt at temperature {labels.TEMPERATURE}",
    ]
    assert (a.clip_eps_low, a.min_count) == (a.clip_eps_high, prior.min_count)
    assert a.tau2_min == prior.tau2_min and a.prompt_capacity == prior.prompt_capacity
    missing = [s for s in stated if s not in text]
    assert not missing, f"docs/algorithm.md does not state the code's values: {missing}"
