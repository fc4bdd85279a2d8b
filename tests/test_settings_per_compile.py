"""Runtime settings per compile: two models in one process, each with its own copy streams,
host budget and offload directory, trained in interleaved steps.

Each claim is measured where it can be: a model's bytes left on the device by
``fxckpt.measure`` (the allocator's accounting), the engine each copy really ran on, the files
on disk, gradients against eager. The planner's own figures are not what is checked.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from equality import _fresh_inputs, step
from measured import measure_forward
from models import GPT, gpt_inputs

import fxckpt
from fxckpt import _host
from fxckpt.backend import FxckptPartitioner, configure_runtime, runtime_profile
from fxckpt.runtime import disk, disk_dir, engine, pool, profiles
from fxckpt.runtime.settings import RuntimeSettings

ALL = {"compiler": "eager", "offload": "all", "min_offload_bytes": 0, "cost_model": "unit"}
MiB, KiB = 2**20, 2**10


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # A process of its own, as far as profiles and pools go: what earlier tests compiled
    # (an "auto" budget resolved on other terms, say) is not this test's.
    monkeypatch.setattr(profiles, "_profiles", {None: profiles.default()})
    monkeypatch.setattr(pool, "_pools", {})
    engine.configure()
    pool.set_pool_cap(None)
    yield
    engine.configure()
    disk.shutdown()


class Model:
    """A compiled GPT, its eager twin, and the backend it was compiled with."""

    def __init__(self, **options: Any) -> None:
        torch.manual_seed(0)
        self.model = GPT(n_layers=2)
        self.ref = copy.deepcopy(self.model)
        self.backend = fxckpt.backend(**ALL, **options)
        self.compiled = torch.compile(self.model, backend=self.backend)

    @property
    def profile(self) -> profiles.Profile:
        found = runtime_profile(self.backend.options)
        assert found is not None, "not compiled yet"
        return found

    def train_step(self, seed: int) -> None:
        """One step, compared with eager: the loss and every gradient."""
        inputs = gpt_inputs(seed=seed)
        got = step(self.model, _fresh_inputs(inputs), self.compiled)
        want = step(self.ref, _fresh_inputs(inputs), self.ref)
        torch.testing.assert_close(got[0], want[0])
        assert got[1].keys() == want[1].keys() and got[1]
        for name in want[1]:
            torch.testing.assert_close(got[1][name], want[1][name], msg=lambda m, n=name: f"{n}: {m}")

    def held_bytes(self) -> int:
        """What one forward leaves on the device (measured, then its backward runs)."""
        return measure_forward(self.compiled, gpt_inputs(), warm=False).held_bytes


@pytest.fixture
def engines_used(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The stream count of the engine each device-to-host copy ran on, in order."""
    used: list[int] = []
    real = engine.CpuEngine.start_offload

    def start_offload(self: engine.CpuEngine, rec: Any, copies: Any) -> None:
        used.append(self.streams)
        real(self, rec, copies)

    monkeypatch.setattr(engine.CpuEngine, "start_offload", start_offload)
    return used


def test_a_later_compile_with_a_tiny_host_budget_leaves_an_earlier_models_offloads_alone() -> None:
    a = Model(host_budget="64MiB")
    a.train_step(0)
    alone = a.held_bytes()
    b = Model(host_budget="64KiB")  # too small for its offloads: its plan keeps most of them
    b.train_step(0)
    c = Model()  # no host budget at all
    c.train_step(0)
    fxckpt.reset_stats()
    for seed in range(1, 3):  # interleaved steps, each compared with eager
        for m in (a, b, c, a):
            m.train_step(seed)
    assert fxckpt.stats()["fallbacks"] == 0  # no offload fell back to the device
    assert a.held_bytes() == alone  # measured: as before B and C were compiled
    assert b.held_bytes() > alone + 64 * KiB  # B really runs under its own, tiny budget
    # Budgets that add up: each profile's own pool, capped at its own budget.
    assert (a.profile.cap, b.profile.cap, c.profile.cap) == (64 * MiB, 64 * KiB, None)
    pa, pb = a.profile.pool("cpu"), b.profile.pool("cpu")
    assert pa is not pb and (pa.max_bytes, pb.max_bytes) == (64 * MiB, 64 * KiB)
    assert pb.bytes <= 64 * KiB and pa.bytes <= 64 * MiB
    assert c.profile.pool("cpu") is pool.get_pool("cpu")  # uncapped: the shared pool


