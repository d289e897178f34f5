"""EBPO inside verl: an advantage estimator named "ebpo", registered as a verl plugin.

How verl finds it
- verl >= 0.9 imports every entry point of the group `verl.plugins` when `verl` is imported
  (policy `VERL_USE_EXTERNAL_PLUGINS`: "auto" (default) | "none" | "name1,name2"). ebpo_lite
  declares `ebpo = "ebpo_lite.integrations.verl"` there, so `pip install ebpo-lite[verl]` is enough:
  set `algorithm.adv_estimator=ebpo`.
- verl 0.6 - 0.8 have no entry points: `export VERL_USE_EXTERNAL_MODULES=ebpo_lite.integrations.verl`
  (verl imports the listed modules at `import verl`). Ray workers inherit the driver's environment.
- verl swallows plugin import errors (logged at DEBUG only): run
  `python -m ebpo_lite.integrations.verl --check` to see whether "ebpo" is registered, and why not.

The estimator (verl's signature, verl.trainer.ppo.core_algos)
    fn(token_level_rewards [bs, T], response_mask [bs, T], config (algorithm section), index
       [bs] per-prompt uids, **kwargs) -> (advantages [bs, T], returns [bs, T])
- The outcome reward of a sample is `token_level_rewards.sum(-1)` (as verl's GRPO / RLOO).
- Samples are grouped by uid, never by position (verl reorders and balances samples). Groups are
  rows in order of first appearance; a group smaller than the largest is padded with masked
  entries, which enter no statistic and get advantage 0 (only padding is dropped: every real
  sample keeps its own advantage). With a mask, S uses each group's own size (ebpo_advantages).
  A group of one sample gets advantage 0. No `index` (verl passes one whenever the batch has
  "uid") is an error.
- The advantage is broadcast over the response tokens (times `response_mask`); returns equal the
  advantages, as in verl's outcome estimators.
- Options: `algorithm.ebpo.{tau2,sigma2,center,decay,min_count,tau2_min,leave_one_out}` (the
  EBPrior options; defaults, the paper's variant, when absent) and
  `algorithm.ebpo.prior_dir`. Add them on verl's command line with a `+`
  (`+algorithm.ebpo.tau2=moments`): the section is not in verl's schema. The hierarchical prior
  (`prior_key`) is not available: verl passes no per-prompt fields to estimators. Nor is
  `prompt_prior` (an error says so): verl 0.9's `index` is a fresh uuid per prompt and batch, so a
  prompt's earlier visits cannot be recognised. `leave_one_out` matters here more than in a
  fixed-G trainer: verl's groups can be uneven, and then it changes the advantages.

State: one prior per driver process (module level), which is where verl computes advantages.
- Manual: `save_prior(path)` / `load_prior(path)`, `reset_prior()`, `last_stats()`.
- Automatic, when `algorithm.ebpo.prior_dir` or the environment variable `EBPO_PRIOR_DIR` names a
  folder (set it to verl's `trainer.default_local_dir`): after every call the prior is written to
  `<dir>/ebpo_prior/step_<n>.json` (n = calls so far = verl's global step, one advantage call per
  step). On the first call of a process, if `<dir>/latest_checkpointed_iteration.txt` (verl's
  tracker) says N, `step_<N>.json` is loaded and counting continues from N, so a resumed run does
  not re-warm the prior. Files are kept for steps that still have a `global_step_<k>` folder, plus
  the two newest. What is not automatic: resuming from a checkpoint other than the latest
  (`trainer.resume_from_path`) needs `load_prior(<dir>/ebpo_prior/step_<k>.json)` by hand (or
  copy that file over `step_<N>.json`), and the statistics reach verl's metrics only through
  `last_stats()` (verl gives estimators no metrics hook; they are also logged at INFO).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ebpo_lite.algo.advantages import EBPrior, ebpo_advantages

NAME = "ebpo"
PRIOR_DIR_ENV = "EBPO_PRIOR_DIR"
OPTION_KEYS = ("tau2", "sigma2", "center", "decay", "min_count", "tau2_min", "leave_one_out")
KEEP_NEWEST = 2
log = logging.getLogger(__name__)

_state: dict[str, Any] = {"prior": None, "calls": 0, "resumed": False, "stats": {}}


# ----------------------------------------------------------------------------- state


def get_prior() -> EBPrior | None:
    """The module's prior (None before the first call, `load_prior` or `reset_prior`)."""
    return _state["prior"]


