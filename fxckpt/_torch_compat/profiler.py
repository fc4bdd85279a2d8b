"""The CPU allocator's events, through the profiler's internals (part of :mod:`fxckpt._torch_compat`)."""

from __future__ import annotations

import torch

# Memory events. torch's CPU allocator keeps no counters of its own that Python can read; it
# reports each allocation and free to the profiler when memory profiling is on
# (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter). Restricting the profiler to a
# RecordFunction scope that training never enters leaves ops unrecorded, so only those reports
# are collected: the same events torch.profiler.profile(profile_memory=True) lists, at a
# fraction of its cost.


def start_memory_events() -> None:
    """Start recording the calling thread's allocator events (raises if a profiler is on).

    The profiler's start and stop lines on stderr are dropped (:mod:`fxckpt._profiler_log`).
    """
    from torch._C import _autograd, _profiler

    from fxckpt._profiler_log import quiet_trace_lines

    config = _profiler.ProfilerConfig(
        _profiler.ProfilerState.KINETO,
        False,  # report_input_shapes
        True,  # profile_memory
        False,  # with_stack
        False,  # with_flops
        False,  # with_modules
        _profiler._ExperimentalConfig(),
    )
    activities = {_profiler.ProfilerActivity.CPU}
    with quiet_trace_lines():
        _autograd._prepare_profiler(config, activities)
        # The stub omits the scopes argument the binding takes.
        _autograd._enable_profiler(config, activities, {_profiler.RecordScope.STATIC_RUNTIME_MODEL})  # type: ignore[call-arg]


def stop_memory_events() -> list[tuple[int, int, int, str]]:
    """Stop recording; ``(time_ns, ptr, bytes, device)`` per event, in time order.

    ``bytes`` is negative for a free. A free is reported only for a block allocated while
    some profiler recorded memory, so frees of older blocks are missing.
    """
    from torch._C import _autograd, _profiler

    from fxckpt._profiler_log import quiet_trace_lines

    with quiet_trace_lines():
        result = _autograd._disable_profiler()
        stack = list(result.experimental_event_tree())
    events = []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        f = e.extra_fields
        if isinstance(f, _profiler._ExtraFields_Allocation):
            events.append((e.start_time_ns, f.ptr, f.alloc_size, str(f.device.type)))
    events.sort(key=lambda ev: ev[0])
    return events


def profiler_enabled() -> bool:
    """Whether a torch profiler session is recording on this thread."""
    return bool(torch.autograd.profiler._is_profiler_enabled)
