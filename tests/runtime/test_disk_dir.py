"""The disk tier's directory: bad directories refused at compile time, one private folder per
process, removed at exit, and the folders of killed processes removed by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fxckpt.errors import OptionsError
from fxckpt.runtime import disk_dir

ROOT = Path(__file__).resolve().parents[2]

# Offloads three tensors to the disk tier, waits until their files are written, says so, and
# waits for a line on stdin with the handles alive (a process in the middle of a step); then
# exits normally.
MID_STEP = """
import sys, torch
from fxckpt.runtime import disk
where = disk.use_directory(sys.argv[1])
srcs = [torch.randn(4096) for _ in range(3)]
handles = [torch.ops.fxckpt.offload(s, disk.DISK) for s in srcs]
disk.wait_for_staging()
print(where.path, len(where.files()), flush=True)
sys.stdin.readline()
"""


def _start(root: Path) -> tuple[subprocess.Popen[str], str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", MID_STEP, str(root)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert len(line) == 2, proc.stderr.read() if proc.stderr else ""
    return proc, line[0], int(line[1])


@pytest.fixture(autouse=True)
def _forget_dirs():
    yield
    disk_dir.close_all()


def test_a_missing_directory_is_refused() -> None:
    with pytest.raises(OptionsError, match="no such directory") as info:
        disk_dir.use_directory("/no/such/fxckpt/dir")
    assert info.value.option == "offload_dir" and info.value.value == "/no/such/fxckpt/dir"


def test_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a-file"
    path.write_text("")
    with pytest.raises(OptionsError, match="not a directory"):
        disk_dir.use_directory(str(path))


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs, unwritable even to root")
def test_an_unwritable_directory_is_refused() -> None:
    with pytest.raises(OptionsError, match="cannot write there") as info:
        disk_dir.use_directory("/sys/kernel")
    assert "offload_dir" in str(info.value)


def test_a_killed_process_folder_goes_at_the_next_start_a_live_one_stays_and_goes_at_its_exit(
    tmp_path: Path,
) -> None:
    killed, killed_path, files = _start(tmp_path)
    alive, alive_path, _ = _start(tmp_path)
    try:
        assert killed_path != alive_path
        assert os.path.basename(killed_path).startswith(disk_dir.PREFIX)
        killed.send_signal(signal.SIGKILL)  # mid-step: its files are on disk, its atexit never runs
        killed.wait(timeout=60)
        assert files == 3 and len(os.listdir(killed_path)) == 4  # 3 files and the lock
        mine = disk_dir.use_directory(str(tmp_path))
        assert not os.path.exists(killed_path)
        assert os.path.exists(alive_path)  # its process holds the lock
        assert sorted(os.listdir(tmp_path)) == sorted(
            os.path.basename(p) for p in (alive_path, mine.path)
        )
        assert os.listdir(mine.path) == ["lock"]
        alive.communicate("done\n", timeout=120)  # a normal exit, handles still alive
        assert alive.returncode == 0
        assert not os.path.exists(alive_path)  # removed at exit, files and lock included
    finally:
        for proc in (killed, alive):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def test_a_forked_child_makes_its_own_folder_and_leaves_its_parents(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, sys
        from fxckpt.runtime import disk_dir
        parent = disk_dir.use_directory({str(tmp_path)!r})
        pid = os.fork()
        if pid == 0:
            child = disk_dir.use_directory({str(tmp_path)!r})
            assert child.path != parent.path
            sys.exit(0)  # a normal exit: the child's atexit runs
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        print(os.path.exists(parent.path), len(os.listdir({str(tmp_path)!r})))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1"]  # the parent's folder alone; the child's went