def reset_prior(prior: EBPrior | None = None) -> None:
    """Start over with `prior` (None: built from the options at the next call)."""
    _state.update(prior=prior, calls=0, resumed=prior is not None, stats={})


def save_prior(path: str | os.PathLike) -> None:
    """Write the prior's state (and the call count) as JSON, atomically."""
    prior = _state["prior"]
    if prior is None:
        raise RuntimeError("save_prior: no prior yet (the estimator has not been called)")
    _write_json(Path(path), {"calls": _state["calls"], "prior": prior.state_dict()})


def load_prior(path: str | os.PathLike) -> EBPrior:
    """Restore a prior written by `save_prior` (its options travel with it)."""
    data = json.loads(Path(path).read_text())
    prior = EBPrior()
    prior.load_state_dict(data["prior"])
    _state.update(prior=prior, calls=int(data.get("calls", prior.step)), resumed=True)
    return prior


def last_stats() -> dict[str, float]:
    """Stats of the last call (shrinkage, mu_glob, sigma2, tau2, ...), for your own logging."""
    return dict(_state["stats"])


def _options(config: Any) -> tuple[dict[str, Any], str | None]:
    """EBPrior options and prior_dir from `config.ebpo` (DictConfig, dict, AlgoConfig or None)."""
    section = None
    if config is not None:
        getter = getattr(config, "get", None)
        section = getter("ebpo") if callable(getter) else getattr(config, "ebpo", None)
    section = dict(section) if section else {}
    if section.get("prompt_prior"):
        raise ValueError(
            "algorithm.ebpo.prompt_prior: not available in verl: verl gives estimators a fresh "
            "uuid per prompt per batch (ray_trainer sets non_tensor_batch['uid'] = uuid4), so a "
            "prompt's earlier visits cannot be found; use ebpo_lite's trainer or the TRL one"
        )
    section.pop("prompt_prior", None)
    unknown = set(section) - set(OPTION_KEYS) - {"prior_dir"}
    if unknown:
        raise ValueError(
            f"algorithm.ebpo: unknown key(s) {sorted(unknown)}; expected "
            f"{', '.join(OPTION_KEYS)} or prior_dir"
        )
    opts = {k: section[k] for k in OPTION_KEYS if k in section and section[k] is not None}
    for k in ("min_count",):
        if k in opts:
            opts[k] = int(opts[k])
    for k in ("decay", "tau2_min"):
        if k in opts:
            opts[k] = float(opts[k])
    prior_dir = section.get("prior_dir") or os.environ.get(PRIOR_DIR_ENV) or None
    return opts, prior_dir


def _ensure_prior(opts: dict[str, Any], prior_dir: str | None) -> EBPrior:
    if _state["prior"] is None and prior_dir is not None and not _state["resumed"]:
        _maybe_resume(Path(prior_dir))
    if _state["prior"] is None:
        try:
            _state["prior"] = EBPrior(**opts)
        except ValueError as e:
            raise ValueError(f"algorithm.ebpo: {e}") from None
    return _state["prior"]


def _maybe_resume(root: Path) -> None:
    _state["resumed"] = True  # only the first call of a process looks
    tracker = root / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return
    step = int(tracker.read_text().strip())
    path = root / "ebpo_prior" / f"step_{step}.json"
    if path.is_file():
        load_prior(path)
        log.info("ebpo: resumed the prior from %s", path)
    else:
        log.warning(
            "ebpo: verl resumes at step %d but %s is missing: the prior starts empty", step, path
        )
        _state["calls"] = step


def _persist(root: Path) -> None:
    folder = root / "ebpo_prior"
    folder.mkdir(parents=True, exist_ok=True)
    save_prior(folder / f"step_{_state['calls']}.json")
    steps = sorted(
        int(m.group(1))
        for p in folder.iterdir()
        if (m := re.fullmatch(r"step_(\d+)\.json", p.name))
    )
    for s in steps[:-KEEP_NEWEST]:
        if not (root / f"global_step_{s}").is_dir():
            (folder / f"step_{s}.json").unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the estimator


