"""min-cut's graphs come back without code, which they get at their first call: only the
calling thread's graph modules skip their code, and only while min-cut runs."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.fx as fx

from fxckpt import _torch_compat as compat

RECOMPILE = fx.GraphModule.__dict__["recompile"]


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _plain_module() -> fx.GraphModule:
    gm = fx.symbolic_trace(_double)
    return fx.GraphModule(gm, gm.graph)  # the eager class, as min-cut's reordering builds it


def _min_cut_beside_another_thread() -> list[fx.GraphModule]:
    """A min-cut during which another thread builds a module; that module."""
    other: list[fx.GraphModule] = []

    def run() -> tuple[fx.GraphModule]:
        t = threading.Thread(target=lambda: other.append(_plain_module()))
        t.start()
        t.join()
        return (_plain_module(),)

    compat.min_cut_code_deferred(run)
    return other


def test_the_partitions_modules_get_their_code_at_their_first_call() -> None:
    made: list[fx.GraphModule] = []

    def run() -> tuple[fx.GraphModule, fx.GraphModule]:
        made.extend([_plain_module(), _plain_module()])
        return made[0], made[1]

    fw, bw = compat.min_cut_code_deferred(run)
    assert not any(hasattr(gm, "_code") for gm in made), "code generated inside min-cut"
    x = torch.arange(3.0)
    torch.testing.assert_close(fw(x), x * 2)
    torch.testing.assert_close(bw(x), x * 2)
    assert "mul" in bw.code


def test_other_threads_and_later_modules_get_their_code_when_built() -> None:
    other = _min_cut_beside_another_thread()
    assert hasattr(other[0], "_code"), "another thread's module lost its code"
    assert hasattr(_plain_module(), "_code"), "recompile stayed deferred after min-cut"
    assert fx.GraphModule.__dict__["recompile"] is RECOMPILE, "GraphModule.recompile not put back"


def test_an_error_in_min_cut_leaves_recompile_as_it_was() -> None:
    def run() -> None:
        raise RuntimeError("min-cut failed")

    with pytest.raises(RuntimeError, match="min-cut failed"):
        compat.min_cut_code_deferred(run)
    assert hasattr(_plain_module(), "_code")
    assert fx.GraphModule.__dict__["recompile"] is RECOMPILE


def test_a_recompile_someone_else_installed_is_the_one_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[fx.GraphModule] = []

    def theirs(self: fx.GraphModule) -> object:
        calls.append(self)
        return RECOMPILE(self)

    monkeypatch.setattr(fx.GraphModule, "recompile", theirs)
    other = _min_cut_beside_another_thread()
    assert fx.GraphModule.__dict__["recompile"] is theirs
    assert any(gm is other[0] for gm in calls), "another thread's module skipped their recompile"
