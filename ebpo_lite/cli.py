"""What every `python -m ebpo_lite.<command>` shares: quiet libraries, one-line user errors."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ebpo_lite.errors import TrainingFault, UserError


def quiet_libraries() -> None:
    """Our progress display and summaries are the output; silence library chatter."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


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
