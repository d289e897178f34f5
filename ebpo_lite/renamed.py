"""Config keys that were renamed: an older recipe or run folder's config.yaml (which `eval` and
`train.resume` read back) still loads, its old key read under the new one with a one-line note.

`RENAMED`: (section, old key) -> (new key, {old value: new value}). An old key set beside its
new key to a different value is a one-line ConfigError naming the old key.
"""

from __future__ import annotations

import sys
from typing import Any

from ebpo_lite.errors import ConfigError

RENAMED = {
    # rollout.sleep (docs/gpu.md): a bool became a choice of three modes
    ("rollout", "sleep_between_phases"): ("sleep", {True: "offload", False: "none"}),
}


def apply_renames(raw: dict[str, Any]) -> None:
    """Rewrite `raw` (a recipe's sections, overrides applied) in place to the current keys."""
    for (section, old), (new, values) in RENAMED.items():
        keys = raw.get(section)
        if not isinstance(keys, dict) or old not in keys:
            continue
        value = keys.pop(old)  # 1 is not true: the old key's type must match
        mapped = next((v for k, v in values.items() if type(k) is type(value) and k == value), None)
        if mapped is None or keys.setdefault(new, mapped) != mapped:
            forms = ", ".join(f"{str(k).lower()}: {section}.{new}={v}" for k, v in values.items())
            raise ConfigError(
                f"{section}.{old}: deprecated ({forms}), got {value!r} with "
                f"{section}.{new}={keys.get(new)}; keep {section}.{new} only"
            )
        print(
            f"note: {section}.{old} is deprecated: read as {section}.{new}={mapped}",
            file=sys.stderr,
        )