def test_each_model_copies_on_the_engine_of_its_own_copy_streams(engines_used: list[int]) -> None:
    a = Model(copy_streams=3)
    a.train_step(0)
    b = Model()  # no copy_streams: its own default, not a change to A's
    b.train_step(0)
    for seed in range(1, 3):
        for m, streams in ((a, 3), (b, 1), (a, 3)):
            engines_used.clear()
            m.train_step(seed)
            assert engines_used and set(engines_used) == {streams}
    assert engine.get_engine("cpu", 3).streams == 3
    assert (a.profile.settings.copy_streams, b.profile.settings.copy_streams) == (3, 1)


def _files_in(root: Path) -> list[str]:
    """The disk tier's data files under ``root`` (every process folder), from the file system."""
    return sorted(str(p.relative_to(root)) for p in root.glob("fxckpt-*/*.bin"))


def test_each_models_disk_tier_files_land_in_its_own_offload_dir(tmp_path: Path) -> None:
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    dir_a.mkdir()
    dir_b.mkdir()
    try:
        a = Model(host_budget=8192, offload_dir=str(dir_a))
        a.train_step(0)
        b = Model(host_budget=8192, offload_dir=str(dir_b))
        b.train_step(0)
        c = Model(host_budget=8192)  # no offload_dir: no disk tier, and A's and B's stay
        c.train_step(0)
        for m, mine, other in ((a, dir_a, dir_b), (b, dir_b, dir_a), (a, dir_a, dir_b)):
            loss = m.compiled(*gpt_inputs())
            disk.wait_for_staging()  # every write of this forward is done
            assert _files_in(mine) and _files_in(other) == []
            loss.backward()
            del loss
            disk.wait_for_staging()
            fxckpt.stats()  # runs the tier's collector: the backward's files go
            assert _files_in(mine) == []
        for seed in range(1, 3):
            for m in (a, b, c):
                m.train_step(seed)
        assert (a.profile.disk.root, b.profile.disk.root) == (str(dir_a), str(dir_b))
        assert c.profile.disk is None
    finally:
        disk.shutdown()
        disk_dir.close_all()


def test_a_compile_with_no_value_for_a_setting_never_changes_another_compiles() -> None:
    # The check: Options(host_budget="1GiB", copy_streams=4) then Options() used to
    # leave the cap at None and one stream.
    first = configure_runtime(fxckpt.Options(host_budget="1GiB", copy_streams=4))
    again = configure_runtime(fxckpt.Options())
    assert again is profiles.default() and first is not again
    assert first.cap == 2**30 and first.settings.copy_streams == 4
    assert first.pool("cpu").max_bytes == 2**30 and first.engine("cpu").streams == 4
    assert configure_runtime(fxckpt.Options(pinned_pool_bytes=2**30, copy_streams=4)) is first


