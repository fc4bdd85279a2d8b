"""The longest sequence that fits a card: ``fxckpt inspect --max-seq``.

For each strategy (plain ``torch.compile``, per-block checkpointing and fxckpt's planner at the
card's budget) the step is planned at a few sequence lengths, and the longest length whose
predicted step peak fits the card's usable memory (``memory_budget="auto"`` for the card: its
capacity less fxckpt's margin) is found by :func:`longest_fit`. The model is traced by dynamo
and AOTAutograd once, with the length as a symbol (:func:`plan_lengths`); each length costs
setting the sizes in the joint graph and the partitioner, and two processes search at once
(:func:`in_two`).

- ``none``: the step as plain ``torch.compile`` partitions it (min-cut alone; a budget too large
  to bind keeps the step's account).
- ``full_checkpointing``: every block recomputed in the backward (``segment_stride=1``), nothing
  offloaded.
- ``fxckpt``: fits where fxckpt's plan that recomputes every block and offloads every saved
  tensor fits (a hair above the planner's lowest plan, at less cost: the lowest plan is
  planned twice, once to learn it cannot meet the budget); its step time is that of the plan
  at the card's budget at that length, which picks the fastest way to fit there.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxckpt import _torch_compat as compat
from fxckpt._torch_compat import pytree
from fxckpt.backend import Backend, FxckptPartitioner, _boxed_nop
from fxckpt.inspect import (
    Progress,
    TargetError,
    Workload,
    collected_plans,
    inspect_options,
    offline_dispatch,
    offline_step,
    run_step,
    to_meta,
)
from fxckpt.meter import held_on_device
from fxckpt.options import Options
from fxckpt.passes.rounds import clone_joint
from fxckpt.planning import step_budget
from fxckpt.planning.plan import Plan
from fxckpt.runtime import stats
from fxckpt.sizing import STRATEGIES, LongestFit, Probe, longest_fit, seq_quantum, top_step

PlanAt = Callable[[Options, int], list[Plan]]

# How many lengths' joint graphs a graph keeps set (each as large as the graph).
_KEPT_LENGTHS = 3


@contextlib.contextmanager
def plan_lengths(work: Workload, *, progress: Progress | None = None) -> Iterator[PlanAt]:
    """``plan_at(options, length)``: plans of ``work``'s step at any sequence length, with the
    model traced by dynamo once.

    ``work.inputs_at(length)`` gives the step's inputs at a length. The dimensions that differ
    between two lengths are marked dynamic, so dynamo traces the model once with a symbolic
    length, and AOTAutograd traces each graph's joint forward and backward once, symbolic too
    (:func:`symbolic_joint`). Each ``(options, length)`` then sets the length in a copy of the
    joint (:func:`at_length`) and runs fxckpt's partitioner on it, under the step's budget as a
    compile would. Where a graph cannot be set so (a size that no input's length gives), it is
    compiled at that length by AOTAutograd instead, as :func:`fxckpt.inspect.plan_workload`
    does; where the model specialises on its length, dynamo traces it again (slower; both are
    said on the progress line).
    """
    if work.inputs_at is None:
        raise TargetError("planning at other lengths needs the step's inputs at any length "
                          "(--hf-config, or a factory that takes seq=...)")  # fmt: skip
    say = progress or (lambda _msg: None)
    inputs_at = work.inputs_at
    now: list[tuple[Options, int]] = []  # the (options, length) being planned: one at a time
    traces: list[int] = []

    def capture(gm: Any, example_inputs: Any) -> Any:
        traces.append(now[-1][1])
        if len(traces) > 1 and traces[-1] != traces[0]:
            say(f"dynamo traced the model again at length {traces[-1]}: it specialises on "
                "its length")  # fmt: skip
        joint = symbolic_joint(gm, example_inputs)
        held: dict[tuple[int, int], Any] = {}
        # The joint at the last few lengths: strategies plan at each other's lengths (the
        # next starts where the one before ended, and fxckpt's time is read where it fits).
        set_joints: dict[int, SetJoint | None] = {}

        def run(*args: Any) -> Any:
            options, length = now[-1]
            key = (id(options), length)
            if key not in held:
                held.clear()  # one compile at a time: a large model's graphs are not kept
                if joint is not None and length not in set_joints:
                    while len(set_joints) >= _KEPT_LENGTHS:
                        del set_joints[next(iter(set_joints))]
                    try:
                        set_joints[length] = at_length(joint, example_inputs, args)
                    except (TypeError, ValueError, RuntimeError) as e:
                        set_joints[length] = None
                        say(f"a graph cannot be set to {length} tokens ({e}); tracing it there")
                set_at = set_joints.get(length)
                if set_at is None:
                    held[key] = Backend(options, offline=True)(gm, list(args))
                else:
                    held[key] = _partition_at(gm, args, options, set_at)
            return held[key](*args)

        return run

    with offline_step(work, say) as (module, model, optimizer):
        compiled = torch.compile(module, backend=capture)
        dims = _length_dims(inputs_at)

        def plan_at(options: Options, length: int) -> list[Plan]:
            args, kwargs = to_meta(inputs_at(length))
            for leaf, marked in zip(pytree.tree_leaves((args, kwargs)), dims, strict=True):
                for dim in marked:
                    compat.mark_dynamic(leaf, dim)
            now[:] = [(options, length)]
            stats.reset()
            run_step(compiled, args, kwargs, say)
            return collected_plans(model, optimizer)

        yield plan_at


@dataclass
class Joint:
    """A graph's joint forward and backward as AOTAutograd traced it, and how it was cut."""

    gm: Any
    primals: int  # how many of its inputs are the forward's (the rest: the backward's tangents)
    kwargs: dict[str, Any]  # what AOTAutograd passed the partitioner beside the graph


class _Traced(Exception):
    """Raised from the partitioner once the joint graph is kept: nothing else is needed."""


def symbolic_joint(gm: Any, example_inputs: Sequence[Any]) -> Joint | None:
    """The joint graph AOTAutograd traces from dynamo's graph ``gm`` (at dynamo's symbolic
    sizes), as :func:`fxckpt.backend.compile_partitioned` traces it; None where it traces no
    backward."""
    kept: list[Joint] = []

    def keep(joint: Any, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        kept.append(Joint(clone_joint(joint), len(joint_inputs[0]), kwargs))
        raise _Traced

    trace = compat.aot_autograd(fw_compiler=_boxed_nop, bw_compiler=_boxed_nop,
                                inference_compiler=_boxed_nop, partition_fn=keep,
                                keep_inference_input_mutations=True)  # fmt: skip
    try:
        trace(gm, example_inputs)
    except Exception as e:  # dynamo may wrap what the partitioner raised
        if not kept:
            if isinstance(e, _Traced):
                return None
            raise
    return kept[0] if kept else None


def _size_at(size: Any, values: dict[Any, int]) -> int:
    expr = compat.size_expr(size)
    if isinstance(expr, int):
        return expr
    value = expr.xreplace(values)
    if not isinstance(value, int) and not getattr(value, "is_number", False):
        raise ValueError(f"the size {expr} does not follow from the inputs' lengths")
    return int(value)


def at_length(joint: Joint, example_inputs: Sequence[Any], args: Sequence[Any]) -> SetJoint:
    """A copy of ``joint`` at the sizes of ``args`` (this call's inputs, where dynamo's graph was
    traced with ``example_inputs``): each size symbol takes the size it stands for in ``args``,
    the graph's inputs become fakes of plain sizes, every node's value is propagated again, and
    sizes the graph computed from the symbols become constants."""
    values: dict[Any, int] = {}
    for ex, got in zip(example_inputs, args, strict=True):
        pairs = zip(ex.shape, got.shape, strict=True) if isinstance(ex, torch.Tensor) else [(ex, got)]
        for size, value in pairs:
            expr = compat.size_expr(size)
            if getattr(expr, "is_Symbol", False):
                values[expr] = int(value)
    gm = clone_joint(joint.gm)
    mode = compat.static_fake_mode()
    inputs: list[Any] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            inputs.append(_size_at(val, values))
            continue
        with mode:
            inputs.append(torch.empty_strided([_size_at(d, values) for d in val.shape],
                                              [_size_at(d, values) for d in val.stride()],
                                              dtype=val.dtype, device=val.device))  # fmt: skip
    with offline_dispatch():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    for node in reversed(list(gm.graph.nodes)):  # sizes become constants
        val = node.meta.get("val")
        if node.op == "output" or not isinstance(val, (int, float, bool)):
            continue
        for user in list(node.users):
            user.replace_input_with(node, val)
        if node.op != "placeholder":
            gm.graph.erase_node(node)
    gm.recompile()
    return SetJoint(gm, [inputs[: joint.primals], inputs[joint.primals :]], joint.kwargs)


@dataclass
class SetJoint:
    """A joint graph at one length, with its inputs (forward's, backward's) as fakes."""

    gm: Any
    inputs: list[list[Any]]
    kwargs: dict[str, Any]


def _partition_at(gm: Any, args: Sequence[Any], options: Options, joint: SetJoint) -> Any:
    """fxckpt's partitioner on ``joint`` as a compile of dynamo's graph ``gm`` would run it
    (under the step's budget, as :func:`fxckpt.backend.compile_graph`): the plan is recorded;
    the step then runs ``gm`` itself on the meta inputs."""

    def partition(_gm: Any, _inputs: Any) -> Any:
        ticket = step_budget.current()
        partitioner = FxckptPartitioner(
            options, step_token=ticket.cache_token() if ticket is not None else "")
        partitioner(clone_joint(joint.gm), joint.inputs, **dict(joint.kwargs))
        return gm.forward

    if not step_budget.applies(options):
        return partition(gm, args)
    step = step_budget.step_for(options, held=held_on_device)
    return step.compile(step_budget.graph_key(), gm, list(args), partition)


def _length_dims(inputs_at: Callable[[int], Any]) -> list[tuple[int, ...]]:
    """Per input leaf, the dimensions that change with the length (compared at two lengths)."""
    a, b = (pytree.tree_leaves(inputs_at(n)) for n in (64, 128))
    if len(a) != len(b):
        raise TargetError("the step's inputs change structure with the length: they must only "
                          "change size")  # fmt: skip
    dims = [tuple(d for d, (m, n) in enumerate(zip(x.shape, y.shape, strict=True)) if m != n)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == y.dim()
            else () for x, y in zip(a, b, strict=True)]  # fmt: skip
    if not any(dims):
        raise TargetError("no input of the step changes size with the length: is seq passed on "
                          "to the inputs?")  # fmt: skip
    return dims


# A byte budget that never binds: the plan changes nothing, and the step's account is kept.
UNBOUNDED = 2**60


def strategy_options(name: str, limit: int, base: dict[str, Any]) -> tuple[Options, Options | None]:
    """The options a strategy's search probes with, and (fxckpt only) those of its plan at the
    card's budget, from which its step time is read."""
    if name == "none":
        return inspect_options(**{**base, "memory_budget": UNBOUNDED, "segment_stride": 0}), None
    if name == "full_checkpointing":
        return inspect_options(**{**base, "memory_budget": UNBOUNDED, "segment_stride": 1,
                                  "offload": "never"}), None  # fmt: skip
    thrifty = inspect_options(**{**base, "memory_budget": UNBOUNDED, "segment_stride": 1,
                                 "offload": "all"})  # fmt: skip
    return thrifty, inspect_options(**{**base, "memory_budget": limit})


def _probe(plans: Sequence[Plan], length: int, limit: int) -> Probe:
    top = top_step(plans) or {}
    total = int(top.get("total_bytes", 0))
    step_ms = sum(float(p.timeline["predicted_step_ms"]) for p in plans
                  if p.timeline and "predicted_step_ms" in p.timeline)  # fmt: skip
    return Probe(length, total, int(top.get("start_bytes", 0)), step_ms, total <= limit)


def longest_sequences(
    plan_at: PlanAt, *, limit: int, seq: int, ceiling: int, base: dict[str, Any], say: Progress,
    fork: bool | None = None,
) -> list[LongestFit]:
    """Each strategy's longest sequence within ``limit`` bytes, searched in steps of
    :func:`seq_quantum` up to ``ceiling``.

    With ``fork`` (by default on Linux, where the process may use two or more cores; macOS's
    system libraries are not safe to use in a forked copy, and Windows has no fork), a
    forked copy of this process searches plain compile and then per-block checkpointing while
    this one searches fxckpt: the copy shares the traced joint graphs instead of tracing them
    again, and the two searches take about as long. Otherwise one strategy after the other, each
    next from the longest the one before found (each holds less than the one before it)."""
    quantum = seq_quantum(seq)

    def search(names: Sequence[str], start: int) -> list[LongestFit]:
        out = []
        for name in names:
            out.append(_longest(name, plan_at, limit=limit, start=start, quantum=quantum,
                                ceiling=ceiling, base=base, say=say))  # fmt: skip
            start = max(start, out[-1].max_seq or start)
        return out

    if fork is None:
        fork = sys.platform.startswith("linux") and _cores() >= 2
    if not fork:
        return search(STRATEGIES, seq)
    there, here = STRATEGIES[:2], STRATEGIES[2:]
    return in_two(lambda: search(there, seq), lambda: search(here, seq), say=say)


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _longest(name: str, plan_at: PlanAt, *, limit: int, start: int, quantum: int, ceiling: int,
             base: dict[str, Any], say: Progress) -> LongestFit:
    search, at_card = strategy_options(name, limit, base)

    def probe(length: int) -> Probe:
        say(f"{name}: planning at {length} tokens")
        return _probe(plan_at(search, length), length, limit)

    best, probes, capped = longest_fit(probe, limit=limit, start=start, quantum=quantum,
                                       ceiling=ceiling, say=lambda m: say(f"{name}: {m}"))  # fmt: skip
    if best is not None and at_card is not None:
        say(f"{name}: the plan at the card's budget, {best.length} tokens")
        best = _probe(plan_at(at_card, best.length), best.length, limit)
    return LongestFit(name, best.length if best else None, best.step_ms if best else None,
                      best.total_bytes if best else None, capped, tuple(probes))  # fmt: skip


T = TypeVar("T")


def in_two(there: Callable[[], list[T]], here: Callable[[], list[T]], *, say: Progress) -> list[T]:
    """``there() + here()``, with ``there`` run in a forked copy of this process (a
    ``multiprocessing`` fork, which flushes this process's output first and the copy's as it
    ends) while this one runs ``here``. Where the copy fails (or dies), ``there`` runs again
    here, after ``here``, so that its error, if any, is raised as it would be without the fork."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def copy() -> None:
        try:
            send.send(there())
        except BaseException as e:  # noqa: BLE001 (the parent runs it again and raises)
            send.send(f"{type(e).__name__}: {e}")

    process = context.Process(target=copy, daemon=True)
    process.start()
    send.close()  # the copy holds the only writing end: its exit ends the reading
    try:
        mine = here()
    except BaseException:
        process.kill()
        process.join()
        raise
    try:
        theirs: Any = receive.recv()  # before joining: an answer larger than the pipe holds
    except EOFError:  # waits for this end to read it
        theirs = None
    process.join()
    if not isinstance(theirs, list):
        why = theirs if theirs is not None else f"exit status {process.exitcode}"
        say(f"the forked search failed ({why}); searching again here")
        theirs = there()
    return theirs + mine
