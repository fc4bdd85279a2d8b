"""Where fxckpt's ops run in the code Inductor generates, against where the plan put them.

    python -m benchmarks.positions --json docs/benchmarks/positions.json

``--smoke`` runs the chain case alone, the smallest: it checks that the script runs end to end.

The plan fixes the position of every offload, join (``offload_done``), prefetch and wait: the
partitioner hands Inductor forward and backward graphs with each op between two compute
nodes. Inductor then schedules kernels in an order of its own. This script compiles two
models on the CPU (an 8-layer ``relu(x @ w)`` chain and a 4-block decoder, both with
``offload="all"``, ``min_offload_bytes=0`` and a 0.05 GB/s link) and, for each op, compares:

- planned: the compute kernels that come before the op in the graph fxckpt handed over;
- generated: the compute kernels that come before it in the code Inductor emits.

``early`` counts kernels the plan runs before the op that the generated code runs after it;
``late`` counts the reverse. An op is where the plan put it when both are 0. The kernel order
is read from Inductor's scheduler as it writes the code (each kernel with the FX nodes it
computes), and checked against the calls in the code returned by
``torch._inductor.utils.run_and_get_code``.

A third case, a larger decoder under ``memory_budget=0.5`` with default options, shows what
pinning costs: each op is a kernel boundary, so fusions across it are split (compare the
compute kernel counts with an fxckpt from before pinning; the script runs against one too).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn as nn

ROLES = ("offload", "offload_done", "prefetch", "wait", "note")
_CALLED = {  # op name -> role, where they differ
    "note_saved": "note", "offload_many": "offload", "offload_many_done": "offload_done",
    "wait_many": "wait",
}
_CALL = re.compile(r"torch\.ops\.fxckpt\.(\w+)\.default\(")


@dataclass
class Op:
    """One fxckpt op of a compiled graph and where it runs."""

    node: str
    role: str
    source: str  # the saved tensor it acts for
    planned_after: str | None  # the compute node before it in fxckpt's graph
    planned_kernel: int  # compute kernels before it, in plan order
    generated_kernel: int  # compute kernels before it in the generated code
    generated_after: str | None  # the last compute node of the kernel before it
    early: int  # kernels the plan runs first that the code runs after the op
    late: int  # kernels the plan runs after the op that the code runs first

    @property
    def exact(self) -> bool:
        return self.early == self.late == 0


@dataclass
class Graph:
    """A graph Inductor compiled: fxckpt's node order, the generated kernel order, the code."""

    kind: str  # "forward" or "backward"
    fx: list[str]  # fxckpt's graph, in order: compute nodes and fxckpt ops
    roles: dict[str, str]
    sources: dict[str, str]
    kernels: list[list[str]]  # generated order; each item: the FX nodes it computes
    code: str = ""
    ops: list[Op] = field(default_factory=list)
    gm: torch.fx.GraphModule | None = None  # the graph itself (Inductor's post-grad passes ran)

    def op(self, role: str, source: str) -> Op:
        return next(o for o in self.ops if o.role == role and o.source == source)

    @property
    def compute_kernels(self) -> int:
        """Kernels that compute nodes of fxckpt's graph (not allocations, not fxckpt's ops)."""
        index = set(self.fx) - set(self.roles)
        return sum(1 for k in self.kernels if not set(k) & set(self.roles) and set(k) & index)


def _is_compute(node: torch.fx.Node) -> bool:
    """An aten op that reads and returns tensors and is no view: a node that becomes (part
    of) a kernel. Defined here, apart from the pass under test, so that the measurement
    does not take that pass's word for what a kernel is."""
    if node.op != "call_function" or "fxckpt.role" in node.meta:
        return False
    if getattr(node.target, "_name", "") == "control_deps":  # a node wrapped to order it
        return True
    val = node.meta.get("val")
    returns = isinstance(val, torch.Tensor) or (
        isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)
    )
    reads = any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and not target.is_view and returns and reads


def _snapshot(gm: torch.fx.GraphModule, kind: str) -> Graph:
    order, roles, sources = [], {}, {}
    for n in gm.graph.nodes:
        role = n.meta.get("fxckpt.role")
        if role in ROLES:
            roles[n.name] = role
            sources[n.name] = n.meta.get("fxckpt.source", "")
            order.append(n.name)
        elif _is_compute(n):
            order.append(n.name)
    return Graph(kind, order, roles, sources, [])


