"""What every `python -m ebpo_lite.<command>` shares: quiet libraries, one-line user errors."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

from ebpo_lite.errors import TrainingFault, UserError

_front_door: str | None = None  # `ebpo-lite COMMAND` while ebpo_lite/__main__.py runs one


def prog(module_command: str) -> str:
    """The name a command's usage line shows: how it was started (`ebpo-lite eval`, set by the
    front door in `__main__.py`), else `module_command` (`python -m ebpo_lite.eval`)."""
    return _front_door or module_command


@contextlib.contextmanager
def front_door(name: str):
    """While a command started as `name` (`ebpo-lite eval`) runs, its usage lines say so."""
    global _front_door
    before, _front_door = _front_door, name
    try:
        yield
    finally:
        _front_door = before


def quiet_libraries() -> None:
    """Our progress display and summaries are the output; silence library chatter, but keep the
    hub's download progress bars (a first model download runs for minutes)."""
    import logging
    import warnings

    # The hub's first import loads tqdm.auto, which in a Jupyter kernel without ipywidgets warns
    # "IProgress not found" with its install path (tqdm 4.70, tqdm/autonotebook.py) and falls back
    # to text bars: the same bars the command line shows, so nothing is lost by silencing it.
    warnings.filterwarnings("ignore", message="IProgress not found")
    from huggingface_hub import constants
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as hf_logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # transformers' own bars, and the hub's with them
    if not constants.HF_HUB_DISABLE_PROGRESS_BARS:  # the user's choice wins
        enable_progress_bars()  # the hub's download bars back
    warnings.filterwarnings("ignore", category=FutureWarning)


@contextlib.contextmanager
def quieted():
    """`quiet_libraries()` for the length of a `with` block, then the settings it changed as they
    were: the Python API's entry points (`api.py`) are as quiet as the command line without
    keeping a notebook's own warning filters, `bitsandbytes` log level, transformers verbosity and
    progress bars changed after the call. bitsandbytes logs its kernel-hub warning ("Failed to
    load CPU gemm_4bit_forward from kernels-community", bitsandbytes 0.50.2
    backends/cpu/ops.py) once, when peft first imports it: inside the block, it stays quiet."""
    import logging
    import warnings

    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    bnb = logging.getLogger("bitsandbytes")
    level, verbosity = bnb.level, hf_logging.get_verbosity()
    bars, hub_bars = hf_logging.is_progress_bar_enabled(), not hub.are_progress_bars_disabled()
    with warnings.catch_warnings():  # the filter list as it was, after the block
        quiet_libraries()
        try:
            yield
        finally:
            bnb.setLevel(level)
            hf_logging.set_verbosity(verbosity)
            # transformers' switch sets the hub's too: restore it first, then the hub's own
            if hf_logging.is_progress_bar_enabled() != bars:
                (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
            if hub.are_progress_bars_disabled() == hub_bars:  # differs from what it was
                (hub.enable_progress_bars if hub_bars else hub.disable_progress_bars)()


def run(fn: Callable[..., Any], *args: Any) -> int:
    """Call `fn(*args)`; a `UserError` becomes one line on stderr and exit status 2, a
    `TrainingFault` (the run stopped itself, see `faults.py`) one line and exit status 3."""
    quiet_libraries()
    try:
        fn(*args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingFault as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0
