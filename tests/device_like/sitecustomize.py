"""Hide packages from every Python started with this folder on PYTHONPATH, as if not installed.

tests/test_gpu_smoke.py rehearses scripts/gpu_smoke.py on the CPU in processes that must see the
package set of the lent GPU machine (which has no vllm, datasets or math-verify): the names in
EBPO_HIDE_MODULES (comma-separated top-level names) are found by no finder, so `import` raises
ModuleNotFoundError and `importlib.util.find_spec` returns None, exactly as when absent.
"""

import os
import sys

_HIDDEN = frozenset(filter(None, os.environ.get("EBPO_HIDE_MODULES", "").split(",")))


class _Hiding:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self._finder, attr)


if _HIDDEN:
    sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]
