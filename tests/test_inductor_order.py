"""Under Inductor, fxckpt's ops run where the plan put them, restored tensors are aligned, and
the ops stay out of CUDA graphs. Read from the code Inductor generates on the CPU
(``run_and_get_code``), with the kernel order recorded as the scheduler writes it
(:mod:`benchmarks.positions`)."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from equality import _fresh_inputs, step
from models import GPT, gpt_inputs
from torch._inductor.utils import run_and_get_code

import fxckpt
from benchmarks.positions import SLOW_LINK, Graph, Recorder, chain_case
from fxckpt.graph import meta

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

# A 4-block decoder under a budget: some saved tensors kept, some offloaded, on a link slow
# enough that copies outlast kernels (the GPU case: 1 GiB at ~50 GB/s takes 20 ms).
# Unit costs: copies carry no fixed per-copy price, so the budget offloads some tensors and keeps
# the rest (priced at the CPU engine's hand-off, this tiny decoder would rather recompute).
DECODER = {"memory_budget": 0.5, "min_offload_bytes": 0, "cost_model": "unit"}
TOL = {"atol": 1e-5, "rtol": 1e-4}


@dataclass
class Compiled:
    forward: Graph
    backward: Graph
    plan: fxckpt.Plan
    stats: dict[str, Any]
    resident_measured: int = 0


def _compile(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    options: dict[str, Any],
    mode: str | None = None,
    measure: bool = False,
) -> Compiled:
    """One training step compiled with fxckpt under Inductor, compared with eager (loss and
    every gradient), and the generated code read back.

    ``measure``: count the bytes the forward leaves saved on the device with a saved-tensors
    hook that never reads the plan: one count per storage; parameters, the model's inputs and
    fxckpt's handles (0-d int64) left out, as note_saved leaves them out.
    """
    torch._dynamo.reset()
    fxckpt.reset_stats()
    reference = copy.deepcopy(model)
    inputs = _fresh_inputs(inputs)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *inputs)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if measure and not (t.dim() == 0 and t.dtype == torch.int64) and storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    recorder = Recorder()
    with recorder.active():
        compiled = torch.compile(model, backend=recorder.backend(options, mode))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            (got, codes) = run_and_get_code(step, model, inputs, compiled)
    want = step(reference, _fresh_inputs(inputs), reference)
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[1].keys() == want[1].keys() and got[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], msg=lambda m, n=name: f"{n}: {m}", **TOL)
    for a, b in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(a, b, **TOL)
    forward, backward = recorder.read(codes)
    assert (forward.kind, backward.kind) == ("forward", "backward")
    return Compiled(forward, backward, fxckpt.last_plans()[0], fxckpt.stats(), sum(seen.values()))


@pytest.fixture(scope="module")
def chain() -> Compiled:
    model, inputs = chain_case()
    return _compile(model, inputs, SLOW_LINK, mode="reduce-overhead")


@pytest.fixture(scope="module")
def decoder() -> Compiled:
    torch.manual_seed(0)
    return _compile(GPT(n_layers=4, d=32), gpt_inputs(seq=32), DECODER, measure=True)


@pytest.fixture(scope="module")
def bucketed() -> Compiled:
    # Priced by flops, each copy pays a fixed overhead: a block's tensors go in one bucket.
    torch.manual_seed(0)
    return _compile(GPT(n_layers=2, d=32), gpt_inputs(seq=32), {"offload": "all", "min_offload_bytes": 0})


def _misplaced(graph: Graph) -> list[str]:
    return [
        f"{o.role}({o.source}): plan after kernel {o.planned_kernel}, code after "
        f"{o.generated_kernel} ({o.early} early, {o.late} late)"
        for o in graph.ops
        if not o.exact
    ]


def test_chain_joins_stay_at_the_end_of_the_forward_as_planned(chain: Compiled) -> None:
    # The link is too slow for any copy to finish inside the forward: the plan joins all
    # eight copies after the last kernel. Inductor used to move each join next to the last
    # use of its source, one kernel after the copy started.
    joins = [o for o in chain.forward.ops if o.role == "offload_done"]
    assert len(joins) == 8
    end = chain.forward.compute_kernels
    assert [(o.planned_kernel, o.generated_kernel) for o in joins] == [(end, end)] * 8


def test_chain_every_op_runs_where_the_plan_put_it(chain: Compiled) -> None:
    assert _misplaced(chain.forward) + _misplaced(chain.backward) == []
    roles = sorted({o.role for g in (chain.forward, chain.backward) for o in g.ops})
    assert roles == ["note", "offload", "offload_done", "prefetch", "wait"]
    # Each offload starts right after the kernel that produces its source.
    for o in chain.forward.ops:
        if o.role == "offload":
            assert o.generated_after == o.source, o


def test_decoder_every_op_runs_where_the_plan_put_it(decoder: Compiled) -> None:
    kinds = {r.decision.kind for r in decoder.plan.activations}
    assert {"keep", "offload"} <= kinds, kinds
    ops = [o for g in (decoder.forward, decoder.backward) for o in g.ops]
    assert {o.role for o in ops} == {"note", "offload", "offload_done", "prefetch", "wait"}
    assert _misplaced(decoder.forward) + _misplaced(decoder.backward) == []


def test_bucket_ops_run_in_the_code(bucketed: Compiled) -> None:
    called = set(re.findall(r"torch\.ops\.fxckpt\.(\w+)\.default\(", bucketed.forward.code + bucketed.backward.code))
    assert {"offload_many", "offload_many_done", "wait_many"} <= called, called
    assert bucketed.stats["offloaded_bytes"] == bucketed.stats["prefetched_bytes"] > 0


@pytest.mark.xfail(strict=False, reason=(
    "since an offloaded view goes through one clone under Inductor (passes.offload._one_buffer), "
    "one join of this plan runs one kernel after its planned place (seen at 2026-12-02: "
    "offload_done(embedding), plan after kernel 13, code after 14); whether it shows depends on "
    "the plan. Open: pin the clone with its offload"))
def test_bucket_ops_run_where_the_plan_put_them(bucketed: Compiled) -> None:
    assert _misplaced(bucketed.forward) + _misplaced(bucketed.backward) == []


def test_restored_tensors_are_aligned(chain: Compiled, decoder: Compiled) -> None:
    for graph in (chain.backward, decoder.backward):
        waits = sum(o.role == "wait" for o in graph.ops)
        assert waits > 0
        asserted = re.findall(r"assert_alignment\(\w+, 16, 'torch\.ops\.fxckpt\.wait\.default'\)", graph.code)
        assert len(asserted) == waits
        assert not re.search(r"op: torch\.ops\.fxckpt\.wait\.default\) is assumed to be not aligned", graph.code)


def test_note_runs_last_and_reports_this_steps_resident_bytes(decoder: Compiled) -> None:
    forward = decoder.forward
    note = forward.op("note", "")
    assert note.generated_kernel == note.planned_kernel == forward.compute_kernels
    assert re.findall(r"torch\.ops\.fxckpt\.(\w+)\.default\(", forward.code)[-1] == "note_saved"
    assert decoder.resident_measured > 0
    assert decoder.stats["planned_kept_bytes"] == decoder.resident_measured


def test_ops_split_cuda_graphs_and_nothing_else_does(
    chain: Compiled, decoder: Compiled, bucketed: Compiled
) -> None:
    # What Inductor's graph partitioning asks of each node (torch 2.11 and 2.13): fxckpt's ops
    # run between captured regions, all compute (the pinned nodes too) inside them.
    from torch._inductor.utils import (
        get_first_incompatible_cudagraph_node,
        is_cudagraph_unsafe_fx_node,
    )

    graphs = (chain, decoder, bucketed)
    for graph in (g for c in graphs for g in (c.forward, c.backward)):
        assert graph.gm is not None
        nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
        unsafe = {n.name for n in nodes if is_cudagraph_unsafe_fx_node(n)}
        ours = {n.name for n in nodes if meta.ROLE in n.meta}
        assert unsafe == ours and ours
        # Without partitioning, Inductor runs such a graph without CUDA graphs.
        first = get_first_incompatible_cudagraph_node(graph.gm)
        assert first is not None and first.name in ours


def test_reduce_overhead_mode_trains_like_eager(chain: Compiled) -> None:
    # The chain fixture compiled under mode="reduce-overhead" (CUDA graphs do not apply to
    # CPU kernels, so on the CPU this checks that the mode passes and changes no result).
    assert chain.stats["offloaded_bytes"] == chain.stats["prefetched_bytes"] > 0