def group_by_uid(index: Any, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row and column of each sample in a padded [B, G] layout grouped by uid.

    Returns row [n], col [n] (long) and G (largest group). Rows follow first appearance.
    """
    if index is None:
        raise ValueError("ebpo: verl passed no `index` (uid per sample); EBPO needs the groups")
    uids = np.asarray(index, dtype=object).reshape(-1)
    if len(uids) != n:
        raise ValueError(f"ebpo: index has {len(uids)} uids for {n} samples")
    row_of: dict[Any, int] = {}
    count: list[int] = []
    row, col = [], []
    for u in uids.tolist():
        r = row_of.setdefault(u, len(row_of))
        if r == len(count):
            count.append(0)
        row.append(r)
        col.append(count[r])
        count[r] += 1
    return (
        torch.tensor(row, dtype=torch.long),
        torch.tensor(col, dtype=torch.long),
        max(count, default=0),
    )


def compute_ebpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    index: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl estimator "ebpo": token_level_rewards [bs, T], response_mask [bs, T] -> (A, A) [bs, T]."""
    opts, prior_dir = _options(config)
    prior = _ensure_prior(opts, prior_dir)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [bs]
        bs = scores.shape[0]
        row, col, G = group_by_uid(index, bs)  # [bs], [bs]
        row, col = row.to(scores.device), col.to(scores.device)
        B = int(row.max()) + 1 if bs else 0
        R = torch.zeros(B, max(G, 2), dtype=scores.dtype, device=scores.device)  # [B, G]
        M = torch.zeros(B, max(G, 2), dtype=torch.bool, device=scores.device)  # [B, G]
        R[row, col] = scores
        M[row, col] = True
        A, stats = ebpo_advantages(R, prior, mask=M)  # [B, G]
        adv = A[row, col].unsqueeze(-1) * response_mask  # [bs, T]
    _state["calls"] += 1
    _state["stats"] = stats
    log.info("ebpo step %d: %s", _state["calls"], {k: round(v, 6) for k, v in stats.items()})
    if prior_dir is not None:
        _persist(Path(prior_dir))
    return adv, adv


def register() -> bool:
    """Register "ebpo" with verl (idempotent). False if verl's core_algos cannot be imported."""
    from verl.trainer.ppo import core_algos

    registry = core_algos.ADV_ESTIMATOR_REGISTRY
    if registry.get(NAME) is compute_ebpo_outcome_advantage:
        return True
    old = registry.get(NAME)
    if (
        old is not None
        and getattr(old, "__qualname__", "") == compute_ebpo_outcome_advantage.__qualname__
    ):
        registry.pop(NAME)  # our own estimator from a re-imported copy of this module
    core_algos.register_adv_est(NAME)(compute_ebpo_outcome_advantage)
    return True


# ----------------------------------------------------------------------------- --check


def check() -> tuple[bool, list[str]]:
    """Is "ebpo" in verl's registry after `import verl`? Lines that say why (not)."""
    from importlib.metadata import entry_points

    lines: list[str] = []
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == NAME]
    lines.append(
        f"entry point verl.plugins:{NAME} -> {eps[0].value}"
        if eps
        else f"entry point verl.plugins:{NAME} is not declared (is ebpo-lite installed in this environment?)"
    )
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto")
    if policy.strip().lower() == "none" or (
        policy.strip().lower() != "auto" and NAME not in {p.strip() for p in policy.split(",")}
    ):
        lines.append(f"VERL_USE_EXTERNAL_PLUGINS={policy!r} excludes '{NAME}'")
    try:
        import verl
        from verl.trainer.ppo import core_algos
    except Exception as e:  # noqa: BLE001 - report anything
        lines.append(f"cannot import verl.trainer.ppo.core_algos: {type(e).__name__}: {e}")
        return False, lines
    lines.append(f"verl {getattr(verl, '__version__', '?')} imported")
    if NAME in core_algos.ADV_ESTIMATOR_REGISTRY:
        fn = core_algos.ADV_ESTIMATOR_REGISTRY[NAME]
        lines.append(f"'{NAME}' is registered ({fn.__module__}.{fn.__qualname__})")
        return True, lines
    lines.append(f"'{NAME}' is NOT registered")
    for ep in eps:  # verl swallowed the error: show it
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001
            lines.append(f"loading the plugin fails: {type(e).__name__}: {e}")
            break
        else:
            lines.append(
                "the plugin imports fine by hand: verl did not load it (old verl? set "
                "VERL_USE_EXTERNAL_MODULES=ebpo_lite.integrations.verl)"
            )
    return False, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ebpo_lite.integrations.verl", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="say whether 'ebpo' is registered in verl"
    )
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 2
    ok, lines = check()
    for line in lines:
        print(line)
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
else:
    register()
