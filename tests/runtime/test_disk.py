"""The disk tier on the CPU engine: exact round trips, each ordering rule of ``disk.py``
(W1, W2, R1, F1) made visible by injected delays, and every fault: a full disk, a file
deleted or truncated before its read, no staging to be had, no directory configured, a file
system without ``O_DIRECT``."""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterator

import pytest
import torch
from files_double import FilesDouble

from fxckpt import _files
from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import disk, disk_dir, engine, ops, pool, profiles, stats
from fxckpt.runtime.disk import DiskTierWarning
from fxckpt.runtime.handles import span_of
from fxckpt.runtime.pool import HostMemoryWarning

OPS = torch.ops.fxckpt
# Every test here runs at memcpy speed and through an emulated link (conftest.py).
pytestmark = pytest.mark.usefixtures("link_mode")


@pytest.fixture
def files(monkeypatch: pytest.MonkeyPatch) -> FilesDouble:
    double = FilesDouble()
    monkeypatch.setattr(_files, "FILES", double)
    return double


@pytest.fixture
def where(tmp_path, files: FilesDouble, monkeypatch: pytest.MonkeyPatch) -> Iterator[disk_dir.DiskDir]:
    engine.configure()
    pool.set_pool_cap(None)
    monkeypatch.setattr(profiles.default(), "disk", None)
    found = disk.use_directory(str(tmp_path))
    stats.reset()
    yield found
    engine.configure()
    pool.set_pool_cap(None)
    disk.shutdown()
    gc.collect()
    disk.collect()
    disk_dir.close_all()


def offload(src: torch.Tensor) -> torch.Tensor:
    h = OPS.offload(src, disk.DISK)
    OPS.offload_done(h, src)
    return h


