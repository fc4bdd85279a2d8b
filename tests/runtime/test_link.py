"""The emulated host link: FIFO per direction, full duplex, completion never before the window
closes, the counters equal to the emulated windows. Orders and lower bounds only: no assert
here depends on how fast this machine runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fxckpt
from fxckpt import _link
from fxckpt.errors import OptionsError
from fxckpt.runtime import engine, pool, stats
from fxckpt.runtime.settings import RuntimeSettings

OPS = torch.ops.fxckpt
SLOW = "10MB/s"  # a 256 KiB copy occupies its queue for ~26 ms


@pytest.fixture(autouse=True)
def _clean_runtime():
    engine.configure()
    pool.set_pool_cap(None)
    stats.reset()
    yield
    engine.configure()
    pool.set_pool_cap(None)


@pytest.fixture
def windows(monkeypatch: pytest.MonkeyPatch):
    """Every window the link hands out, as ``(direction, nbytes, start, end)``."""
    seen: list[tuple[str, int, float, float]] = []
    real = _link.Link.occupy

    def occupy(self, direction, nbytes, not_before=0.0):
        start, end = real(self, direction, nbytes, not_before)
        seen.append((direction, nbytes, start, end))
        return start, end

    monkeypatch.setattr(_link.Link, "occupy", occupy)
    return seen


def _wait(h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return OPS.wait(h, h, like.shape, like.stride(), like.dtype, like.device)


def _tensor(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))


def _record(rec_future, order: list[tuple[str, float]], name: str) -> None:
    rec_future.add_done_callback(lambda f: order.append((name, time.perf_counter())))


def _skip_if_overrun(before: int) -> None:
    """Exact windows need threads that start on time: skip (never pass) when one did not."""
    if _link.overruns() > before:
        pytest.skip("a memcpy ended after its window: this machine was too loaded to hold the "
                    "emulated windows")


def _transfer(h: torch.Tensor):
    from fxckpt.runtime import handles

    return handles.lookup(h)


def test_a_copy_is_never_complete_before_its_window_closes(windows):
    srcs = [_tensor(256 * 1024, s) for s in range(3)]
    done: list[tuple[str, float]] = []
    with fxckpt.emulate_link(SLOW, overhead_ms=2):
        hs = [OPS.offload(s) for s in srcs]
        for i, h in enumerate(hs):
            _record(_transfer(h).d2h, done, f"d2h{i}")
        for h, s in zip(hs, srcs, strict=True):
            OPS.offload_done(h, s)
        joined = time.perf_counter()
        for i, h in enumerate(hs):
            OPS.prefetch(h)
            _record(_transfer(h).h2d, done, f"h2d{i}")
        outs = [_wait(h, s) for h, s in zip(hs, srcs, strict=True)]
        restored = time.perf_counter()
    assert all(torch.equal(o, s) for o, s in zip(outs, srcs, strict=True))
    d2h = [w for w in windows if w[0] == "d2h"]
    h2d = [w for w in windows if w[0] == "h2d"]
    assert len(d2h) == len(h2d) == 3
    ends = {f"d2h{i}": w[3] for i, w in enumerate(d2h)} | {f"h2d{i}": w[3] for i, w in enumerate(h2d)}
    for name, at in done:  # the future resolved, in the worker, after its window closed
        assert at >= ends[name], name
    assert joined >= d2h[-1][3]  # the forward's joins returned after the last D2H window
    assert restored >= h2d[-1][3]
    for (_, _, _, e), (_, _, s, _) in zip(d2h, h2d, strict=True):
        assert s >= e  # a prefetch's window opens once its bytes have reached the host


def test_copies_in_one_direction_run_one_after_another(windows):
    big, small = _tensor(512 * 1024, 1), _tensor(4096, 2)
    done: list[tuple[str, float]] = []
    overruns = _link.overruns()
    with fxckpt.emulate_link(SLOW):
        two = RuntimeSettings(copy_streams=2).key()  # two workers: only the shared queue can serialise them
        hb = OPS.offload(big, profile=two)
        _record(_transfer(hb).d2h, done, "big")
        hs = OPS.offload(small, profile=two)
        _record(_transfer(hs).d2h, done, "small")
        OPS.offload_done(hb, big)
        OPS.offload_done(hs, small)
    _skip_if_overrun(overruns)
    assert [name for name, _ in done] == ["big", "small"]  # queued first, done first
    (_, _, _, big_end), (_, _, small_start, _) = windows
    assert small_start >= big_end
    assert torch.equal(_wait(hb, big), big) and torch.equal(_wait(hs, small), small)


def test_copies_in_opposite_directions_overlap(windows):
    back, big = _tensor(4096, 3), _tensor(512 * 1024, 4)
    done: list[tuple[str, float]] = []
    with fxckpt.emulate_link(SLOW):
        hb = OPS.offload(back)
        OPS.offload_done(hb, back)  # on the host now
        hbig = OPS.offload(big)  # a long D2H copy
        _record(_transfer(hbig).d2h, done, "d2h")
        OPS.prefetch(hb)  # a short H2D copy, queued after it
        _record(_transfer(hb).h2d, done, "h2d")
        restored = _wait(hb, back)
        OPS.offload_done(hbig, big)
    # Full duplex: the prefetch did not wait behind the offload queued before it.
    assert [name for name, _ in done] == ["h2d", "d2h"]
    assert torch.equal(restored, back)
    d2h_big, h2d_back = windows[1], windows[2]
    assert h2d_back[2] < d2h_big[3]


def test_the_copy_seconds_are_the_emulated_windows():
    sizes = [256 * 1024, 300 * 1024, 128 * 1024]
    srcs = [_tensor(n, i) for i, n in enumerate(sizes)]
    overruns = _link.overruns()
    with fxckpt.emulate_link(SLOW, overhead_ms=1.5) as link:
        hs = [OPS.offload(s) for s in srcs]
        for h, s in zip(hs, srcs, strict=True):
            OPS.offload_done(h, s)
        outs = [_wait(h, s) for h, s in zip(hs, srcs, strict=True)]
    assert all(torch.equal(o, s) for o, s in zip(outs, srcs, strict=True))
    want = 2 * sum(link.copy_seconds(n) for n in sizes)
    assert stats.snapshot()["copy_seconds"] >= want * (1 - 1e-9)
    _skip_if_overrun(overruns)
    assert stats.snapshot()["copy_seconds"] == pytest.approx(want, rel=1e-9)
    assert want >= 2 * sum(sizes) / 10e6


def test_a_bucket_is_one_window_each_way(windows):
    srcs = [_tensor(64 * 1024, i) for i in range(3)]
    with fxckpt.emulate_link(SLOW, overhead_ms=1):
        h = OPS.offload_many(srcs)
        OPS.offload_many_done(h, srcs)
        OPS.prefetch(h)
        sizes = [n for t in srcs for n in t.shape]
        strides = [s for t in srcs for s in t.stride()]
        out = OPS.wait_many(h, h, sizes, strides, [t.dim() for t in srcs], srcs[0].dtype,
                            srcs[0].device)
    assert [w[:2] for w in windows] == [("d2h", 3 * 64 * 1024), ("h2d", 3 * 64 * 1024)]
    assert all(torch.equal(o, s) for o, s in zip(out, srcs, strict=True))


def test_threads_waiting_for_a_copy_sleep():
    src = _tensor(1024 * 1024)  # ~105 ms at 10 MB/s
    with fxckpt.emulate_link(SLOW):
        wall, cpu = time.perf_counter(), time.process_time()
        h = OPS.offload(src)
        OPS.offload_done(h, src)
        out = _wait(h, src)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert torch.equal(out, src)
    assert wall >= 2 * 1024 * 1024 / 10e6
    assert cpu < 0.5 * wall  # spinning threads would burn the whole wait


def test_emulate_link_is_a_call_and_a_context_manager():
    assert _link.spec() is None
    outer = fxckpt.emulate_link("25MB/s", overhead_ms="50us")
    try:
        assert outer.bandwidth == 25e6 and outer.overhead_ms == pytest.approx(0.05)
        with fxckpt.emulate_link(1e6) as inner:
            assert _link.spec() == inner.spec
            with fxckpt.emulate_link(None):
                assert _link.spec() is None
            assert _link.spec() == inner.spec
        assert _link.spec() == outer.spec
    finally:
        fxckpt.emulate_link(None)
    assert _link.spec() is None


@pytest.mark.parametrize("bad", [{"bandwidth": "fast"}, {"bandwidth": -1},
                                 {"bandwidth": "1MB/s", "overhead_ms": "-2ms"},
                                 {"model": object()}])
def test_bad_settings_name_the_option(bad):
    with pytest.raises(OptionsError) as e:
        fxckpt.emulate_link(**bad)
    assert e.value.option in ("bandwidth", "overhead_ms", "target")
    assert _link.spec() is None


def test_the_environment_variable_sets_the_link_for_the_process():
    code = textwrap.dedent(
        """
        import torch, fxckpt
        from fxckpt import _link
        from fxckpt.runtime import stats
        spec = _link.spec()
        print(spec.bandwidth, spec.overhead_s, spec.source)
        src = torch.randn(64 * 1024)
        h = torch.ops.fxckpt.offload(src)
        torch.ops.fxckpt.offload_done(h, src)
        # equal up to rounding: a window is (start, start + seconds) in perf_counter time
        print(stats.snapshot()["copy_seconds"] >= spec.copy_seconds(src.nbytes) * (1 - 1e-9))
        with fxckpt.emulate_link(None):
            print(_link.spec())
        """
    )
    env = {**os.environ, "FXCKPT_EMULATE_LINK": "12MB/s,0.5ms"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["12000000.0", "0.0005", "FXCKPT_EMULATE_LINK", "True", "None"]
    env["FXCKPT_EMULATE_LINK"] = "quick"
    done = subprocess.run([sys.executable, "-c", "import fxckpt; from fxckpt import _link; "
                           "_link.spec()"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert "FXCKPT_EMULATE_LINK" in done.stderr and "12MB/s" in done.stderr


def test_a_step_under_the_link_takes_its_copies_at_least_once(windows):
    # Two copies of one tensor cannot both hide in a window shorter than either of them.
    src = _tensor(128 * 1024)
    with fxckpt.emulate_link(SLOW):
        start = time.perf_counter()
        h = OPS.offload(src)
        OPS.offload_done(h, src)
        OPS.prefetch(h)
        out = _wait(h, src)
        took = time.perf_counter() - start
    assert torch.equal(out, src)
    assert took >= 2 * src.nbytes / 10e6
    assert len(windows) == 2


def test_no_link_leaves_copies_at_memcpy_speed(windows):
    src = _tensor(4096)
    h = OPS.offload(src)
    OPS.offload_done(h, src)
    assert torch.equal(_wait(h, src), src)
    assert windows == []


def test_a_prefetch_queued_before_its_offload_lands_waits_for_it(windows):
    src = _tensor(256 * 1024, 5)
    with fxckpt.emulate_link(SLOW):
        h = OPS.offload(src)
        OPS.prefetch(h)  # before any join: the H2D window must still open after the D2H one
        out = _wait(h, src)
    (d, _, _, d2h_end), (u, _, h2d_start, _) = windows
    assert (d, u) == ("d2h", "h2d") and h2d_start >= d2h_end
    assert torch.equal(out, src)
