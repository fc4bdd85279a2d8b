"""The torch.compile backend: ``torch.compile(model, backend="fxckpt", options={...})``."""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fxckpt import _torch_compat as compat
from fxckpt import residency
from fxckpt._modules import make_callable
from fxckpt.errors import OptionsError
from fxckpt.options import ENV_OPTIONS, Options, options_from_env
from fxckpt.planning.plan import Plan, plan_payload

if TYPE_CHECKING:
    from fxckpt.runtime.profiles import Profile

log = logging.getLogger(__name__)

_graph_counter = itertools.count()


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """A hash of fxckpt's own source, so a changed planner never reuses a stale cache entry."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _graph_name() -> str:
    compile_id = compat.current_compile_id()
    serial = next(_graph_counter)
    if compile_id is None:
        return f"graph_{serial}"
    return f"{compile_id}".strip("[]") + f"#{serial}"


def record_plan(plan: Plan) -> str:
    """Register a plan for :func:`fxckpt.last_plans`; returns its JSON payload."""
    from fxckpt.runtime import stats

    payload = plan_payload(plan)
    stats.add_plan_payload(payload)
    return payload


class FxckptPartitioner(compat.CustomPartitionerFn):
    """The partitioner Inductor (or aot_autograd) calls with each joint graph.

    It lives at module level and holds only picklable state, because Inductor pickles it into
    the FX-graph-cache key: an :class:`Options`, and for a re-plan (:mod:`fxckpt.adapt`) the
    figures measured at run time that replace the cost model's and the plan's name.
    """

    def __init__(self, options: Options, measured: Mapping[str, float] | None = None,
                 name: str | None = None, step_token: str = "") -> None:
        self.options = options
        self.measured = tuple(sorted((measured or {}).items()))
        self.name = name
        # Under a step budget a graph's plan also depends on what the graphs before it hold
        # (planning.step_budget): the token says so, and so keys the compile cache.
        self.step_token = step_token

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from fxckpt.passes.partition import partition

        compiler = kwargs.pop("compiler", None)  # Inductor passes "inductor"; aot_autograd nothing
        num_fwd_outputs = kwargs.pop("num_fwd_outputs")
        from fxckpt.planning import step_budget

        ticket = step_budget.current()
        # Each min-cut run gets what it takes of the rest; fxckpt reads none of the others
        # (newer torch may pass metadata such as fw_metadata, pytorch#174823).
        passed, unused = compat.min_cut_keywords(kwargs)
        if unused:
            log.debug("fxckpt: partitioner arguments min-cut does not take: %s", unused)
        return partition(
            gm,
            joint_inputs,
            self.options,
            graph_name=self.name or (ticket.name if ticket is not None else None)
            or _graph_name(),
            num_fwd_outputs=num_fwd_outputs,
            record=record_plan,
            inductor=compiler == "inductor",
            measured=dict(self.measured),
            **passed,
        )

    def uuid(self) -> str:
        from fxckpt import __version__

        return f"fxckpt-{__version__}-{_source_hash()[:16]}-{self._key()}"

    def _key(self) -> str:
        key = self.options.cache_key()
        if self.measured:
            figures = ",".join(f"{k}={v!r}" for k, v in self.measured)
            key = f"{key}-{self.name}-{figures}"
        return f"{key}-{self.step_token}" if self.step_token else key

    def __eq__(self, other: object) -> bool:
        # By cache key, not Options equality: which options were set explicitly changes plans.
        return isinstance(other, FxckptPartitioner) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _boxed_nop(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Any:
    """compiler="eager": run the graph as it is, freeing each input (a saved tensor, in the
    backward) after its last use, as aot_eager does."""
    return compat.boxed_nop(gm, list(example_inputs))  # type: ignore[arg-type]


def configure_runtime(options: Options) -> Profile:
    """The runtime profile of this compile's ``copy_streams``, ``host_budget`` and
    ``offload_dir``, registered for the graphs that name it (:mod:`fxckpt.runtime.profiles`).

    Nothing another compile set changes: a profile of other settings keeps its engine, its
    host pool (capped at its own budget; staging for the disk tier comes from it too) and its
    folder. ``offload_dir`` is checked when its profile is first made, so a missing or
    unwritable directory is an :class:`OptionsError` at compile time, and what killed
    processes left there is removed.
    """
    from fxckpt.runtime import profiles

    check_training_options(options)
    settings = options.runtime_settings()
    found = profiles.find(settings.key())
    return found or profiles.register(settings, options.resolve_host_budget())


def runtime_profile(options: Options) -> Profile | None:
    """The runtime profile graphs compiled with ``options`` run on in this process, or
    ``None`` before the first such compile."""
    from fxckpt.runtime import profiles

    return profiles.find(options.runtime_settings().key())


def check_training_options(options: Options) -> None:
    """Raise :class:`OptionsError` for what :class:`Options` accepts but training cannot use,
    checked without a graph: an ``offload_dir`` that is missing or not writable, an
    ``offload_dir_bandwidth`` without a directory (``fxckpt inspect`` plans such a disk tier
    offline), a ``host_budget`` whose machine figures cannot be read. Touches nothing."""
    from fxckpt.runtime import disk_dir

    if options.offload_dir is not None:
        disk_dir.check_directory(options.offload_dir)
    elif options.offload_dir_bandwidth is not None:
        raise OptionsError(
            "offload_dir_bandwidth",
            options.offload_dir_bandwidth,
            "None unless offload_dir is given too (fxckpt inspect --offload-dir-bandwidth plans "
            "a disk tier offline; training needs the directory)",
            "a disk tier's bandwidth, but no offload_dir to write to",
        )
    options.resolve_host_budget()


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options,
    mode: str | None = None,
    *,
    offline: bool = False,
) -> Any:
    """Compile one dynamo graph with fxckpt's partitioner and the chosen code generator.

    ``offline``: planning on meta tensors (``fxckpt inspect``); the runtime is left alone.
    Otherwise the graph's copies are measured at run time, and under ``adapt="auto"`` a graph
    whose measurements contradict its plan is re-planned (:mod:`fxckpt.adapt`). Under a
    ``memory_budget`` the graph is one of its step's (:mod:`fxckpt.planning.step_budget`),
    which gives it its target: what the budget leaves its own forward and backward.
    """
    if not offline:
        configure_runtime(options)
    from fxckpt.planning import step_budget

    if step_budget.applies(options):
        from fxckpt.meter import Meter, held_on_device
        from fxckpt.passes.inductor_peak import step_peak_parts

        step = step_budget.step_for(
            options, step_peak_parts if options.compiler == "inductor" else lambda payload: None,
            held_on_device,
            None if offline else (lambda device: Meter(device, holding=(), calibration=True)))
        return step.compile(
            step_budget.graph_key(), gm, example_inputs,
            lambda g, inputs: _compile_measured(g, inputs, options, mode, offline=offline),
        )  # fmt: skip
    return _compile_measured(gm, example_inputs, options, mode, offline=offline)


def _compile_measured(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Options,
    mode: str | None,
    *,
    offline: bool,
) -> Any:
    """One compile of the graph (under its step's ticket, if any), wrapped to be measured."""
    from fxckpt.planning import step_budget

    ticket = step_budget.current()
    partitioner = FxckptPartitioner(
        options, step_token=ticket.cache_token() if ticket is not None else "")
    if offline:
        return compile_partitioned(gm, example_inputs, partitioner, mode, offline=True)
    from fxckpt import adapt

    recipe = adapt.Recipe.capture(gm, example_inputs, options, mode)
    compiled = compile_partitioned(gm, example_inputs, partitioner, mode)
    return adapt.Adaptive(compiled, recipe, options, device=adapt.graph_device(example_inputs))


def compile_partitioned(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    partitioner: FxckptPartitioner,
    mode: str | None = None,
    *,
    offline: bool = False,
) -> Any:
    """:func:`compile_graph` with a given partitioner, without the run-time measurement."""
    from fxckpt.planning import step_budget

    options = partitioner.options
    ticket = step_budget.current()
    if options.compiler == "eager":
        if mode not in (None, "default"):
            raise OptionsError(
                "mode", mode, "no mode with compiler='eager' (modes configure Inductor)"
            )
        compiled = compat.aot_autograd(
            fw_compiler=_boxed_nop,
            bw_compiler=_boxed_nop,
            inference_compiler=_boxed_nop,
            partition_fn=partitioner,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    else:
        patches = inductor_patches(partitioner, mode)
        compiled = compat.compile_fx(gm, example_inputs, config_patches=patches)
    # What the first training step really holds for the backward, against the plan.
    if offline:
        return compiled
    return residency.checked(compiled, on_plan=ticket.reported if ticket is not None else None)


def inductor_patches(partitioner: FxckptPartitioner, mode: str | None) -> dict[str, Any]:
    """The Inductor settings of one compile: fxckpt's partitioner, the FX graph cache's
    permission to store the graphs the partitioner pins
    (:func:`fxckpt._torch_compat.cache_pinned_graphs`), and ``mode``'s settings. Nothing
    global changes, except that Inductor learns that the outputs of ``wait`` and ``wait_many``
    are aligned (:func:`fxckpt._torch_compat.assume_aligned_outputs`)."""
    from fxckpt.passes import inductor_peak
    from fxckpt.runtime import bucket_ops, ops

    compat.assume_aligned_outputs(ops.WAIT)
    compat.assume_aligned_outputs(bucket_ops.WAIT_MANY)
    return {
        "custom_partitioner_fn": partitioner,
        **compat.cache_pinned_graphs(),
        **inductor_peak.settings(),
        **mode_patches(mode),
    }


def mode_patches(mode: str | None) -> dict[str, Any]:
    """The Inductor settings ``torch.compile``'s ``mode`` stands for.

    The CUDA-graph modes (``"reduce-overhead"``, ``"max-autotune"``) need nothing more:
    fxckpt's ops are tagged ``cudagraph_unsafe``, so Inductor's graph partitioning captures
    the compute between them and runs the ops themselves outside any CUDA graph (a replayed
    copy would refill a host buffer the pool has handed on). With partitioning turned off
    (``TORCHINDUCTOR_GRAPH_PARTITION=0``), Inductor instead runs a graph that holds one of
    the ops without CUDA graphs, and logs why.
    """
    if mode in (None, "default"):
        return {}
    modes = compat.inductor_mode_options()
    if mode not in modes:
        raise OptionsError("mode", mode, "one of " + ", ".join(repr(m) for m in modes))
    return dict(modes[mode])


def fxckpt_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | Options | None = None,
    mode: str | None = None,
) -> Any:
    """The ``torch_dynamo_backends`` entry point behind ``backend="fxckpt"``.

    Options come from ``torch.compile(..., options={...})``; where that is not possible (the
    Hugging Face Trainer), from a JSON object in ``FXCKPT_OPTIONS``, read here and only here.
    Explicit options win over the environment.
    """
    if isinstance(options, Options):
        opts = options
    else:
        env = options_from_env()
        explicit = dict(options or {})
        try:
            opts = Options.from_mapping({**env, **explicit})
        except OptionsError as e:
            if e.option not in env or e.option in explicit:
                raise
            where = f"set in the environment variable {ENV_OPTIONS}"
            raise OptionsError(e.option, e.value, e.accepted,
                               f"{e.detail}; {where}" if e.detail else where) from None
    return compile_graph(gm, example_inputs, opts, mode)


class Backend:
    """A validated fxckpt backend, as returned by :func:`fxckpt.backend`.

    ``offline``: for planning on meta tensors; compiling leaves the runtime's settings alone.
    """

    def __init__(self, options: Options, *, offline: bool = False) -> None:
        self.options = options
        self.offline = offline

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kw: Any) -> Any:
        if kw.get("options"):
            raise OptionsError(
                "options",
                kw["options"],
                "options passed to fxckpt.backend(...), not to torch.compile as well",
            )
        return compile_graph(gm, example_inputs, self.options, kw.get("mode"), offline=self.offline)

    def __repr__(self) -> str:
        return f"fxckpt.backend({self.options!r})"


def backend(**kwargs: Any) -> Backend:
    """``torch.compile(model, backend=fxckpt.backend(memory_budget="12GiB"))``.

    The options are validated here, before anything is compiled: their values, and what
    training needs of the machine that can be checked without a graph
    (:func:`check_training_options`: the ``offload_dir`` exists and is writable, say).
    """
    options = Options.from_mapping(kwargs)
    check_training_options(options)
    return Backend(options)



make_callable(__name__)  # fxckpt.backend(...) is backend(...) (fxckpt/_modules.py)
