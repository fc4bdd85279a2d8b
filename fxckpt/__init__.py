"""fxckpt: a torch.compile backend that gives training its memory back.

``torch.compile(model, backend="fxckpt", options={"memory_budget": "12GiB",
"segment_stride": 2})`` decides, for each activation saved for the backward, whether to keep
it, recompute it or offload it to host memory.
"""

from __future__ import annotations

import json
from typing import Any

__version__ = "0.1.0"

# ``fxckpt.backend`` and ``fxckpt.inspect`` are modules that are also their function: called,
# they build a backend and plan offline (fxckpt/_modules.py).
from fxckpt import _torch_compat, backend, inspect
from fxckpt._capacity import emulate_device_memory
from fxckpt.emulation import EmulatedLink, emulate_link
from fxckpt.errors import BudgetError, FxckptError, OptionsError, RuntimeCopyError
from fxckpt.integrations import register_with_accelerate
from fxckpt.meter import Measurement, Meter, measure
from fxckpt.options import Options
from fxckpt.planning.plan import Keep, Offload, Plan, PlannedActivation, Recompute
from fxckpt.planning.start_level import watch
from fxckpt.runtime import ops as _ops  # noqa: F401  (registers the fxckpt:: ops)
from fxckpt.runtime import stats as _stats
from fxckpt.runtime import weight_ops as _weight_ops  # noqa: F401  (and those of streamed weights)
from fxckpt.weights import StreamedWeights, stream_weights

_torch_compat.register_logging()
# backend="fxckpt" from a source tree too (PYTHONPATH=.), where no entry point is installed.
_torch_compat.register_backend_name("fxckpt", "fxckpt.backend:fxckpt_backend")


def last_plans() -> list[Plan]:
    """The plans of every graph compiled or run since the last :func:`reset_stats`.

    Graphs loaded from a warm compile cache report their plan the first time they run,
    because the plan travels inside the compiled forward.
    """
    from fxckpt.passes.inductor_peak import corrected

    return [corrected(Plan.from_dict(json.loads(p)), p) for p in _stats.plan_payloads() if p]


def stats() -> dict[str, Any]:
    """What the runtime counted (bytes moved, fallbacks, stalls, the host pool) and, per
    compiled graph and added up, the planned figures (``planned_kept_bytes``,
    ``planned_peak_bytes``). Planned figures are not measurements: :func:`measure` is."""
    return _stats.snapshot()


def reset_stats() -> None:
    """Zero the counters and forget recorded plans."""
    _stats.reset()


__all__ = [
    "BudgetError",
    "EmulatedLink",
    "FxckptError",
    "Keep",
    "Measurement",
    "Meter",
    "Offload",
    "Options",
    "OptionsError",
    "Plan",
    "PlannedActivation",
    "Recompute",
    "RuntimeCopyError",
    "StreamedWeights",
    "__version__",
    "backend",
    "emulate_device_memory",
    "emulate_link",
    "inspect",
    "last_plans",
    "measure",
    "register_with_accelerate",
    "reset_stats",
    "stats",
    "stream_weights",
    "watch",
]
