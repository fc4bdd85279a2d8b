"""Soak: 1,000 training steps of a small GPT with offload, and nothing grows.

After warm-up, the host pool holds the same bytes (no new host allocation at all), the
meter finds nothing left on the device by a forward and the same peak, the process RSS stays
within a small bound, the number of live tensors, handles, threads and
engines is the same at the end as after warm-up, and the plan registry holds one plan.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import threading
import warnings

import pytest
import torch
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.backend import runtime_profile
from fxckpt.runtime import engine, ops, pool, stats

STEPS = 1000
WARMUP = 100
# RSS may move by allocator noise (glibc arenas, torch's CPU allocator); a real leak of even
# one small activation per step (4 KiB x 900 steps = 3.5 MiB) would show in the trend below.
RSS_SLACK_BYTES = 24 * 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live_tensors() -> int:
    with warnings.catch_warnings():  # isinstance on some torch module objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _fxckpt_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("fxckpt-"))


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure()
    pool.set_pool_cap(None)
    # Tensors this small gain nothing from intra-op threads, and on a busy 2-core CI machine
    # OpenMP's spinning workers fight the copy workers: one thread keeps 1,000 steps quick.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    engine.configure()
    pool.set_pool_cap(None)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
# Unit costs price no per-copy overhead: one transfer per tensor. Flops costs do: copy buckets.
@pytest.mark.parametrize("cost_model", ["unit", "flops"])
def test_1000_steps_with_offload_leave_pool_rss_threads_and_tensors_flat(cost_model: str) -> None:
    torch.manual_seed(0)
    # Threads an earlier test in this worker started (the emulated link's, the disk tier's) stay.
    threads_before = set(_fxckpt_threads())
    model = GPT(vocab=16, d=8, heads=2, n_layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    backend = fxckpt.backend(
        compiler="eager", offload="all", min_offload_bytes=0, cost_model=cost_model, copy_streams=2
    )
    compiled = torch.compile(model, backend=backend)
    batches = [gpt_inputs(vocab=16, seq=8, seed=s) for s in range(4)]

    def train(n: int) -> None:
        for i in range(n):
            opt.zero_grad(set_to_none=True)
            loss = compiled(*batches[i % len(batches)])
            loss.backward()
            opt.step()

    def measured_forward() -> fxckpt.Measurement:
        opt.zero_grad(set_to_none=True)
        m = fxckpt.measure(compiled, *batches[0])
        m.output.backward()
        opt.zero_grad(set_to_none=True)
        return dataclasses.replace(m, output=None)  # the live-tensor count below must not see it

    train(WARMUP)
    warm_forward = measured_forward()
    gc.collect()
    warm = stats.snapshot()
    warm_rss, warm_tensors = _rss_bytes(), _live_tensors()
    warm_handles = ops.live_handles()
    warm_workers, warm_engines = _fxckpt_threads(), list(engine._engines)
    warm_pool = pool.get_pool("cpu").usage()
    assert warm["offload_calls"] > 0 and warm["pool_bytes"] > 0
    # Two hand-offs per transfer; with buckets, fewer transfers than saved tensors.
    assert warm["copy_handoffs"] == 2 * warm["offload_calls"]
    saved = len(fxckpt.last_plans()[0].activations)
    per_step = warm["offload_calls"] // (WARMUP + 1)
    if cost_model == "flops":
        assert 0 < per_step < saved, (per_step, saved)

    rss = []
    for _ in range((STEPS - WARMUP) // 100):
        train(100)
        rss.append(_rss_bytes())
    end_forward = measured_forward()
    gc.collect()
    end = stats.snapshot()

    # The host pool: not one byte or allocation more, and no buffer stuck in use.
    assert end["pool_bytes"] == warm["pool_bytes"]
    assert end["host_allocations"] == warm["host_allocations"]
    assert end["pool_high_water_bytes"] == warm["pool_high_water_bytes"]
    assert end["pool_hits"] - warm["pool_hits"] == end["offload_calls"] - warm["offload_calls"]
    assert pool.get_pool("cpu").usage()["in_use_bytes"] == warm_pool["in_use_bytes"]
    assert end["offloaded_bytes"] == end["prefetched_bytes"]
    # The forwards: STEPS of training and the two measured ones.
    per_forward = warm["offload_calls"] // (WARMUP + 1)
    assert per_forward > 0 and end["offload_calls"] == (STEPS + 2) * per_forward

    # Device memory, from the allocator: a forward leaves nothing on the device (offload="all"
    # moves every saved tensor), and its peak is the same after 1,000 steps as after warm-up.
    assert warm_forward.held_bytes == end_forward.held_bytes == 0
    assert end_forward.peak_bytes == warm_forward.peak_bytes > 0

    # Process memory: flat within allocator noise, and no upward trend over the last 900 steps.
    assert max(rss) - warm_rss < RSS_SLACK_BYTES, [r - warm_rss for r in rss]
    assert rss[-1] - rss[len(rss) // 2] < RSS_SLACK_BYTES // 2, [r - warm_rss for r in rss]

    # Objects: the same tensors, handles, threads and engines as after warm-up.
    # Not more tensors than after warm-up (fewer is fine: earlier tests' garbage goes away).
    assert _live_tensors() <= warm_tensors
    assert ops.live_handles() == warm_handles
    # Threads: fxckpt names every thread it starts "fxckpt-..."; the process's whole count is not
    # asserted, since other tests in the same worker leave threads that come and go (8 against 7).
    assert _fxckpt_threads() == warm_workers
    # copy_streams=2: at most two workers per direction, on the engine of two streams
    ours = [n for n in warm_workers if n.startswith(("fxckpt-d2h-2_", "fxckpt-h2d-2_"))]
    assert 2 <= len(ours) <= 4
    started = [n for n in warm_workers if n not in threads_before]
    assert all(n.startswith(("fxckpt-d2h", "fxckpt-h2d")) for n in started), started
    # no stream or pool per step: the engines of warm-up, the two-stream one among them
    assert list(engine._engines) == warm_engines and (torch.device("cpu"), 2) in warm_engines
    assert len(fxckpt.last_plans()) == 1


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="counts fds in /proc")
def test_1000_steps_through_the_disk_tier_leave_files_fds_rss_and_host_memory_flat(tmp_path) -> None:
    from fxckpt.runtime import disk, disk_dir

    # tmpfs where there is one: the soak is about what stays behind, not the disk's speed.
    shm = "/dev/shm"
    where_to = tmp_path
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        where_to = tmp_path.__class__(shm) / f"fxckpt-soak-{os.getpid()}"
        where_to.mkdir()
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, heads=2, n_layers=2)
    batches = [gpt_inputs(vocab=16, seq=8, seed=s) for s in range(4)]
    options = {"compiler": "eager", "offload": "all", "min_offload_bytes": 256, "cost_model": "unit"}
    # What offload="all" takes from the host pool, then a quarter of it as the host budget.
    # Idle buffers that earlier tests left in the pool would count in the high-water mark.
    pool.trim_all()
    fxckpt.reset_stats()
    torch.compile(copy.deepcopy(model), backend=fxckpt.backend(**options))(*batches[0]).backward()
    budget = stats.snapshot()["host_high_water_bytes"] // 4
    torch._dynamo.reset()
    pool.trim_all()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    backend = fxckpt.backend(**options, host_budget=budget, offload_dir=str(where_to))
    compiled = torch.compile(model, backend=backend)

    def train(n: int) -> None:
        for i in range(n):
            opt.zero_grad(set_to_none=True)
            compiled(*batches[i % len(batches)]).backward()
            opt.step()

    try:
        train(1)
        fxckpt.reset_stats()  # the high-water mark from here on
        train(WARMUP - 1)
        gc.collect()
        warm = stats.snapshot()
        profile = runtime_profile(backend.options)
        where = profile.disk if profile is not None else None
        assert where is not None
        warm_fds, warm_rss, warm_workers = _open_fds(), _rss_bytes(), _fxckpt_threads()
        assert warm["disk_bytes"] > 0 and warm["disk_files"] == 0 and where.files() == []
        assert 0 < warm["host_high_water_bytes"] <= budget

        rss = []
        for _ in range((STEPS - WARMUP) // 100):
            train(100)
            rss.append(_rss_bytes())
        gc.collect()
        end = stats.snapshot()

        # Files: every one removed once its step's backward is done; none left over.
        assert where.files() == [] and end["disk_files"] == 0
        assert end["disk_bytes"] == warm["disk_bytes"] * (STEPS - 1) // (WARMUP - 1)
        assert end["disk_fallbacks"] == 0 and end["fallbacks"] == 0
        # Descriptors, threads and host memory: as after warm-up.
        assert _open_fds() == warm_fds
        assert _fxckpt_threads() == warm_workers
        assert {"fxckpt-disk-w_0", "fxckpt-disk-r_0"} <= set(warm_workers)
        assert end["host_high_water_bytes"] == warm["host_high_water_bytes"] <= budget
        assert end["pool_bytes"] == warm["pool_bytes"]
        assert end["offloaded_bytes"] == end["prefetched_bytes"]
        assert max(rss) - warm_rss < RSS_SLACK_BYTES, [r - warm_rss for r in rss]
        assert rss[-1] - rss[len(rss) // 2] < RSS_SLACK_BYTES // 2, [r - warm_rss for r in rss]
    finally:
        disk.shutdown()
        disk_dir.close_all()
        if where_to != tmp_path:
            where_to.rmdir()