class Recorder:
    """Records, for every graph Inductor compiles through :meth:`backend`, fxckpt's order
    and the order of the kernels the scheduler writes into the code."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []

    def inner(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        backward = any(n.name.startswith("tangents") for n in gm.graph.find_nodes(op="placeholder"))
        self.graphs.append(_snapshot(gm, "backward" if backward else "forward"))
        self.graphs[-1].gm = gm
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def read(self, codes: Sequence[str]) -> list[Graph]:
        """Attach the generated code (from ``run_and_get_code``, one module per graph),
        check it against the recorded kernel order, and analyse each graph."""
        if len(codes) != len(self.graphs):
            raise AssertionError(f"{len(codes)} code modules for {len(self.graphs)} graphs")
        for graph, code in zip(self.graphs, codes, strict=True):
            graph.code = code
            check_code(graph)
            analyse(graph)
        return self.graphs

    def backend(self, options: dict[str, Any], mode: str | None = None) -> Callable[..., Any]:
        """fxckpt under Inductor as ``backend="fxckpt"`` compiles (``mode`` as
        ``torch.compile``'s), with the recording inner compiler."""
        from torch._inductor.compile_fx import compile_fx

        from fxckpt.options import Options

        fxckpt_backend = importlib.import_module("fxckpt.backend")  # the module, not the function

        partitioner = fxckpt_backend.FxckptPartitioner(Options.from_mapping(options))
        if hasattr(fxckpt_backend, "inductor_patches"):
            patches = fxckpt_backend.inductor_patches(partitioner, mode)
        else:  # an fxckpt from before positions were pinned: the "before" of a comparison
            patches = {"custom_partitioner_fn": partitioner}

        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            return compile_fx(gm, example_inputs, inner_compile=self.inner, config_patches=patches)

        return backend

    def _codegen(self, original: Callable[..., Any]) -> Callable[..., Any]:
        from torch._inductor import ir

        def codegen(scheduler: Any, nodes: list[Any]) -> Any:
            graph = self.graphs[-1]
            for snode in nodes:
                irnodes = [n.node for n in snode.get_nodes() if n.node is not None]
                if all(isinstance(n, ir.MultiOutput) for n in irnodes):
                    continue  # unpacks a fallback's result: no kernel of its own
                fx_node = getattr(irnodes[0], "fx_node", None) if len(irnodes) == 1 else None
                if fx_node is not None and fx_node.name in graph.roles:
                    graph.kernels.append([fx_node.name])  # one of fxckpt's ops
                else:
                    graph.kernels.append(sorted({o.name for n in irnodes for o in n.origins}))
            return original(scheduler, nodes)

        return codegen

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Record inside this block. The compiled-graph caches are off in it, so that Inductor
        partitions and schedules now (the kernel cache stays: same code, same binary)."""
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config
        from torch._inductor.scheduler import Scheduler

        with (
            mock.patch.object(Scheduler, "_codegen", self._codegen(Scheduler._codegen)),
            inductor_config.patch(fx_graph_cache=False),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            yield


def analyse(graph: Graph) -> Graph:
    """Fill ``graph.ops``: each fxckpt op's planned and generated position."""
    index = {name: i for i, name in enumerate(graph.fx)}
    compute = [n for n in graph.fx if n not in graph.roles]
    # Each generated compute kernel, as the FX positions of the compute nodes it computes.
    kernels: list[list[int]] = []
    op_at: dict[str, int] = {}  # fxckpt op -> compute kernels before it in the code
    for names in graph.kernels:
        ops = [n for n in names if n in graph.roles]
        if ops:
            for n in ops:
                op_at.setdefault(n, len(kernels))
            continue
        spots = sorted(index[n] for n in names if n in index and n not in graph.roles)
        if spots:
            kernels.append(spots)
    graph.ops = []
    for name, role in graph.roles.items():
        i = index[name]
        before_fx = [n for n in compute if index[n] < i]
        at = op_at.get(name, -1)
        # A kernel sits at the latest node it computes: the earlier nodes among its origins
        # are inlined copies of work done before (Inductor recomputes cheap pointwise ops).
        early = sum(1 for k in kernels[at:] if k[-1] < i)
        late = sum(1 for k in kernels[:at] if k[-1] > i)
        planned = sum(1 for k in kernels if k[-1] < i)
        prev = kernels[at - 1] if at > 0 else None
        graph.ops.append(
            Op(
                node=name,
                role=role,
                source=graph.sources[name],
                planned_after=before_fx[-1] if before_fx else None,
                planned_kernel=planned,
                generated_kernel=at,
                generated_after=graph.fx[prev[-1]] if prev else None,
                early=early,
                late=late,
            )
        )
    return graph


def code_calls(code: str) -> list[str]:
    """The fxckpt ops the generated ``call`` invokes, in order."""
    body = code[code.index("def call(") :] if "def call(" in code else code
    return [_CALLED.get(name, name) for name in _CALL.findall(body)]


def check_code(graph: Graph) -> None:
    """The generated code calls fxckpt's ops in the order the recorded kernels say."""
    recorded = []
    for names in graph.kernels:
        recorded.extend(graph.roles[n] for n in names if n in graph.roles)
    if code_calls(graph.code) != recorded:
        raise AssertionError(
            f"{graph.kind}: the code calls {code_calls(graph.code)}, the scheduler wrote {recorded}"
        )


def compile_and_read(
    model: nn.Module, inputs: Sequence[Any], options: dict[str, Any]
) -> list[Graph]:
    """Train one step of ``model`` under fxckpt + Inductor and return its analysed graphs,
    forward first."""
    from torch._inductor.utils import run_and_get_code

    recorder = Recorder()
    with recorder.active():
        compiled = torch.compile(model, backend=recorder.backend(options))

        def step() -> torch.Tensor:
            loss = compiled(*inputs)
            loss.backward()
            return loss

        _, codes = run_and_get_code(step)
    return recorder.read(codes)


class Chain(nn.Module):
    """``depth`` layers of ``relu(x @ w)``; the loss is the sum of the last."""

    def __init__(self, depth: int = 8, d: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ws = nn.ParameterList(
            nn.Parameter(torch.randn(d, d, generator=g) / d**0.5) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.ws:
            x = torch.relu(x @ w)
        return x.sum()


SLOW_LINK = {"offload": "all", "min_offload_bytes": 0, "bandwidth": "0.05GB/s"}


def chain_case() -> tuple[nn.Module, tuple[Any, ...]]:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return Chain(), (x,)


def decoder_case() -> tuple[nn.Module, tuple[Any, ...]]:
    from benchmarks.methods import Decoder, DecoderConfig, make_batch

    cfg = DecoderConfig("decoder-4", vocab=128, d=32, heads=2, layers=4, ffn=64)
    torch.manual_seed(0)
    return Decoder(cfg), make_batch(cfg, 2, 16, "cpu")


BUDGET = {"memory_budget": 0.5, "bandwidth": "25GB/s"}


def budget_case() -> tuple[nn.Module, tuple[Any, ...]]:
    """A decoder sized so that default options offload some tensors under a budget."""
    from benchmarks.methods import Decoder, DecoderConfig, make_batch

    cfg = DecoderConfig("decoder-4-budget", vocab=256, d=256, heads=4, layers=4, ffn=1024)
    torch.manual_seed(0)
    return Decoder(cfg), make_batch(cfg, 2, 512, "cpu")


CASES: dict[str, tuple[Callable[[], tuple[nn.Module, tuple[Any, ...]]], dict[str, Any]]] = {
    "chain": (chain_case, SLOW_LINK),
    "decoder": (decoder_case, SLOW_LINK),
    "decoder_budget": (budget_case, BUDGET),
}


def joins_table(graphs: Sequence[Graph]) -> list[dict[str, Any]]:
    rows = []
    for graph in graphs:
        for op in graph.ops:
            if op.role == "offload_done":
                rows.append(
                    {
                        "tensor": op.source,
                        "planned_kernel": op.planned_kernel,
                        "planned_after": op.planned_after,
                        "generated_kernel": op.generated_kernel,
                        "generated_after": op.generated_after,
                        "early": op.early,
                        "late": op.late,
                    }
                )
    return rows


def summary(graphs: Sequence[Graph]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for graph in graphs:
        for role in ROLES:
            ops = [o for o in graph.ops if o.role == role]
            if ops:
                out[f"{graph.kind}.{role}"] = {
                    "ops": len(ops),
                    "exact": sum(o.exact for o in ops),
                    "early_kernels": sum(o.early for o in ops),
                    "late_kernels": sum(o.late for o in ops),
                }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--smoke", action="store_true",
                        help="only the chain case, the smallest: to check that the script runs")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"torch": torch.__version__}
    cases = {"chain": CASES["chain"]} if args.smoke else CASES
    for name, (case, options) in cases.items():
        model, inputs = case()
        graphs = compile_and_read(copy.deepcopy(model), inputs, options)
        joins = joins_table(graphs)
        result[name] = {"options": options, "joins": joins, "summary": summary(graphs)}
        kernels = {g.kind: g.compute_kernels for g in graphs}
        result[name]["compute_kernels"] = kernels
        print(f"== {name}: compute kernels {kernels}")
        print(f"{'tensor':<24}{'planned':>10}  {'generated':>10}  early late")
        for row in joins:
            print(
                f"{row['tensor']:<24}{row['planned_kernel']:>10}  {row['generated_kernel']:>10}"
                f"  {row['early']:>5} {row['late']:>4}"
            )
        for key, figures in result[name]["summary"].items():
            print(f"  {key:<24} {figures}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
