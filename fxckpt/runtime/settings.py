"""The runtime settings of one compile, and the key that names them inside compiled graphs.

``copy_streams``, ``host_budget`` and ``offload_dir`` say how a graph's offloads run: on how
many copy streams, in a host pool capped at what, with files in which directory. Each
distinct set of them is one runtime *profile* (:mod:`fxckpt.runtime.profiles`). A compiled
graph names its profile by :meth:`RuntimeSettings.key`, an argument of its start ops
(``fxckpt::offload``, ``fxckpt::offload_many``), so the same graph served from Inductor's
FX graph cache in another process finds the same settings. The key is the settings
themselves, as compact JSON of the values that differ from the defaults (``None`` when none
do: the ops then omit it). It holds ``host_budget`` as written (``"auto"``, a fraction of RAM
or bytes), never a figure resolved on one machine at one moment.

Importing this module imports nothing but the standard library (``fxckpt.options`` uses it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fxckpt.errors import RuntimeCopyError


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    """The options of one compile that the runtime, not the planner, carries out.

    ``host_budget`` is as :class:`fxckpt.Options` normalised it: ``None``, an int of bytes, a
    float fraction of the machine's RAM or ``"auto"``. ``offload_dir`` is an absolute path.
    """

    copy_streams: int = 1
    host_budget: int | float | str | None = None
    offload_dir: str | None = None

    def key(self) -> str | None:
        """The profile key the graph's start ops carry; ``None`` for the defaults."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if getattr(self, f.name) != f.default}  # fmt: skip
        if not doc:
            return None
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_key(cls, key: str | None) -> RuntimeSettings:
        """The settings a key names (inverse of :meth:`key`); a key no fxckpt wrote raises
        :class:`RuntimeCopyError`."""
        if key is None:
            return cls()
        try:
            doc = json.loads(key)
            if not isinstance(doc, dict) or set(doc) - {f.name for f in dataclasses.fields(cls)}:
                raise ValueError("not an object of runtime settings")
            settings = cls(**doc)
            _check(settings)
        except (ValueError, TypeError) as err:
            raise RuntimeCopyError(
                f"fxckpt: a compiled graph names the runtime profile {key!r}, which is not a key "
                f"of runtime settings ({err}); it was not written by this version of fxckpt. "
                "Clear the compile cache (TORCHINDUCTOR_CACHE_DIR) and compile again."
            ) from None
        return settings

    def describe(self) -> str:
        """``copy_streams=2, host_budget='64MiB'``-style text of the settings, for messages."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))


def _check(s: RuntimeSettings) -> None:
    if isinstance(s.copy_streams, bool) or not isinstance(s.copy_streams, int) or s.copy_streams < 1:
        raise ValueError(f"copy_streams={s.copy_streams!r}")
    budget: Any = s.host_budget
    number = isinstance(budget, (int, float)) and not isinstance(budget, bool)
    if not (budget is None or budget == "auto" or (number and budget >= 0)):
        raise ValueError(f"host_budget={budget!r}")
    if s.offload_dir is not None and not isinstance(s.offload_dir, str):
        raise ValueError(f"offload_dir={s.offload_dir!r}")
