"""The recipes and notebooks that ship inside the package, and recipe names.

The repository's `recipes/` and `notebooks/` folders are the real ones; `ebpo_lite/recipes` and
`ebpo_lite/notebooks` are relative symlinks to them, so a source checkout, an editable install
and a built wheel (where setuptools copies the files in, see `package-data` in pyproject.toml)
all find them in the same place: next to this file.

A recipe argument is a path or a name. A path always wins when that file exists; otherwise
`tiny_cpu`, `tiny_cpu.yaml` and `recipes/tiny_cpu.yaml` all mean the packaged
`recipes/tiny_cpu.yaml`, so the commands the README and the recipes document work from any
folder after `pip install ebpo-lite`.

Each recipe's header comment documents it; two of its lines are read here (`recipe_info`):
`# GPU: ...` (the hardware it is written for; the listing shows the text before the first
" (", "; " or ". ") and either `# Memory (ebpo-lite plan recipes/NAME.yaml --gpu G):`
(the planner estimates the peak on that GPU) or a one-line `# Memory: ...` (shown as written,
for the CPU recipe the planner does not describe).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from ebpo_lite.errors import ConfigError

PACKAGE = Path(__file__).resolve().parent
SUFFIXES = (".yaml", ".yml")


def recipes_dir() -> Path:
    return PACKAGE / "recipes"


def notebooks_dir() -> Path:
    return PACKAGE / "notebooks"


def recipe_names() -> list[str]:
    """Names of the packaged recipes (file stems), sorted."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def notebooks() -> list[Path]:
    return sorted(notebooks_dir().glob("*.ipynb"))


def recipe_path(recipe: str | Path) -> Path:
    """The file a recipe argument names: the path if it exists, else the packaged recipe of that
    name. A bare name no recipe has is a `ConfigError` listing the names; a missing path is left
    for the reader to report."""
    path = Path(recipe)
    if path.exists():
        return path
    bare = path.parent == Path(".")
    if bare or path.parent == Path("recipes"):
        stem = path.stem if path.suffix in SUFFIXES else path.name
        packaged = recipes_dir() / f"{stem}.yaml"
        if packaged.is_file():
            return packaged
        if bare and path.suffix not in SUFFIXES:
            raise ConfigError(unknown_recipe(str(recipe)))
    return path


def unknown_recipe(name: str) -> str:
    names = recipe_names()
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (
        f"{name}: no such recipe file or packaged recipe{hint} "
        f"(packaged: {', '.join(names)}; or give the path of a YAML recipe)"
    )


@dataclass(frozen=True)
class RecipeInfo:
    name: str
    path: Path
    title: str  # the header's first line, after "# NAME: "
    gpu: str  # short form of the `# GPU:` line
    memory_note: str  # short form of the `# Memory: ...` line, if the recipe has one
    plan_gpu: str | None  # the `--gpu` of its `# Memory (ebpo-lite plan ...)` line


def _header(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return lines


def _short(text: str) -> str:
    """The text before the first " (", "; " or ". ": the gist of a header line."""
    return re.split(r" \(|; |\. ", text, maxsplit=1)[0].rstrip(".")


def recipe_info(path: Path) -> RecipeInfo:
    """What a recipe's header says about itself (see the module docstring)."""
    header = _header(path.read_text())
    title = header[0].partition(":")[2].strip() if header else ""
    gpu = next((_short(h[4:].strip()) for h in header if h.startswith("GPU:")), "")
    memory_note = next((_short(h[7:].strip()) for h in header if h.startswith("Memory:")), "")
    plan_gpu = None
    for h in header:
        m = re.match(r"Memory \(ebpo-lite plan \S+ --gpu (\S+?)\)?:", h)
        if m:
            plan_gpu = m.group(1)
    return RecipeInfo(path.stem, path, title, gpu, memory_note, plan_gpu)
