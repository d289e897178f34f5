"""Can this machine run this recipe? `ebpo-lite doctor [RECIPE]`: one screen, before anything loads.

    ebpo-lite doctor [RECIPE [section.key=value ...]] [--gpu NAME_OR_GIB]

Like `trl env` and vLLM's `collect_env`, it reports the machine (Python, torch and CUDA, each
GPU's name and memory, room in /dev/shm and on the output_dir's disk, whether the Hugging Face
hub answers) and the packages of every extra against the tested window (`stack.py`,
constraints/gpu.txt), with whether vLLM has a bitsandbytes method. Unlike them it then judges a
recipe: the planner's verdict (`plan.plan` on this GPU, else on the GPU the recipe's header
names) and every check `checks.before_load` makes, each failure reported with its fix instead of
raised, plus every refusal of `stack.refusals` (not only the first) and the packages the
recipe's backend needs. No model, data set or engine is loaded, nothing is written.

Exit status: 0 when the recipe can run here (or no recipe was given), 1 when something would
stop it (each listed), 2 for a bad command line or a recipe that does not load.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from ebpo_lite import cli
from ebpo_lite.errors import UserError
from ebpo_lite.rollout import stack

if TYPE_CHECKING:
    from ebpo_lite.config import Config

HUB_URL = "https://huggingface.co/api/models/Qwen/Qwen3-0.6B"  # a small public model's card
HUB_TIMEOUT_S = 2.0


# ----------------------------------------------------------------------------- the machine


def gib_free(path: Path) -> tuple[Path, float] | None:
    """Free GiB on the disk holding `path` (or its nearest existing parent), with that folder."""
    for p in (path, *path.parents):
        if p.exists():
            return p, shutil.disk_usage(p).free / 2**30
    return None


def hub_status(url: str = HUB_URL, timeout: float = HUB_TIMEOUT_S) -> str:
    """`offline (...)`, `reachable (0.3 s)` or `unreachable (...)`; never waits past `timeout`
    (the request runs in a daemon thread: a socket timeout does not bound the DNS lookup)."""
    from ebpo_lite.model.base_model import hub_offline

    if hub_offline():
        return "offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set): the local cache only"
    result: list[str] = []

    def ask() -> None:
        t0 = time.perf_counter()
        try:
            req = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(req, timeout=timeout):
                result.append(f"reachable ({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # any failure is an answer: unreachable
            result.append(f"unreachable ({type(e).__name__}: {str(e)[:60]})")

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"unreachable (no answer in {timeout:g} s)"


def gpu_lines() -> list[str]:
    """torch and CUDA, then one line per visible GPU (name, total and free memory)."""
    import torch

    from ebpo_lite.model import driver
    from ebpo_lite.model.device import _cuda_available

    cuda = torch.version.cuda or "none"
    found = driver.read()
    lines = [
        f"torch        {torch.__version__} (CUDA build: {cuda})",
        f"driver       {found.words()}",
    ]
    if (why := driver.problem(found, driver.builds("vllm"))) is not None:
        lines.append(f"             x {why}")
    if not _cuda_available():
        return [*lines, "GPUs         none visible"]
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        name = torch.cuda.get_device_name(i)
        lines.append(f"GPU {i}        {name}, {total / 2**30:.1f} GiB, {free / 2**30:.1f} free")
    return lines


def machine_lines(output_dir: Path | None, hub: str) -> list[str]:
    lines = [f"python       {sys.version.split()[0]} ({sys.executable})", *gpu_lines()]
    shm = Path("/dev/shm")
    room = gib_free(shm) if shm.is_dir() else None
    tmp = tempfile.gettempdir()
    lines.append(
        f"/dev/shm     {room[1]:.1f} GiB free" if room else f"/dev/shm     none (adapters: {tmp})"
    )
    if output_dir is not None and (disk := gib_free(output_dir.resolve())):
        lines.append(f"disk         {disk[1]:.1f} GiB free at {disk[0]} (output_dir {output_dir})")
    return [*lines, f"hub          {hub}"]


def package_lines(s: stack.Stack) -> list[str]:
    """Each extra's packages: installed version against the window (`stack.WINDOW`)."""
    extras: dict[str, list[str]] = {}
    for extra, packages in stack.EXTRAS.items():
        for name in packages:
            extras.setdefault(name, []).append(extra)
    lines = []
    for name, used_by in extras.items():
        version, bound = s.versions.get(name), stack.WINDOW.get(name)
        window = (
            ""
            if bound is None
            else bound.low
            if bound.low == bound.high
            else (f"{bound.low} - {bound.high}")
        )
        place = stack.place(name, version)
        status = {"missing": "not installed", "ok": "ok"}.get(place, f"{place} than the window")
        lines.append(
            f"  {name:<20} {version or '-':<12} {window:<22} {status:<23} [{','.join(used_by)}]"
        )
    return [*lines, f"vLLM bitsandbytes method: {s.bnb_source()}"]


