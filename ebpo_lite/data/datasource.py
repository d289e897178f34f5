"""Where the presets' and benchmarks' rows come from: a local data folder, else the hub.

`local_data_root` finds the folder (`data.data_dir`, else EBPO_LITE_DATA; no folder is guessed),
laid out as `presets.LOCAL_FILES` says (`gsm8k/train.jsonl`, `math500/test.jsonl`, ...).
`hub_records` reads a hub dataset with `datasets.load_dataset`, which shows its download progress
and caches it; offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or no connection) without a cached
copy it is one `UserError` line naming the dataset and the setting that points at a local copy,
never the library's exception text as is.
`mathdata` maps the rows to examples.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ebpo_lite.errors import UserError

log = logging.getLogger("ebpo_lite.data.mathdata")


def local_data_root(data_dir: str | None = None) -> tuple[Path | None, str]:
    """(the local data folder, the setting that named it): `data.data_dir`, else EBPO_LITE_DATA;
    (None, "") when neither is set. No folder is guessed from where the code or the shell is, so
    a run reads the data it was told to. The folder is laid out as `presets.LOCAL_FILES` says;
    what it lacks comes from the hub."""
    if data_dir:
        return Path(data_dir).expanduser(), f"data.data_dir={data_dir}"
    env = os.environ.get("EBPO_LITE_DATA")
    if env:
        return Path(env).expanduser(), f"EBPO_LITE_DATA={env}"
    return None, ""


def hub_records(
    what: str, repo: str, config: str | None, split: str, local: str, note: str = ""
) -> Iterator[tuple[str, Any]]:
    """Rows of a hub dataset. `what` names the setting (`data.name: gsm8k`, `benchmark aime24`)
    and `local` the file a local data folder would hold, for the one-line errors; `note` is
    logged once the dataset has loaded."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"{what}: loading {repo} from the hub needs `datasets`") from None
    folder = f"set EBPO_LITE_DATA (or data.data_dir) to a folder holding {local}"
    path = "set data.path to a local json/jsonl/parquet file"
    benchmark = what.startswith("benchmark")
    instead = folder if benchmark else f"{folder}, or {path}" if local else path
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as e:  # offline, no network, unknown id, missing split or config
        if _offline(e):
            raise UserError(
                f"{what}: the hub dataset {repo} is not in the local cache and cannot be "
                f"downloaded ({_offline_reason()}); {instead}"
            ) from None
        raise UserError(
            f"{what}: cannot load the hub dataset {repo} split {split!r} ({_first_line(e)}); "
            f"check the id, or {instead}"
        ) from None
    if note:
        log.warning("%s", note)
    name = f"{repo}:{config}" if config else repo
    for i, row in enumerate(ds, start=1):
        yield f"{name}[{split}]:row {i}", row


def _offline_reason() -> str:
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"downloads are off: {flag}=1"
    return "no connection to the hub"


def _offline(e: Exception) -> bool:
    """Whether `e` says the hub could not be reached (rather than: no such dataset)."""
    if _offline_reason() != "no connection to the hub":
        return True
    names = {t.__name__ for t in type(e).__mro__}
    return bool(names & {"ConnectionError", "OfflineModeIsEnabled", "Timeout", "ProxyError"})


def _first_line(e: Exception) -> str:
    """`Type: first line` of an exception, without a dict or list repr (those say nothing)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if not text or text.lstrip().startswith(("{", "[", "(")):
        return type(e).__name__
    return f"{type(e).__name__}: {text[:200]}"
