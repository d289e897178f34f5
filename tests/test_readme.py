"""What the README and the docs pages its text moved to state, checked against the code.

The README is a front page (issue 32: read in five minutes); its longer sections live in docs/
(`PAGES`). Every check that read the README reads the page holding that text now:
- every `section.key` a page names in inline code is a config field;
- the recipe table's memory column is what `ebpo-lite recipes` computes;
- every relative link of the README and docs/ resolves: the file exists, and an anchor names a
  heading of that page (GitHub's slugs);
- the front page stays under 150 lines; its set-up commands are the ones CI runs; the main
  command's output it quotes is the measured run's (benchmarks/results/tiny_cpu_run.json) in the
  trainer's own format.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from ebpo_lite.config import Config
from tests.conftest import REPO

SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "output_dir"]
CODE = re.compile(r"`[^`\n]+`")
# section.key not inside a dotted name or a path (ebpo_lite.train, ebpo_lite/train.py)
KEY = re.compile(r"(?<![\w./-])(" + "|".join(SECTIONS) + r")\.([a-z_0-9]+)")
FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "md", "png", "partial"}
# The README and the pages that hold what the README said before issue 32.
PAGES = [
    "README.md",
    "docs/estimators.md",
    "docs/troubleshooting.md",
    "docs/reliability.md",
    "docs/gpu.md",
    "docs/benchmarks.md",
    "docs/configuration.md",
    "docs/runs.md",
    "docs/layout.md",
]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FRONT_PAGE_MAX_LINES = 150  # issue 32: a README a newcomer reads in five minutes


def _fields(section: str) -> set[str]:
    cls = type(getattr(Config(), section))
    return {f.name for f in dataclasses.fields(cls)}


def keys_named(text: str) -> list[tuple[str, str]]:
    """(section, key) of every `section.key` inside inline code, file names left out."""
    return [
        (s, k)
        for span in CODE.findall(text)
        for s, k in KEY.findall(span)
        if k not in FILE_SUFFIXES
    ]


def _missing_keys(page: str) -> list[str]:
    found = keys_named((REPO / page).read_text())
    return sorted({f"{s}.{k}" for s, k in found if k not in _fields(s)})


@pytest.mark.parametrize("page", PAGES)
def test_readme_config_keys_exist(page):
    missing = _missing_keys(page)
    assert not missing, f"{page} names config keys that do not exist: {missing}"


def test_the_pages_name_config_keys():
    """The scan reads what it should: the README's former text names over 50 keys."""
    found = [k for page in PAGES for k in keys_named((REPO / page).read_text())]
    assert len(found) > 50, "the README and its pages name config keys in backticks"


def test_the_check_catches_a_wrong_key():
    text = "set `rollout.gpu_mem_util=0.5` and `python -m ebpo_lite.train x.yaml train.lr=1`"
    assert keys_named(text) == [("rollout", "gpu_mem_util"), ("train", "lr")]
    assert "gpu_mem_util" not in _fields("rollout") and "lr" in _fields("train")


def test_the_recipe_tables_memory_is_what_ebpo_lite_recipes_shows():
    """README's recipe table quotes the planner's peak per GPU (and the tiny recipe's measured
    RAM) as `ebpo-lite recipes` computes them from each recipe, so a change to either shows."""
    from ebpo_lite import catalog, config
    from ebpo_lite.__main__ import _memory

    text = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)\.yaml` \|(?:[^|]*\|){2} ([^|]*?) \|", text, re.M)
    assert len(rows) == len(list((REPO / "recipes").glob("*.yaml"))), rows

    def gib(cell: str) -> list[str]:
        return re.findall(r"\d+\.\d+", cell.split("GiB")[0])

    for name, cell in rows:
        path = REPO / "recipes" / f"{name}.yaml"
        listed = _memory(catalog.recipe_info(path), config.load(path))
        assert gib(cell) and gib(cell) == gib(listed), (
            f"{name}: README {cell!r}, listing {listed!r}"
        )


# ----------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    body = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # no headings in code blocks
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", body, re.M)}


def broken_links(page: str, text: str) -> list[str]:
    """Relative links of a page (at REPO / page) whose file or heading anchor does not exist."""
    base = (REPO / page).parent
    out = []
    for target in LINK.findall(re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (base / path).resolve() if path else (REPO / page)
        if not dest.exists():
            out.append(f"{page}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            out.append(f"{page}: {target} (no such heading)")
    return out


def _linking_pages() -> list[str]:
    return ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))


def test_links_resolve():
    pages = _linking_pages()
    assert set(PAGES) <= set(pages)
    broken = [b for page in pages for b in broken_links(page, (REPO / page).read_text())]
    assert not broken, broken


def test_the_link_check_catches_a_broken_link():
    assert (
        slug("The estimators (`ebpo_lite/algo/advantages.py`)")
        == "the-estimators-ebpo_litealgoadvantagespy"
    )
    assert slug("Measured on the built-in task: EBPO against GRPO") == (
        "measured-on-the-built-in-task-ebpo-against-grpo"
    )
    text = "[a](docs/no_such_page.md) [b](docs/estimators.md#no-such-heading) [c](#start-here)"
    assert broken_links("README.md", text) == [
        "README.md: docs/no_such_page.md (no such file)",
        "README.md: docs/estimators.md#no-such-heading (no such heading)",
    ]
    assert broken_links("docs/x.md", "[d](../README.md#no-such)") == [
        "docs/x.md: ../README.md#no-such (no such heading)"
    ]


# ----------------------------------------------------------------------------- the front page


def _front() -> str:
    return (REPO / "README.md").read_text()


def test_the_front_page_is_short():
    n = len(_front().splitlines())
    assert n < FRONT_PAGE_MAX_LINES, f"README.md has {n} lines: move a section into docs/"


def _ci_steps() -> set[str]:
    """.ci/run's commands without comments, and its pip installs without their quiet flags."""
    out = set()
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if "pip install" in line:
            line = line.replace(" -q", "").replace(" --no-compile", "")
        out.add(line)
    return out


def test_the_front_pages_commands_are_what_ci_runs():
    """The install line's steps and the test command are .ci/run's (it runs the latter verbatim);
    the install line ends in the main command."""
    install, tests = re.findall(r"```bash\n(.*?)\n```", _front(), re.S)[:2]
    steps = install.split(" && ")
    assert steps[-1] == ".venv/bin/python -m ebpo_lite.train recipes/tiny_cpu.yaml"
    ci = _ci_steps()
    assert [s for s in steps[:-1] if s not in ci] == [], (steps, sorted(ci))
    assert tests == ".venv/bin/python -m pytest -q" and tests in ci


def test_the_front_pages_output_is_the_measured_runs():
    """The quoted closing lines are what `train.learned_lines` prints for seed 0's measured eval."""
    from ebpo_lite.train import learned_lines

    block = _front().split("## What the main command shows", 1)[1].split("```")[1]
    run = json.loads((REPO / "benchmarks/results/tiny_cpu_run.json").read_text())
    summary = run["seeds"][0]["summary"]

    def evals(when: str) -> dict[str, float]:
        return {f"eval/{k.split('/', 1)[1]}": v for k, v in summary.items() if k.startswith(when)}

    before, after = evals("before/"), evals("after/")
    expected = [
        f"eval before step 1: accuracy {before['eval/accuracy']:.3f}, "
        f"expected_accuracy {before['eval/expected_accuracy']:.3f}",
        f"done: {summary['steps_done']} steps in",
        *learned_lines(before, after),
    ]
    assert len(expected) >= 6, expected  # greedy, exact, by topic, by difficulty
    assert [line for line in expected if line not in block] == []