# ----------------------------------------------------------------------------- the recipe


def plan_line(cfg: Config, gpu: str | None, info_gpu: str | None) -> tuple[str, str | None]:
    """(the planner's verdict in one line, a problem if it does not fit) on this machine's GPU,
    else on `--gpu`, else on the GPU the recipe's header plans for."""
    from ebpo_lite.model import plan
    from ebpo_lite.model.device import cuda_memory_gib, cuda_name, resolve_device

    try:
        dev = resolve_device(cfg.model.device)
    except UserError:
        dev = None
    mem = cuda_memory_gib(dev) if dev is not None and gpu is None else None
    try:
        if mem is not None:
            name, gib, where = cuda_name(dev), mem[1], "this GPU"
        elif gpu or info_gpu:
            name, gib = plan.parse_gpu(gpu or info_gpu)
            where = "--gpu" if gpu else "the recipe's GPU; none here"
        else:
            return "plan         no GPU here and none named (--gpu 24): no memory plan", None
        p = plan.plan(cfg, gib, name)
    except UserError as e:
        return f"plan         none ({e})", None
    peaks = " + ".join(f"{v:.1f}" for v in p["per_device_gb"].values())
    verdict = "fits" if p["fits"] else "does not fit"
    line = f"plan         {peaks} GiB of {p['gpu_gb']:g} ({p['gpu_name']}, {where}): {verdict}"
    problem = None
    if not p["fits"]:
        advice = "; ".join(p["advice"]) or f"ebpo-lite plan RECIPE --gpu {gib:g}"
        problem = f"plan: {p['model']} does not fit {gib:g} GiB; {advice}"
    return line, problem


def _try(problems: list[str], fn, *args) -> None:
    """Run one check; its one-line error (with its fix) becomes a problem, once."""
    try:
        fn(*args)
    except UserError as e:
        if str(e) not in problems:
            problems.append(str(e))


def problems_of(cfg: Config, s: stack.Stack) -> list[str]:
    """Every check `checks.before_load` makes, and every stack refusal, as lines."""
    from ebpo_lite.engine import checks, labels
    from ebpo_lite.model.device import resolve_device

    found: list[str] = []
    _try(found, checks.output_dir, cfg, lambda _: None)
    try:
        device = resolve_device(cfg.model.device)
        found += [str(e) for e in stack.refusals(cfg, device, s)]
    except UserError as e:
        found.append(str(e))
    _try(found, checks.machine, cfg)  # its first failure, if not a refusal above
    if cfg.rollout.backend == "vllm":
        from ebpo_lite.rollout.vllm import check_importable

        _try(found, check_importable)
    _try(found, checks.loggers, cfg.log)
    _try(found, checks.model_name, cfg.model.name)
    _try(found, labels.check_path, cfg)  # an uncached hub id without the hub: model_name says so
    return found


# ----------------------------------------------------------------------------- CLI


def report(recipe: str | None, overrides: list[str], gpu: str | None) -> tuple[list[str], int]:
    """The screen's lines and the exit status (module docstring)."""
    from ebpo_lite import catalog, config

    cfg = config.load(recipe, overrides) if recipe else None
    hub = hub_status()
    s = stack.Stack.read()
    out = ["machine", *(f"  {x}" for x in machine_lines(cfg and Path(cfg.output_dir), hub))]
    out += [
        f"packages        version      window ({stack.CONSTRAINTS})     status                  extras"
    ]
    out += package_lines(s)
    if cfg is None:
        return out, 0
    info = catalog.recipe_info(catalog.recipe_path(recipe))
    line, plan_problem = plan_line(cfg, gpu, info.plan_gpu)
    found = problems_of(cfg, s) + ([plan_problem] if plan_problem else [])
    out += [f"recipe {recipe}", f"  {line}"]
    if not found:
        return [*out, "verdict: can run here"], 0
    out += ["  stops the run:", *(f"  x {p}" for p in found)]
    return [*out, f"verdict: cannot run here ({len(found)} to fix)"], 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2 (cli.run's convention)
        raise UserError(message)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog=cli.prog("python -m ebpo_lite.commands.doctor"), description=__doc__.split("\n")[0]
    )
    parser.add_argument("recipe", nargs="?", help="recipe YAML or a packaged recipe's name")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--gpu", help="plan on this GPU (name or GiB) instead of the visible one")
    try:
        args = parser.parse_intermixed_args(argv)
        lines, status = report(args.recipe, args.overrides, args.gpu)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
