"""`ebpo-lite COMMAND ...` (and `python -m ebpo_lite COMMAND ...`): one front door to the commands.

Each command is the `main(argv)` of the module that `python -m ebpo_lite.<module>` runs, imported
only when called, so a module with a missing optional dependency breaks only its own command. `recipes` is the one command defined here: it lists the
packaged recipes (`catalog.py`) with the planner's memory estimate.

This is not `cli.py` because every command module imports `cli` (for `cli.run`): a dispatcher
there would import them back, an import circle.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable

import ebpo_lite
from ebpo_lite import catalog, cli, config
from ebpo_lite.errors import UserError
from ebpo_lite.model import plan

PROG = "ebpo-lite"

# name -> (module whose main(argv) runs it, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "ebpo_lite.train",
        "train a policy from a recipe (EBPO, GRPO, ...); --help lists keys",
    ),
    "eval": ("ebpo_lite.eval", "pass@1 over k samples, maj@k and pass@k of a run or a model"),
    "plan": (
        "ebpo_lite.model.plan",
        "will a recipe fit a GPU? its memory plan, before anything loads",
    ),
    "doctor": (
        "ebpo_lite.commands.doctor",
        "can this machine run a recipe? its stack, GPU, disk, hub",
    ),
    "label": ("", "per-example labels for the curricula: label difficulty | label topics"),
    "plot": ("ebpo_lite.commands.plot", "PNG figures of one or more runs' metrics, overlaid"),
    "export": (
        "ebpo_lite.commands.export",
        "a run's complete adapter + model card; --merge, --push-to-hub",
    ),
    "recipes": ("", "list the packaged recipes: model, GPU and memory"),
}
LABELS: dict[str, tuple[str, str]] = {
    "difficulty": (
        "ebpo_lite.commands.difficulty",
        "pass rates of the base policy (difficulty sampler)",
    ),
    "topics": ("ebpo_lite.data.topics", "topic per example: a dataset field or embedding k-means"),
}


def _help() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {PROG} COMMAND [ARGS ...]      ({PROG} COMMAND --help: that command's arguments)",
        "",
        ebpo_lite.__doc__.splitlines()[0],
        "",
        "commands:",
        *(f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()),
        "",
        "options:",
        "  -h, --help  this list",
        "  --version   the installed version",
        "",
        f"A RECIPE is a YAML file or a packaged recipe's name, e.g. {PROG} train tiny_cpu.",
    ]
    return "\n".join(lines)


def _unknown(what: str, name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"error: {name!r} is not {what}{hint} (one of: {', '.join(choices)})"


def _load(command: str, module: str) -> Callable[[list[str]], int] | None:
    """`module.main`, or None after one line on stderr when the module cannot be imported."""
    try:
        return importlib.import_module(module).main
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] == "ebpo_lite":
            what = f"{e.name} is not part of this installation of ebpo_lite"
        else:
            what = f"needs the Python package {e.name!r}, which is not installed"
        print(f"error: {PROG} {command}: {what}", file=sys.stderr)
        return None


def _label(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        usage = [f"usage: {PROG} label KIND RECIPE [section.key=value ...] [options]", "kinds:"]
        usage += [f"  {k:<10}  {d}" for k, (_, d) in LABELS.items()]
        print("\n".join(usage), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in LABELS:
        print(_unknown(f"a kind of {PROG} label", argv[0], list(LABELS)), file=sys.stderr)
        return 2
    fn = _load(f"label {argv[0]}", LABELS[argv[0]][0])
    if fn is None:
        return 2
    with cli.front_door(f"{PROG} label {argv[0]}"):
        return fn(argv[1:])


def _memory(info: catalog.RecipeInfo, cfg: config.Config) -> str:
    """The planner's peak on the GPU the recipe's header names, else its `# Memory:` line."""
    if info.plan_gpu is None:
        return info.memory_note or "?"
    name, gib = plan.parse_gpu(info.plan_gpu)
    peaks = plan.plan(cfg, gib, name)["per_device_gb"]
    gpus = f", {len(peaks)} GPUs" if len(peaks) > 1 else ""
    return f"{' / '.join(f'{v:.1f}' for v in peaks.values())} GiB of {gib:g}{gpus} (planner)"


def _model(m: config.ModelConfig) -> str:
    quant = ", NF4" if m.load_in_4bit else ""
    return f"{'tiny (built in)' if m.name == 'tiny' else m.name}{quant} + LoRA r{m.lora_rank}"


def recipe_rows() -> list[tuple[str, str, str, str]]:
    """(name, model, GPU, memory) of every packaged recipe, from its YAML and header."""
    rows = []
    for name in catalog.recipe_names():
        path = catalog.recipes_dir() / f"{name}.yaml"
        info, cfg = catalog.recipe_info(path), config.load(path)
        rows.append((name, _model(cfg.model), info.gpu, _memory(info, cfg)))
    return rows


def recipes(argv: list[str]) -> int:
    """`ebpo-lite recipes`: the packaged recipes as a table, and where they and the notebooks are."""
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} recipes\n{COMMANDS['recipes'][1]}; {PROG} train NAME runs one.")
        return 0
    if argv:
        print(f"error: {PROG} recipes takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    try:
        rows = [("recipe", "model", "GPU", "peak memory"), *recipe_rows()]
    except UserError as e:  # a packaged recipe that does not load
        print(f"error: {e}", file=sys.stderr)
        return 2
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) + "  " + r[3])
    print(f"\nrun one: {PROG} train NAME [section.key=value ...]; its header documents it:")
    print(f"  {catalog.recipes_dir()}/NAME.yaml (copy it to change more than a few keys)")
    nbs = ", ".join(p.name for p in catalog.notebooks()) or "none"
    print(f"notebooks: {catalog.notebooks_dir()} ({nbs})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"{PROG} {ebpo_lite.__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(_unknown(f"an {PROG} command", command, list(COMMANDS)), file=sys.stderr)
        return 2
    if command == "label":
        return _label(rest)
    if command == "recipes":
        return recipes(rest)
    main_fn = _load(command, COMMANDS[command][0])
    if main_fn is None:
        return 2
    with cli.front_door(f"{PROG} {command}"):
        return main_fn(rest)


if __name__ == "__main__":
    sys.exit(main())
