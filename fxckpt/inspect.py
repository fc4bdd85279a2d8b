"""Offline planning: run fxckpt's partitioner on meta tensors and return its plans.

``inspect(model, example_inputs, memory_budget="24GiB")`` compiles one training step with
``torch.compile(backend=fxckpt.backend(compiler="eager", ...))`` on the ``meta`` device. The
partitioner plans during the first call; the compiled graphs then run on meta tensors, which
have shapes but no data, so no activation or weight memory is ever allocated. The model may be
built on ``meta`` (see :func:`fxckpt.hf_config.hf_workload`) or be a real one: real weights are replaced by meta
stand-ins in a copy and never touched.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxckpt import _torch_compat as compat
from fxckpt import sizing
from fxckpt._modules import make_callable
from fxckpt._torch_compat import pytree
from fxckpt.backend import Backend
from fxckpt.errors import FxckptError, OptionsError
from fxckpt.options import Options
from fxckpt.planning.plan import Plan
from fxckpt.planning.start_level import forget, watch
from fxckpt.runtime import stats

Progress = Callable[[str], None]
_WRAPPED = "model"  # the attribute of the wrapper (_Step) that holds the user's model


class TargetError(FxckptError, ValueError):
    """The model to inspect cannot be built: a bad factory, config or example input."""


@dataclass
class Workload:
    """A model and one step's inputs; ``loss_fn(output)`` turns the output into the loss."""

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any], Any] | None = None
    description: str = ""
    # fxckpt.stream_weights's keyword arguments, to plan the model with streamed weights.
    stream_weights: dict[str, Any] | None = None
    # The optimizer whose state the step starts with (fxckpt.sizing.OPTIMIZERS).
    optimizer: str = "none"
    # The step's (args, kwargs) at any sequence length, for planning at other lengths.
    inputs_at: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    seq: int | None = None  # the sequence length of args and kwargs, where it is known


# --------------------------------------------------------------------------------------------
# Making meta tensors behave like a GPU's
# --------------------------------------------------------------------------------------------


_SDPA = F.scaled_dot_product_attention


def _gpu_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the kernel a CUDA device would pick.

    On meta tensors torch always takes the math path (``_fused_sdp_choice`` has no meta
    implementation), which saves the S x S attention probabilities: 64 GiB per layer at 32k
    tokens, a plan no GPU run would have. Flash attention when there is no mask and the dtype
    is half precision, memory-efficient attention otherwise, as sdpa does on CUDA.
    """
    if query.device.type != "meta":
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                     enable_gqa=enable_gqa)  # fmt: skip
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    half = query.dtype in (torch.float16, torch.bfloat16)
    if attn_mask is None and half and query.shape[-1] <= 256:
        flash = compat.SDPA_FLASH
        return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        bias = torch.zeros_like(attn_mask, dtype=query.dtype)
        attn_mask = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
    if attn_mask is not None:
        shape = (*query.shape[:-1], key.shape[-2])
        attn_mask = attn_mask.expand(shape)
    efficient = compat.SDPA_EFFICIENT
    return efficient(query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def offline_dispatch() -> Iterator[None]:
    """While planning on meta tensors: gradients for composite ops, and GPU attention kernels.

    The step runs on meta inputs with no ``torch.device("meta")`` mode: dynamo would trace that
    mode's ``__torch_function__`` at every torch call (a third of the trace of a large model)
    and cannot trace a method's ``super()`` call under it. Models make their tensors on their
    inputs' device, as they must to train on a GPU."""
    F.scaled_dot_product_attention = _gpu_sdpa
    try:
        with compat.composite_ops_decompose_on_meta():
            yield
    finally:
        F.scaled_dot_product_attention = _SDPA