def test_host_budget_auto_is_resolved_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each read of the host's memory would give another figure: only the first one counts.
    reads: list[str] = []
    small = int((16 * KiB + _host.HOST_AUTO_MARGIN_BYTES) / (1 - _host.HOST_AUTO_MARGIN)) + 1

    def available(option: str = "memory_budget") -> int:
        reads.append(option)
        return small if len(reads) == 1 else 1 << 40

    monkeypatch.setattr(_host, "_auto", [])
    monkeypatch.setattr(_host, "available_bytes", available)
    auto = fxckpt.Options(host_budget="auto").resolve_host_budget()
    assert auto is not None and 16 * KiB <= auto < 16 * KiB + 8
    with pytest.warns(UserWarning, match="cannot hold every offload"):
        a = Model(host_budget="auto")
        a.train_step(0)  # compiled: its cap and every planning round ask for "auto" again
    with pytest.warns(UserWarning, match="cannot hold every offload"):
        b = Model(host_budget="auto", copy_streams=2)
        b.train_step(0)
    assert reads == ["host_budget"]  # one read of the host's memory, for the whole process
    plans = fxckpt.last_plans()
    assert len(plans) == 2 and all(p.host_bytes <= auto for p in plans)  # both planned with it
    assert a.profile.cap == b.profile.cap == auto
    # Two pools of "all the memory free for fxckpt" would hold twice that: they share one.
    assert a.profile.pool("cpu") is b.profile.pool("cpu")
    assert a.profile.pool("cpu").max_bytes == auto
    assert fxckpt.stats()["fallbacks"] == 0  # plans and cap agree: nothing fell back


def test_the_graph_carries_the_key_of_its_runtime_settings_and_the_cache_key_tells_them_apart(
) -> None:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def codes(**options: Any) -> list[str]:
        out: list[str] = []

        def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
            out.append(gm.code)
            return make_boxed_func(gm.forward)

        opts = fxckpt.Options(cost_model="unit", offload="all", min_offload_bytes=0, **options)
        backend = aot_autograd(fw_compiler=keep, bw_compiler=keep,
                               partition_fn=FxckptPartitioner(opts))  # fmt: skip
        torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                          torch.nn.Linear(8, 1)), backend=backend)(
            torch.randn(2, 4)).sum().backward()
        torch._dynamo.reset()
        return out

    key = RuntimeSettings(copy_streams=2, host_budget=65536).key()
    assert key == '{"copy_streams":2,"host_budget":65536}'
    fw, bw = codes(copy_streams=2, host_budget="64KiB")
    starts = [ln for ln in fw.splitlines() if "fxckpt.offload" in ln and "offload_done" not in ln]
    assert starts and all(ln.endswith(f"profile = {key!r})") for ln in starts), starts
    assert fw.count("profile =") == len(starts) and "profile" not in bw
    fw, bw = codes()  # the defaults: no key at all, so existing graphs read as before
    assert "profile" not in fw + bw
    assert RuntimeSettings.from_key(key) == RuntimeSettings(2, 65536, None)

    def uuid(**options: Any) -> str:
        return FxckptPartitioner(fxckpt.Options(**options)).uuid()

    # Inductor's FX graph cache serves a graph only to compiles that would carry its key.
    assert len({uuid(), uuid(copy_streams=2), uuid(host_budget="64KiB"), uuid(host_budget="auto"),
                uuid(offload_dir=os.getcwd())}) == 5  # fmt: skip
    assert uuid(host_budget="64KiB") == uuid(host_budget=65536) == uuid(pinned_pool_bytes=65536)


def test_a_graph_naming_a_profile_this_process_never_compiled_still_runs_on_it() -> None:
    # A graph precompiled elsewhere reaches the ops without passing through the backend here.
    key = RuntimeSettings(copy_streams=5, host_budget=3 * MiB).key()
    assert profiles.find(key) is None
    src = torch.randn(64, 32)
    h = torch.ops.fxckpt.offload(src, profile=key)
    torch.ops.fxckpt.offload_done(h, src)
    ticket = torch.ops.fxckpt.prefetch(h)
    got = torch.ops.fxckpt.wait(h, ticket, src.shape, src.stride(), src.dtype, src.device)
    assert torch.equal(got, src)
    made = profiles.find(key)
    assert made is not None and made.cap == 3 * MiB and made.engine("cpu").streams == 5
    with pytest.raises(fxckpt.RuntimeCopyError, match="not a key of runtime settings"):
        torch.ops.fxckpt.offload(src, profile='{"copy_streams":"many"}')
