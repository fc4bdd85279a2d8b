"""Runtime profiles: what the offloads of graphs compiled with one set of runtime settings run on.

A profile is one distinct :class:`~fxckpt.runtime.settings.RuntimeSettings` in this process:

- its **engine**: the copy engine of its ``copy_streams``, one per device and stream count,
  shared by every profile with that count (streams cost nothing to share);
- its **host pools**: with a ``host_budget`` in bytes or a fraction of RAM, pools of its own
  capped at that budget, so models compiled with different settings each keep their budget
  and the process holds at most their sum. ``host_budget="auto"`` is the host memory free for
  fxckpt, resolved once per process: every profile that asks for it shares one pool capped
  there (two pools of it would hold twice what was free). Without a budget, the pool every
  uncapped profile shares (``pool.SHARED``);
- its **disk folder**: this process's folder in its ``offload_dir``.

The backend registers a profile at each compile (:func:`register`; a graph served from the
FX graph cache still passes through the backend), and a graph's start ops name it by its key
(:meth:`RuntimeSettings.key`). Every later op of a transfer finds the profile on the
transfer's record. A key that no compile of this process registered (a graph precompiled
elsewhere) is decoded and registered at its first offload. Compiles with the same settings
share one profile, as the graphs of one model do: one budget, held together.

Nothing here is created at import beyond the default profile's record; engines, pools and
folders appear on first use.
"""

from __future__ import annotations

import threading

import torch

from fxckpt import _host
from fxckpt.runtime import disk_dir
from fxckpt.runtime.engine import Engine, get_engine
from fxckpt.runtime.pool import SHARED, HostPool, get_pool
from fxckpt.runtime.settings import RuntimeSettings

AUTO = "auto"  # the owner of the pools every profile with host_budget="auto" shares


class Profile:
    """One set of runtime settings, with ``cap`` its host budget resolved in this process."""

    def __init__(self, settings: RuntimeSettings, cap: int | None,
                 disk: disk_dir.DiskDir | None) -> None:
        self.settings = settings
        self.key = settings.key()
        self.cap = cap
        # The disk tier's folder; the default profile's is set by disk.use_directory (tests,
        # tools calling the ops directly).
        self.disk = disk
        self.disk_warned = False  # the disk tier's one-time warning (disk.warn_once)
        # Whose pools it draws from: its own with a budget, the shared ones without.
        self.owner = SHARED if cap is None else str(self.key)
        if cap is not None and settings.host_budget == "auto":
            self.owner = AUTO

    def engine(self, device: torch.device | str) -> Engine:
        return get_engine(device, self.settings.copy_streams)

    def pool(self, device_type: str) -> HostPool:
        return get_pool(device_type, self.owner, self.cap)

    def __repr__(self) -> str:
        return f"Profile({self.settings.describe()}, cap={self.cap})"


_DEFAULT = Profile(RuntimeSettings(), None, None)
_profiles: dict[str | None, Profile] = {None: _DEFAULT}
_lock = threading.Lock()


def default() -> Profile:
    """The profile of the default settings, which graphs name by omitting the key."""
    return _DEFAULT


def find(key: str | None) -> Profile | None:
    return _profiles.get(key)


def registered() -> list[Profile]:
    """Every profile of this process, the default first."""
    return list(_profiles.values())


def register(settings: RuntimeSettings, cap: int | None) -> Profile:
    """The profile of ``settings``, made the first time they are compiled in this process with
    ``cap`` (their ``host_budget`` in bytes, resolved once). Making it checks ``offload_dir``
    (:class:`~fxckpt.errors.OptionsError` when it cannot be used) and removes what killed
    processes left there. A later compile with the same settings gets the same profile."""
    key = settings.key()
    found = _profiles.get(key)
    if found is not None:
        return found
    with _lock:
        found = _profiles.get(key)
        if found is None:
            root = settings.offload_dir
            found = Profile(settings, cap, disk_dir.use_directory(root) if root else None)
            _profiles[key] = found
        return found


def lookup(key: str | None) -> Profile:
    """The profile a graph's start op names (run time)."""
    found = _profiles.get(key)
    if found is not None:
        return found
    settings = RuntimeSettings.from_key(key)
    # A graph this process did not compile: resolve its budget here, as a compile would.
    return register(settings, _host.resolve_host_budget(settings.host_budget))

