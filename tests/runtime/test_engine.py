"""The CPU copy engine: missing waits are caught, failures surface, threads are safe."""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fxckpt.errors import RuntimeCopyError
from fxckpt.runtime import engine, ops, pool, stats
from fxckpt.runtime.settings import RuntimeSettings

OPS = torch.ops.fxckpt
# Every test here runs at memcpy speed and through an emulated link (conftest.py).
pytestmark = pytest.mark.usefixtures("link_mode")
RUNTIME = Path(ops.__file__).parent
TWO_STREAMS = RuntimeSettings(copy_streams=2).key()


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure()
    pool.set_pool_cap(None)
    stats.reset()
    yield
    engine.configure()
    pool.set_pool_cap(None)


def _wait(h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return OPS.wait(h, h, like.shape, like.stride(), like.dtype, like.device)


def _in_thread(fn, timeout: float = 20.0):
    """Run ``fn`` where a hang turns into a test failure instead of a stuck suite."""
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(fn).result(timeout=timeout)


def test_a_skipped_wait_reads_a_buffer_the_copy_has_not_reached():
    # The only difference from a correct run is the skipped wait: fresh buffers are poisoned
    # in both, so a wrong read cannot match the source by luck.
    src = torch.randn(128, 64)
    engine.configure(copy_delay_s=0.5, poison_fresh=True, unsafe_skip_waits=True)
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    OPS.prefetch(h)
    raced = _wait(h, src)
    assert not torch.equal(raced, src)
    engine.configure(copy_delay_s=0.5, poison_fresh=True)
    assert torch.equal(_wait(h, src), src)


def test_offload_done_is_what_protects_the_source_from_in_place_reuse():
    # Inductor may write into the source's buffer after offload_done; before it, the copy may
    # not have read it yet. Writing right after a skipped offload_done corrupts the restore.
    def reuse_source_in_place(skip: bool) -> bool:
        src = torch.randn(256)
        expected = src.clone()
        engine.configure(copy_delay_s=0.3, unsafe_skip_waits=skip)
        h = OPS.offload(src)
        OPS.offload_done(h, src)
        src.fill_(0.0)
        engine.configure()
        return torch.equal(_wait(h, src), expected)

    assert reuse_source_in_place(skip=False)
    assert not reuse_source_in_place(skip=True)


def test_failed_offload_copy_raises_at_offload_done_and_at_wait_then_recovers():
    gc.collect()
    before = ops.live_handles()
    src = torch.randn(32, 32)
    engine.configure(copy_delay_s=0.01, fail_next_copies=1)
    handles = [OPS.offload(src)]
    with pytest.raises(RuntimeCopyError, match="device-to-host.*injected"):
        _in_thread(lambda: OPS.offload_done(handles[0], src))
    with pytest.raises(RuntimeCopyError, match="device-to-host copy .* failed earlier"):
        _in_thread(lambda: _wait(handles[0], src))
    handles[0] = OPS.offload(src)  # the next round works
    OPS.offload_done(handles[0], src)
    assert torch.equal(_in_thread(lambda: _wait(handles[0], src)), src)
    handles.clear()
    gc.collect()
    # A failure must not pin its handle: re-raising a stored exception appends frames
    # (which hold the handle) to a traceback that the handle's own record keeps.
    assert ops.live_handles() == before


def test_failed_prefetch_copy_raises_at_wait_without_hanging():
    src = torch.randn(1000).to(torch.bfloat16)
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    engine.configure(copy_delay_s=0.01, fail_next_copies=1)
    OPS.prefetch(h)
    with pytest.raises(RuntimeCopyError, match="host-to-device.*injected"):
        _in_thread(lambda: _wait(h, src))
    h2 = OPS.offload(src)
    assert torch.equal(_in_thread(lambda: _wait(h2, src)), src)


def test_shutdown_cancels_queued_copies_into_errors_not_hangs():
    engine.configure(copy_delay_s=0.2)
    srcs = [torch.randn(64) for _ in range(4)]
    handles = [OPS.offload(s) for s in srcs]  # one worker, 0.2 s each: at least three queue
    engine.shutdown_all()
    outcomes = []
    for h, s in zip(handles, srcs, strict=True):
        try:
            outcomes.append(torch.equal(_in_thread(lambda h=h, s=s: _wait(h, s)), s))
        except RuntimeCopyError:
            outcomes.append("error")
    assert outcomes.count("error") >= 3
    assert all(o in (True, "error") for o in outcomes)
    engine.configure()
    h = OPS.offload(srcs[0])  # engines come back lazily
    assert torch.equal(_wait(h, srcs[0]), srcs[0])


def test_concurrent_round_trips_from_two_threads_are_exact():
    engine.configure(copy_delay_s=0.0005, poison_fresh=True)
    errors: list[str] = []

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for i in range(100):
            base = torch.randn(40 + i % 7, 24, generator=gen)
            src = base[1:, 2:] if i % 2 else base.t()
            h = OPS.offload(src, profile=TWO_STREAMS)
            OPS.offload_done(h, src)
            OPS.prefetch(h)
            if not torch.equal(_wait(h, src), src):
                errors.append(f"thread {seed} step {i}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    snap = stats.snapshot()
    assert snap["offload_calls"] == 200
    assert snap["offloaded_bytes"] == snap["prefetched_bytes"] > 0


def test_a_profiles_copy_streams_set_its_engines_worker_count():
    engine.shutdown_all()
    engine.configure(copy_delay_s=0.05)
    srcs = [torch.randn(16) for _ in range(3)]
    three = RuntimeSettings(copy_streams=3).key()
    handles = [OPS.offload(s, profile=three) for s in srcs]
    names = {t.name for t in threading.enumerate() if t.name.startswith("fxckpt-d2h-3")}
    assert len(names) == 3
    assert engine.get_engine("cpu", 3).streams == 3
    for h, s in zip(handles, srcs, strict=True):
        assert torch.equal(_wait(h, s), s)


def test_engines_of_two_stream_counts_run_side_by_side_with_the_injected_faults():
    engine.configure(copy_delay_s=0.01, fail_next_copies=1)
    src = torch.randn(8)
    h = OPS.offload(src, profile=TWO_STREAMS)
    with pytest.raises(RuntimeCopyError, match="injected"):
        _in_thread(lambda: _wait(h, src))
    one, two = OPS.offload(src), OPS.offload(src, profile=TWO_STREAMS)
    assert (ops._records[int(one)].profile.settings.copy_streams,
            ops._records[int(two)].profile.settings.copy_streams) == (1, 2)
    assert torch.equal(_in_thread(lambda: _wait(one, src)), src)
    assert torch.equal(_in_thread(lambda: _wait(two, src)), src)
    assert engine.get_engine("cpu", 1) is not engine.get_engine("cpu", 2)


def test_configure_rejects_nonsense():
    with pytest.raises(ValueError, match="copy_streams"):
        engine.get_engine("cpu", 0)
    with pytest.raises(ValueError):
        engine.configure(copy_delay_s=-1)


def test_unsupported_device_is_a_clear_error():
    with pytest.raises(RuntimeCopyError, match="not supported"):
        engine.get_engine("meta")


def test_one_engine_per_device_and_stream_count():
    assert engine.get_engine("cpu") is engine.get_engine(torch.device("cpu"), 1)
    assert isinstance(engine.get_engine("cpu"), engine.CpuEngine)
    assert engine.get_engine("cpu", 2) is engine.get_engine("cpu", 2) is not engine.get_engine("cpu")


def test_importing_the_ops_creates_nothing():
    code = textwrap.dedent(
        """
        import threading, torch
        before = threading.active_count()
        import fxckpt.runtime.ops
        from fxckpt.runtime import engine, pool, stats
        assert threading.active_count() == before, threading.enumerate()
        assert engine._engines == {} and pool._pools == {}
        assert not torch.cuda.is_initialized()
        assert stats.snapshot()["pool_bytes"] == 0
        assert torch.ops.fxckpt.wait.default is not None
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_runtime_imports_only_errors_and_the_hardware_seams_from_the_rest_of_fxckpt():
    # The seams: fxckpt._cuda (the GPU), fxckpt._files (the disk tier's files),
    # fxckpt._link (the emulated host link), fxckpt._host (the host's memory) and
    # fxckpt._torch_compat (torch's internals, such as a tensor's version counter).
    for path in sorted(RUNTIME.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if node.module == "fxckpt":
                    names = [f"fxckpt.{alias.name}" for alias in node.names]
                assert node.level == 0, f"{path.name}: use absolute imports"
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name == "fxckpt" or name.startswith("fxckpt."):
                    assert name in ("fxckpt.errors", "fxckpt._cuda", "fxckpt._files",
                                    "fxckpt._link", "fxckpt._host",
                                    "fxckpt._torch_compat") or name.startswith(
                        "fxckpt.runtime"
                    ), (
                        f"{path.name} imports {name}"
                    )


def test_the_copy_worker_lets_go_of_the_source_before_it_signals_completion(monkeypatch):
    # Compute drops its reference to the source (rec.src) as soon as it sees the copy done;
    # if the worker still held a view then, the source would be freed on the worker thread,
    # which the CPU memory meter cannot see (it counted such tensors as still resident).
    import concurrent.futures

    src = torch.randn(4096)
    cdata = src.untyped_storage()._cdata
    users = torch._C._storage_Use_Count  # tensors (and views) sharing the storage
    alone = users(cdata)  # src alone
    at_completion: list[int] = []
    real_set_result = concurrent.futures.Future.set_result

    def set_result(self, result):
        at_completion.append(users(cdata))
        real_set_result(self, result)

    monkeypatch.setattr(concurrent.futures.Future, "set_result", set_result)
    engine.configure(copy_delay_s=0.05)  # the copy runs after start_offload has returned
    eng = engine.get_engine("cpu")
    part = engine.Part((4096,), (1,), 4096, 0, src.nbytes)
    rec = engine.Transfer(hid=0, parts=(part,), dtype=src.dtype, device=src.device,
                          nbytes=src.nbytes, src=src)  # fmt: skip
    host = torch.empty(src.nbytes, dtype=torch.uint8)
    eng.start_offload(rec, [(src.view(torch.uint8), host)])
    eng.finish_offload(rec)
    assert at_completion == [alone]  # only src itself: the worker's view is already gone
    assert torch.equal(host.view(torch.float32), src)