def restore(h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    ticket = OPS.prefetch(h)
    return OPS.wait(h, ticket, like.shape, like.stride(), like.dtype, like.device)


def settle() -> None:
    """Let the writer finish and the dead handles' files go."""
    disk.wait_for_staging()
    gc.collect()
    stats.snapshot()  # runs the tier's collector


LAYOUTS = {
    "contiguous": lambda: torch.randn(37, 29),
    "transposed": lambda: torch.randn(64, 33).t(),
    "sliced": lambda: torch.randn(40, 40)[3:, 5:31],
    "broadcast": lambda: torch.randn(1, 300).expand(7, 300),
    "big": lambda: torch.randn(300_000),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_round_trip_through_a_file_is_exact_and_the_file_goes_with_the_handle(
    where: disk_dir.DiskDir, layout: str
) -> None:
    src = LAYOUTS[layout]()
    want = src.clone()
    h = offload(src)
    settle()
    assert len(where.files()) == 1
    got = restore(h, src)
    assert torch.equal(got, want) and got.stride() == src.stride()
    again = restore(h, src)  # a second backward (retain_graph=True) reads the file again
    assert torch.equal(again, want)
    snap = stats.snapshot()
    span_bytes = span_of(src) * src.element_size()
    assert snap["disk_bytes"] == span_bytes and snap["disk_files"] == 1
    assert snap["disk_write_seconds"] > 0 and snap["disk_read_seconds"] > 0
    del h
    settle()
    assert where.files() == [] and stats.snapshot()["disk_files"] == 0
    assert pool.get_pool("cpu").usage()["in_use_bytes"] == 0


def test_w1_the_write_waits_for_the_device_to_host_copy(where: disk_dir.DiskDir) -> None:
    engine.configure(copy_delay_s=0.05)  # the D2H copy lands late; the file must not be early
    srcs = [torch.randn(4096) for _ in range(3)]
    handles = [offload(s) for s in srcs]
    for h, s in zip(handles, srcs, strict=True):
        assert torch.equal(restore(h, s), s)


def test_w2_a_staging_buffer_is_reused_only_after_its_write(
    where: disk_dir.DiskDir, files: FilesDouble
) -> None:
    # Writes are slow and every tensor takes the same size class: a buffer handed back before
    # its write read it would be filled by the next offload first.
    files.write_delay_s = 0.03
    srcs = [torch.randn(2048) for _ in range(6)]
    handles = [offload(s) for s in srcs]
    for h, s in zip(handles, srcs, strict=True):
        assert torch.equal(restore(h, s), s)
    assert stats.snapshot()["pool_hits"] > 0  # buffers were reused


def test_r1_a_read_waits_for_its_write(where: disk_dir.DiskDir, files: FilesDouble) -> None:
    files.write_delay_s = 0.05
    src = torch.randn(5000)
    h = offload(src)
    assert torch.equal(restore(h, src), src)  # the backward came before the write ended


def test_a_handle_that_dies_during_its_write_leaves_no_file_and_no_buffer(
    where: disk_dir.DiskDir, files: FilesDouble
) -> None:
    files.write_delay_s = 0.05
    src = torch.randn(3000)
    h = OPS.offload(src, disk.DISK)
    del h  # an exception in the forward: the handle dies before its write is done
    settle()
    assert where.files() == []
    assert pool.get_pool("cpu").usage()["in_use_bytes"] == 0
    assert ops.live_handles() == 0


def test_a_full_disk_keeps_the_copy_in_host_memory_with_one_warning(
    where: disk_dir.DiskDir, files: FilesDouble
) -> None:
    files.full_after = 1  # the second write and later find the disk full
    srcs = [torch.randn(1000 + 100 * i) for i in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handles = [offload(s) for s in srcs]
        settle()
    ours = [w for w in caught if issubclass(w.category, DiskTierWarning)]
    assert len(ours) == 1 and "ENOSPC" in str(ours[0].message)
    assert "stays in host memory" in str(ours[0].message)
    assert files.failed_writes == 3 and len(where.files()) == 1
    assert stats.snapshot()["disk_fallbacks"] == 3
    for h, s in zip(handles, srcs, strict=True):
        assert torch.equal(restore(h, s), s)
    del handles, h
    settle()
    assert pool.get_pool("cpu").usage()["in_use_bytes"] == 0  # the host copies went too


@pytest.mark.parametrize("fault", ["deleted", "truncated"])
def test_a_file_deleted_or_truncated_before_its_read_is_a_clear_error(
    where: disk_dir.DiskDir, fault: str
) -> None:
    src = torch.randn(8192)
    h = offload(src)
    settle()
    (name,) = where.files()
    path = os.path.join(where.path, name)
    if fault == "deleted":
        os.unlink(path)
    else:
        os.truncate(path, 4096)
    with pytest.raises(RuntimeCopyError, match=f"was {fault}") as info:
        restore(h, src)
    assert path in str(info.value) and "offload_dir" in str(info.value)


def test_no_staging_to_be_had_keeps_the_tensor_on_the_device(where: disk_dir.DiskDir) -> None:
    pool.set_pool_cap(0)
    src = torch.randn(1000)
    with pytest.warns(HostMemoryWarning, match="stays on the device"):
        h = offload(src)
    assert torch.equal(restore(h, src), src)
    assert where.files() == [] and stats.snapshot()["fallbacks"] == 1


def test_a_disk_tier_op_without_a_directory_goes_to_host_memory_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(profiles.default(), "disk", None)
    monkeypatch.setattr(profiles.default(), "disk_warned", False)
    srcs = [torch.randn(100), torch.randn(200)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handles = [offload(s) for s in srcs]
    assert sum(issubclass(w.category, DiskTierWarning) for w in caught) == 1
    for h, s in zip(handles, srcs, strict=True):
        assert torch.equal(restore(h, s), s)


def test_a_file_system_that_refuses_o_direct_gets_buffered_io(
    where: disk_dir.DiskDir, files: FilesDouble
) -> None:
    files.refuse_direct = True
    where.direct = True  # as if the probe had passed
    src = torch.randn(3333)
    h = offload(src)
    assert torch.equal(restore(h, src), src)
    assert files.writes and files.writes[-1][1] is False
    assert where.direct is False


def test_the_host_tier_waits_for_staging_rather_than_fall_back(
    where: disk_dir.DiskDir, files: FilesDouble
) -> None:
    # Room for two staging buffers or one host buffer: the host-tier offload must wait for
    # the slow writes to give their buffers back, not keep its tensor on the device.
    files.write_delay_s = 0.05
    first = [torch.randn(1024) for _ in range(2)]
    cls = pool.size_class(disk.staged_bytes(4096))
    pool.set_pool_cap(2 * cls)
    handles = [offload(s) for s in first]
    late = torch.randn(1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryWarning)
        hl = OPS.offload(late)
        OPS.offload_done(hl, late)
    assert stats.snapshot()["fallbacks"] == 0
    assert torch.equal(restore(hl, late), late)
    for h, s in zip(handles, first, strict=True):
        assert torch.equal(restore(h, s), s)
