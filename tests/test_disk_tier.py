"""``host_budget`` and the disk tier end to end: training steps equal eager with a quarter of
the host memory offload="all" needs, host memory measured by a tally that never reads the
plan, the faults of a real step (a full disk, a file deleted before the backward), bad
directories refused at compile time, the planner's reasons, and ``fxckpt inspect``."""

from __future__ import annotations

import errno
import gc
import json
import os
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from equality import assert_step_matches, step
from files_double import FilesDouble
from models import GPT, gpt_inputs

import fxckpt
from fxckpt import _files
from fxckpt.backend import runtime_profile
from fxckpt.cli import main
from fxckpt.errors import OptionsError, RuntimeCopyError
from fxckpt.planning.host import HostReport, warn_host_short
from fxckpt.runtime import disk, disk_dir, engine, pool, profiles
from fxckpt.runtime.disk import DiskTierWarning

ALL = {"compiler": "eager", "offload": "all", "min_offload_bytes": 0, "cost_model": "unit"}
HERE = Path(__file__).parent


class Tally:
    """Stands in for ``torch`` inside the pool module and counts the bytes of every host
    buffer alive, from its allocation until the tensor dies: a measure of host memory that
    reads neither the plan nor fxckpt's counters."""

    def __init__(self) -> None:
        self.live = self.high = 0

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        t = torch.empty(*args, **kwargs)
        n = t.numel() * t.element_size()
        self.live += n
        self.high = max(self.high, self.live)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        self.live -= n

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _fs_type(path: str) -> str:
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fs = line.split()[:3]
            if path.startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs
    return kind


def _dirs() -> dict[str, str]:
    out = {}
    if os.path.isdir("/dev/shm") and _fs_type("/dev/shm") == "tmpfs":
        out["tmpfs"] = "/dev/shm"
    return out


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    engine.configure()
    # Empty pools, so the high-water mark and the host allocations start from nothing: models
    # an earlier test file compiled in this worker release their buffers first.
    torch._dynamo.reset()
    gc.collect()
    pool.trim_all()
    fxckpt.reset_stats()
    monkeypatch.setattr(profiles.default(), "disk", None)
    yield
    disk.shutdown()
    engine.configure()
    pool.set_pool_cap(None)
    disk_dir.close_all()


@pytest.fixture(params=["tmpfs", "disk"])
def offload_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "tmpfs":
        base = _dirs().get("tmpfs")
        if base is None:
            pytest.skip("no tmpfs at /dev/shm")
        path = Path(base) / f"fxckpt-test-{os.getpid()}-{tmp_path.name}"
        path.mkdir()
    else:
        if _fs_type(str(tmp_path)) in ("tmpfs", "ramfs", ""):
            pytest.skip("the temporary directory is not on a disk")
        path = tmp_path
    yield str(path)
    if request.param == "tmpfs":
        disk_dir.close_all()
        path.rmdir()


def _folder(backend: Any) -> disk_dir.DiskDir | None:
    """The disk folder of the runtime profile ``backend``'s compiles run on."""
    profile = runtime_profile(backend.options)
    return profile.disk if profile is not None else None


def _offload_all_needs() -> int:
    """Host bytes offload="all" takes for one GPT step, as the pool's accounting says."""
    torch.manual_seed(0)
    compiled = torch.compile(GPT(n_layers=4), backend=fxckpt.backend(**ALL))
    compiled(*gpt_inputs()).backward()
    need = fxckpt.stats()["host_high_water_bytes"]
    torch._dynamo.reset()
    pool.trim_all()
    fxckpt.reset_stats()
    return need


