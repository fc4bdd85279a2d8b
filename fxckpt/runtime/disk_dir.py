"""The disk tier's directory: one private folder per process, and what killed processes left.

Each process that offloads to ``offload_dir`` works in ``offload_dir/fxckpt-<pid>-<token>/``,
which holds a ``lock`` file the process keeps ``flock``-ed for its whole life, and the data
files. The kernel drops a ``flock`` when its holder dies, however it dies (``SIGKILL``
included), so a folder whose lock can be taken belongs to a dead process: the next process
that uses the directory removes it. Pid reuse cannot fool this, as a pid check would be.

The folder is made under a temporary name with its lock already held, then renamed, so a
cleaner never sees a live process's folder without its lock. At exit the process removes its
own folder; a child made by ``fork`` makes its own and never removes its parent's.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field

from fxckpt.errors import OptionsError

PREFIX = "fxckpt-"
_TMP_PREFIX = ".fxckpt-tmp-"
_PROBE_PREFIXES = (".fxckpt-probe-", ".fxckpt-direct-")
# A temporary folder with no lock yet may be another process in the middle of making it.
_TMP_GRACE_S = 60.0
_ACCEPTED = "the path of an existing directory this process can write (ideally on NVMe)"


@dataclass(eq=False)
class DiskDir:
    """This process's folder in one ``offload_dir``."""

    root: str
    path: str
    direct: bool
    lock_fd: int
    pid: int = field(default_factory=os.getpid)
    _names: itertools.count = field(default_factory=itertools.count)

    def new_file(self) -> str:
        return os.path.join(self.path, f"{next(self._names)}.bin")

    def files(self) -> list[str]:
        """The data files in the folder now (not the lock)."""
        try:
            return sorted(n for n in os.listdir(self.path) if n != "lock")
        except FileNotFoundError:
            return []


_dirs: dict[str, DiskDir] = {}
_lock = threading.Lock()
_at_exit = False


def use_directory(root: str, *, direct: bool | None = None) -> DiskDir:
    """This process's folder in ``root``, made on first use after removing dead processes'.

    ``direct``: whether to use ``O_DIRECT`` (``None``: probe the file system).
    Raises :class:`OptionsError` naming ``offload_dir`` when ``root`` is missing, not a
    directory, or not writable.
    """
    from fxckpt import _files

    global _at_exit
    with _lock:
        if not _at_exit:  # registered on first use: importing fxckpt has no side effects
            atexit.register(close_all)
            _at_exit = True
        found = _dirs.get(root)
        if found is not None and found.pid == os.getpid():
            return found
        _check(root)
        remove_stale(root)
        made = _make(root)
        try:
            if direct is None:
                direct = bool(_files._O_DIRECT) and _files.FILES.direct_ok(made[0])
        except OSError as err:
            _remove_tree(made[0], made[1])
            raise _unwritable(root, err) from None
        found = DiskDir(root, made[0], direct, made[1])
        _dirs[root] = found
        return found


def _check(root: str) -> None:
    if not os.path.exists(root):
        raise OptionsError("offload_dir", root, _ACCEPTED, "no such directory; create it first")
    if not os.path.isdir(root):
        raise OptionsError("offload_dir", root, _ACCEPTED, "not a directory")


def check_directory(root: str) -> None:
    """Raise :class:`OptionsError` naming ``offload_dir`` when ``root`` is missing, not a
    directory, or not one this process may write and enter; touches nothing there (the
    first compile makes the process's folder, :func:`use_directory`)."""
    _check(root)
    if not os.access(root, os.W_OK | os.X_OK):
        raise OptionsError("offload_dir", root, _ACCEPTED, "cannot write there: permission denied")


def _unwritable(root: str, err: OSError) -> OptionsError:
    why = err.strerror or str(err)
    return OptionsError("offload_dir", root, _ACCEPTED, f"cannot write there: {why}")


def _make(root: str) -> tuple[str, int]:
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = os.path.join(root, _TMP_PREFIX + token)
    try:
        os.mkdir(tmp, 0o700)
        fd = os.open(os.path.join(tmp, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _unwritable(root, err) from None
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    final = os.path.join(root, PREFIX + token)
    os.rename(tmp, final)
    return final, fd


def remove_stale(root: str) -> list[str]:
    """Remove the folders (and probe files) of processes that died; returns what went."""
    gone: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    mine = {d.path for d in _dirs.values() if d.pid == os.getpid()}
    for name in names:
        path = os.path.join(root, name)
        if path in mine:
            continue
        if name.startswith((PREFIX, _TMP_PREFIX)) and os.path.isdir(path):
            if _owner_dead(path, tmp=name.startswith(_TMP_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)
                gone.append(path)
        elif name.startswith(_PROBE_PREFIXES) and not _alive(_pid_in(name)):
            try:
                os.unlink(path)
                gone.append(path)
            except OSError:
                pass
    return gone


def _owner_dead(path: str, *, tmp: bool) -> bool:
    try:
        fd = os.open(os.path.join(path, "lock"), os.O_RDWR)
    except FileNotFoundError:
        # No lock: a temporary folder being made right now, or one whose maker died first.
        try:
            return tmp and time.time() - os.stat(path).st_mtime > _TMP_GRACE_S
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False  # its process holds the lock: alive
        raise
    finally:
        os.close(fd)  # also lets go of the lock if we took it
    return True


def _pid_in(name: str) -> int:
    try:
        return int(name.split("-")[2])
    except (IndexError, ValueError):
        return -1


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_tree(path: str, fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.close(fd)
    except OSError:
        pass


def close_all() -> None:
    """Remove this process's folders (their files included); runs at exit."""
    with _lock:
        dirs = [d for d in _dirs.values() if d.pid == os.getpid()]
        _dirs.clear()
    for d in dirs:
        _remove_tree(d.path, d.lock_fd)


def active() -> list[DiskDir]:
    return [d for d in _dirs.values() if d.pid == os.getpid()]

