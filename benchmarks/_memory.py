"""What the benchmarks share for memory: the CPU allocator's bytes, from profiler events."""

from __future__ import annotations

import gc

from torch.profiler import ProfilerActivity, profile


def allocator_bytes(fn):
    """(fn's result, bytes still live at the end, peak bytes) of the CPU allocator's events
    during `fn()`, both relative to its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        gc.collect()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return out, live, peak