# --------------------------------------------------------------------------------------------
# Moving a workload to meta
# --------------------------------------------------------------------------------------------


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def meta_copy(model: nn.Module) -> nn.Module:
    """``model`` itself when it lives on ``meta``; otherwise a copy whose tensors are meta.

    The copy shares nothing with ``model`` and copies no data: ``copy.deepcopy`` finds a meta
    stand-in for every parameter and buffer in its memo, which also keeps tied weights tied.
    """
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device.type == "meta" for t in tensors):
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(_meta_like(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo.setdefault(id(b), _meta_like(b))
    return copy.deepcopy(model, memo)


def to_meta(tree: Any) -> Any:
    """Every tensor in a nested structure of inputs, as a meta tensor of the same layout."""

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            return _meta_like(x).requires_grad_(x.requires_grad)
        return x

    return pytree.tree_map(move, tree)


class _Step(nn.Module):
    """``loss_fn(model(...))`` as one module, so the loss is part of the compiled graph.

    The model is always wrapped: dynamo then names submodules from this module's ``self``
    (``L['self'].model.layers[0]``), whatever decorators the model's own forward carries
    (Hugging Face's make the root ``L['args'][0]``).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any], Any] | None) -> None:
        super().__init__()
        setattr(self, _WRAPPED, model)
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = getattr(self, _WRAPPED)(*args, **kwargs)
        return out if self.loss_fn is None else self.loss_fn(out)


def _unwrap_paths(plan: Plan) -> Plan:
    """Module paths relative to the user's model, not to the loss wrapper."""
    prefix = _WRAPPED + "."
    rows = [
        replace(a, module=a.module.removeprefix(prefix) if a.module != _WRAPPED else "")
        for a in plan.activations
    ]
    notes = [n.replace(f"'{prefix}", "'") for n in plan.notes]  # "blocks 0..3 under 'layers'"
    weights = [replace(w, parameter=w.parameter.removeprefix(prefix)) for w in plan.weights]
    return replace(plan, activations=rows, notes=notes, weights=weights)


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _report_steps(progress: Progress | None) -> Iterator[None]:
    """Report each stage of the partitioner as it ends (:mod:`fxckpt.passes.pipeline`)."""
    if progress is None:
        yield
        return
    from fxckpt.passes.pipeline import StageDone, listening

    def say(done: StageDone) -> None:
        progress(f"graph {done.graph}: {done.name} done in {done.seconds:.1f} s")

    with listening(say):
        yield


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


def inspect_options(**options: Any) -> Options:
    """The Options an offline run uses: ``compiler="eager"``, ``on_infeasible="warn"`` unless set.

    ``memory_budget="auto"`` raises :class:`OptionsError`: the meta device has no capacity.
    """
    merged = {"on_infeasible": "warn", **options, "compiler": "eager"}
    opts = Options.from_mapping(merged)
    if opts.memory_budget == "auto":
        opts.resolve_budget(device="meta")  # raises: the meta device has no capacity to read
    return opts


@contextlib.contextmanager
def offline_step(work: Workload, say: Progress) -> Iterator[tuple[_Step, nn.Module, Any]]:
    """``work``'s step on meta tensors, ready to compile: the module (loss included, in
    training mode), the meta model, and the optimizer whose state the start level counts.
    Dynamo's caches and fxckpt's stats are reset on the way in and dynamo's on the way out."""
    model = meta_copy(work.model)
    if work.stream_weights is not None:
        from fxckpt.weights import stream_weights

        model = copy.deepcopy(model) if model is work.model else model  # never the caller's
        say(f"streaming weights: {stream_weights(model, **work.stream_weights)}")
    optimizer = sizing.optimizer_state(model, work.optimizer)
    if optimizer is not None:
        watch(optimizer)  # the start level counts its state
    module = _Step(model, work.loss_fn)
    was_training = module.training
    module.train()  # plan the training step: dropout and friends as in training
    compat.reset_dynamo()
    stats.reset()
    try:
        yield module, model, optimizer
    finally:
        module.train(was_training)
        compat.reset_dynamo()
        forget(optimizer)


def run_step(compiled: Any, args: Any, kwargs: Any, say: Progress) -> None:
    """One call of the compiled step on meta tensors; fxckpt's own errors come out unwrapped."""
    try:
        with offline_dispatch(), _report_steps(say):
            compiled(*args, **kwargs)
    except compat.backend_failure() as e:
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, FxckptError):
            raise inner from None
        raise


def collected_plans(model: nn.Module, optimizer: Any) -> list[Plan]:
    """The plans of the graphs compiled since the stats were reset, with the step's parameter
    and optimizer bytes written into each plan's ``step``."""
    plans = [Plan.from_dict(json.loads(p)) for p in stats.plan_payloads() if p]
    sizes = {"parameters_bytes": sizing.parameter_bytes(model),
             "optimizer_bytes": sizing.state_bytes(optimizer)}  # fmt: skip
    for plan in plans:
        if plan.step is not None:
            plan.step.update(sizes)
    if not plans:
        raise TargetError(
            "nothing to plan: no output of the model requires grad (are its parameters "
            "frozen, or does it run under torch.no_grad()?)"
        )
    return [_unwrap_paths(p) for p in plans]


def plan_workload(
    work: Workload, options: Options, *, progress: Progress | None = None
) -> list[Plan]:
    """Plan one training step of ``work`` on meta tensors; one Plan per compiled graph."""
    say = progress or (lambda _msg: None)
    with offline_step(work, say) as (module, model, optimizer):
        args, kwargs = to_meta((work.args, work.kwargs))
        compiled = torch.compile(module, backend=Backend(options, offline=True))
        start = time.perf_counter()
        say("tracing the model with dynamo")
        run_step(compiled, args, kwargs, say)
        plans = collected_plans(model, optimizer)
    say(f"planned {len(plans)} graph(s) in {time.perf_counter() - start:.1f} s")
    return plans


def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) from a tuple or list of arguments, a dict of keyword arguments, or one."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def inspect(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    progress: Progress | None = None,
    stream_weights: dict[str, Any] | None = None,
    optimizer: str = "none",
    **options: Any,
) -> list[Plan]:
    """Plan ``model``'s training step offline and return one :class:`Plan` per graph.

    ``example_inputs`` is a tuple of positional arguments, a dict of keyword arguments, or a
    single tensor. The model's output (or ``loss_fn(output)``) should be the loss; its
    ``.loss`` attribute is fine too. ``options`` are :class:`fxckpt.Options` fields; the
    compiler is always ``"eager"``, and ``on_infeasible`` defaults to ``"warn"`` so that a
    plan over budget is still shown. Nothing runs on real tensors: weights and inputs are
    replaced by meta tensors of the same shapes. ``stream_weights``: the keyword arguments of
    :func:`fxckpt.stream_weights` (``{}``: every parameter it would take), to plan the step
    with those weights in host memory (under ``memory_budget``, the plan says which stay).
    ``optimizer`` (``"adamw"``, ``"sgd"`` or ``"none"``): the step starts holding that
    optimizer's state (:mod:`fxckpt.sizing`); under a budget each plan's ``step`` then gives
    ``parameters_bytes`` and ``optimizer_bytes`` beside its other parts.

    Like a fresh compile in a benchmark, this calls ``compat.reset_dynamo()`` before and after
    planning (other compiled models in the process recompile on their next call) and
    :func:`fxckpt.reset_stats` before it.
    """
    opts = inspect_options(**options)
    work = Workload(model, *split_inputs(example_inputs), loss_fn, stream_weights=stream_weights,
                    optimizer=optimizer)
    return plan_workload(work, opts, progress=progress)


__all__ = [
    "OptionsError",
    "TargetError",
    "Workload",
    "inspect",
    "inspect_options",
    "meta_copy",
    "offline_dispatch",
    "plan_workload",
    "split_inputs",
    "to_meta",
]


make_callable(__name__)  # fxckpt.inspect(...) is inspect(...) (fxckpt/_modules.py)