def test_training_equals_eager_with_a_quarter_of_the_host_memory_offload_all_needs(
    clean: None, offload_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    need = _offload_all_needs()
    budget = need // 4
    tally = Tally()
    monkeypatch.setattr(pool, "torch", tally)
    torch.manual_seed(0)
    backend = fxckpt.backend(**ALL, host_budget=budget, offload_dir=offload_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiskTierWarning)
        assert_step_matches(GPT(n_layers=4), gpt_inputs(), backend, steps=2)
    snap = fxckpt.stats()
    assert 0 < tally.high <= budget  # measured without the plan
    assert snap["host_high_water_bytes"] <= budget
    assert snap["fallbacks"] == 0 and snap["disk_fallbacks"] == 0
    (plan,) = fxckpt.last_plans()
    assert plan.disk_bytes > 0 and plan.host_bytes > 0
    assert snap["disk_bytes"] == 2 * _disk_span_bytes(plan)
    assert all(r.decision.reason.startswith("offload → disk")
               for r in plan.activations if getattr(r.decision, "tier", "") == "disk")  # fmt: skip
    where = _folder(backend)
    assert snap["disk_files"] == 0 and where is not None and where.files() == []


@pytest.mark.slow
@pytest.mark.inductor
def test_the_disk_tier_under_inductor_trains_like_eager(clean: None, tmp_path: Path) -> None:
    torch.manual_seed(0)
    options = {"offload": "all", "min_offload_bytes": 0, "cost_model": "unit",
               "host_budget": 16384, "offload_dir": str(tmp_path)}  # fmt: skip
    assert_step_matches(GPT(n_layers=2), gpt_inputs(), fxckpt.backend(**options), steps=2,
                        atol=1e-5, rtol=1e-4)  # fmt: skip
    (plan,) = fxckpt.last_plans()
    assert plan.disk_bytes > 0
    snap = fxckpt.stats()
    assert snap["disk_bytes"] > 0 and snap["host_high_water_bytes"] <= 16384


def _disk_span_bytes(plan: fxckpt.Plan) -> int:
    # The runtime writes each tensor's span; the saved tensors of this GPT are dense.
    seen: dict[str, int] = {}
    for r in plan.activations:
        if getattr(r.decision, "tier", "") == "disk":
            seen.setdefault(r.storage or r.name, r.bytes)
    return sum(seen.values())


def test_a_disk_that_fills_mid_step_trains_like_eager_with_one_warning(
    clean: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = FilesDouble()
    files.full_after = 5  # the sixth write of the first step finds the disk full
    monkeypatch.setattr(_files, "FILES", files)
    need = _offload_all_needs()
    backend = fxckpt.backend(**ALL, host_budget=need // 4, offload_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_step_matches(GPT(n_layers=4), gpt_inputs(), backend, steps=2)
    ours = [w for w in caught if issubclass(w.category, DiskTierWarning)]
    assert len(ours) == 1 and "ENOSPC" in str(ours[0].message)
    # Each failed write is a fallback; reads that then find no staging within the budget too.
    assert 0 < files.failed_writes <= fxckpt.stats()["disk_fallbacks"]


def test_a_file_deleted_before_the_backward_is_a_clear_error_and_the_next_step_is_exact(
    clean: None, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=2)
    reference = GPT(n_layers=2)
    reference.load_state_dict(model.state_dict())
    backend = fxckpt.backend(**ALL, host_budget=8192, offload_dir=str(tmp_path))
    compiled = torch.compile(model, backend=backend)
    loss = compiled(*gpt_inputs())
    disk.wait_for_staging()  # every write is done
    where = _folder(backend)
    assert where is not None and where.files()
    for name in where.files():
        os.unlink(os.path.join(where.path, name))
    with pytest.raises(RuntimeCopyError, match="was deleted before the backward read it back"):
        loss.backward()
    del loss
    got = step(model, gpt_inputs(), compiled)
    want = step(reference, gpt_inputs(), reference)
    torch.testing.assert_close(got[0], want[0])
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name])


@pytest.mark.parametrize(
    ("options", "name", "words"),
    [({"offload_dir": "/no/such/dir"}, "offload_dir", "no such directory"),
     ({"offload_dir_bandwidth": "2GB/s"}, "offload_dir_bandwidth", "no offload_dir")],
)  # fmt: skip
def test_a_bad_offload_dir_is_refused_at_compile_time(
    clean: None, options: dict[str, Any], name: str, words: str
) -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(lambda t: t.sin().sum(), backend="fxckpt", options=options)(x)
    inner = info.value.inner_exception
    assert isinstance(inner, OptionsError) and inner.option == name
    assert words in str(inner)


@pytest.mark.parametrize(
    ("options", "name", "words"),
    [({"offload_dir": "/no/such/dir"}, "offload_dir", "no such directory"),
     ({"offload_dir": __file__}, "offload_dir", "not a directory"),
     ({"offload_dir_bandwidth": "2GB/s"}, "offload_dir_bandwidth", "no offload_dir")],
)  # fmt: skip
def test_fxckpt_backend_refuses_a_bad_offload_dir_before_compiling(
    clean: None, options: dict[str, Any], name: str, words: str
) -> None:
    with pytest.raises(OptionsError) as info:
        fxckpt.backend(**options)
    assert info.value.option == name and words in str(info.value)


def test_fxckpt_backend_leaves_a_good_offload_dir_untouched(clean: None, tmp_path: Path) -> None:
    fxckpt.backend(offload="all", offload_dir=str(tmp_path), offload_dir_bandwidth="2GB/s")
    assert list(tmp_path.iterdir()) == []  # the first compile makes the process's folder


def test_a_short_host_without_a_disk_recomputes_under_a_memory_budget(clean: None) -> None:
    torch.manual_seed(0)
    options = {**ALL, "memory_budget": 1.0, "host_budget": 16384}
    with pytest.warns(UserWarning, match="host_budget=16.0 KiB cannot hold every offload") as seen:
        assert_step_matches(GPT(n_layers=2), gpt_inputs(), fxckpt.backend(**options))
    assert any("Give an offload_dir" in str(w.message) for w in seen)
    (plan,) = fxckpt.last_plans()
    moved = [r for r in plan.activations if "host_budget 16.0 KiB" in r.decision.reason]
    assert any(r.decision.kind == "recompute" for r in moved)
    assert all("there is no disk tier (offload_dir)" in r.decision.reason for r in moved)
    assert plan.host_bytes <= 16384 and plan.disk_bytes == 0


def test_inspect_plans_a_disk_tier_offline_and_shows_the_split(
    clean: None, capsys: pytest.CaptureFixture[str]
) -> None:
    gpt = str(HERE / "fixtures" / "tiny_gpt.py") + ":gpt"
    before = profiles.registered()
    flags = ["--offload", "all", "--min-offload", "0", "--host-budget", "4MiB",
             "--offload-dir-bandwidth", "2GB/s", "-q"]  # fmt: skip
    assert main(["inspect", gpt, *flags, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    totals = doc["totals"]
    assert totals["disk_bytes"] > 0 and 0 < totals["host_bytes"] <= 4 * 2**20
    rows = [a for g in doc["graphs"] for a in g["activations"] if a.get("tier") == "disk"]
    assert rows and all(a["reason"].startswith("offload → disk") for a in rows)
    assert main(["inspect", gpt, *flags]) == 0
    out = capsys.readouterr().out
    assert "offload → disk" in out and "device / host / disk" in out
    assert profiles.registered() == before  # planning offline set up no runtime
    assert main(["inspect", gpt, "--host-budget", "-1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "'host_budget'" in err and "-1" in err


def test_with_an_offload_dir_the_host_warning_does_not_ask_for_one() -> None:
    report = HostReport(16384, recomputed=2)
    with pytest.warns(UserWarning, match="16.0 KiB cannot hold every offload; 2 recomputed") as seen:
        warn_host_short("0/0", report, disk=True)
    (w,) = seen
    assert "offload_dir" not in str(w.message) and "raise host_budget" in str(w.message)


def test_a_full_disk_under_the_bandwidth_probe_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The real file calls, the disk full at the first write: the error names offload_dir,
    the directory and its free space (it was a BufferError from closing the probe's buffer
    while the failed write's traceback held a view of it)."""

    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OptionsError) as info:
        _files.measure_bandwidth(str(tmp_path), direct=False)
    err = info.value
    assert err.option == "offload_dir" and err.value == str(tmp_path)
    assert "No space left on device" in str(err) and "free there" in str(err), str(err)
    assert "32.0 MiB" in str(err) and len(str(err)) < 400, str(err)
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone
