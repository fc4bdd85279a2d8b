"""The model, the methods (one row each) and the saved-bytes counter that every benchmark shares.

``cpu_bench.py`` and ``gpu_check.py`` build their rows from :func:`method_specs` and
:func:`build_runner`, so the CPU and GPU tables have the same rows, run the same way, and
count saved bytes with the same :class:`SavedCounter`.

Methods:

- ``eager``: no checkpointing.
- ``full_checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block.
- ``save_on_cpu``: the transformers seed's ``offload=True`` path: ``save_on_cpu`` around each
  checkpointed block (``modeling_utils._activation_checkpointing_enable``).
- ``compiled``: plain ``torch.compile`` (min-cut), the yardstick for compile time.
- ``torch_offload``: torch's partitioner offload
  (``torch._functorch.config.enable_activation_offloading``) with every forward node of the
  joint graph tagged ``meta["should_offload"]``, in its synchronous (``device_put``) mode.
- ``torch_budget``: ``activation_memory_budget=0.5`` patched around the first call.
- ``fxckpt_*``: ``backend="fxckpt"`` with the options in the spec.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# ---------------------------------------------------------------------------------------------
# The model: one decoder class, GPT-style (LayerNorm, GELU) or Qwen3-style (RMSNorm, q/k norm,
# RoPE, grouped KV heads, SwiGLU).
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderConfig:
    name: str
    vocab: int
    d: int
    heads: int
    layers: int
    ffn: int
    kv_heads: int | None = None  # None: as many as heads
    head_dim: int | None = None  # None: d // heads
    style: str = "gpt"  # "gpt" or "qwen3"

    def describe(self) -> str:
        kv = self.kv_heads or self.heads
        return (
            f"{self.style} decoder '{self.name}': {self.layers} layers, d={self.d}, "
            f"{self.heads} heads ({kv} KV), ffn={self.ffn}, vocab={self.vocab}"
        )


# The CPU benchmark's decoder (d=256, 8 blocks; quick mode is smaller).
GPT_SMALL = DecoderConfig("gpt-small", vocab=2048, d=256, heads=4, layers=8, ffn=1024)
GPT_QUICK = DecoderConfig("gpt-quick", vocab=1024, d=192, heads=4, layers=6, ffn=768)
# The scripts' --smoke decoder: seconds per run, to check that a script runs end to end
# (its figures mean nothing at this size).
GPT_SMOKE = DecoderConfig("gpt-smoke", vocab=64, d=32, heads=2, layers=2, ffn=64)
# Qwen3-1.7B's shapes (config.json of Qwen/Qwen3-1.7B); gpu_check trims the layer count.
QWEN3_1_7B = DecoderConfig(
    "qwen3-1.7b", vocab=151936, d=2048, heads=16, kv_heads=8, head_dim=128, layers=28,
    ffn=6144, style="qwen3",
)  # fmt: skip


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        hd = cfg.head_dim or cfg.d // cfg.heads
        kv = cfg.kv_heads or cfg.heads
        self.heads, self.kv, self.hd, self.qwen = cfg.heads, kv, hd, cfg.style == "qwen3"
        norm = (lambda n: nn.RMSNorm(n, eps=1e-6)) if self.qwen else nn.LayerNorm
        self.norm1, self.norm2 = norm(cfg.d), norm(cfg.d)
        self.q = nn.Linear(cfg.d, cfg.heads * hd, bias=not self.qwen)
        self.kv_proj = nn.Linear(cfg.d, 2 * kv * hd, bias=not self.qwen)
        self.o = nn.Linear(cfg.heads * hd, cfg.d, bias=not self.qwen)
        if self.qwen:
            self.q_norm, self.k_norm = norm(hd), norm(hd)
            self.gate_up = nn.Linear(cfg.d, 2 * cfg.ffn, bias=False)
        else:
            self.fc1 = nn.Linear(cfg.d, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.d, bias=not self.qwen)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd)
        k, v = self.kv_proj(h).view(b, t, 2, self.kv, self.hd).unbind(2)
        if self.qwen:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if self.qwen:
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.kv != self.heads:
            # Repeated explicitly rather than enable_gqa=True: every SDPA backend takes this,
            # so CUDA picks flash attention instead of falling back to the S x S math path.
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.hd))
        h = self.norm2(x)
        if self.qwen:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
            return x + self.fc2(F.silu(gate) * up)
        return x + self.fc2(F.gelu(self.fc1(h)))


BlockCall = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Decoder(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy loss.

    ``block_call``, when set, runs each block (``block_call(block, x, cos, sin)``): that is
    where the eager methods put their checkpointing.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d, eps=1e-6) if cfg.style == "qwen3" else nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        self.block_call: BlockCall | None = None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        cos = sin = x.new_empty(0)  # GPT style: no rotary embedding
        if self.cfg.style == "qwen3":
            t, hd = idx.shape[1], self.cfg.head_dim or self.cfg.d // self.cfg.heads
            pos = torch.arange(t, device=idx.device, dtype=torch.float32)
            inv = 1e6 ** (-torch.arange(0, hd, 2, device=idx.device, dtype=torch.float32) / hd)
            ang = torch.outer(pos, inv).repeat(1, 2)
            cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        for layer in self.layers:
            if self.block_call is None:
                x = layer(x, cos, sin)
            else:
                x = self.block_call(layer, x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_batch(cfg: DecoderConfig, batch: int, seq: int, device: torch.device | str,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab, (batch, seq), generator=g)
    return idx.to(device), torch.roll(idx, -1, 1).to(device)


# ---------------------------------------------------------------------------------------------
# Counting saved bytes: one hook for every method.
# ---------------------------------------------------------------------------------------------

_ACTIVE: list[SavedCounter] = []


class SavedCounter:
    """Bytes saved for backward during one forward, one count per storage.

    Installed as the outermost ``saved_tensors_hooks``; a method that pushes its own hooks
    (``save_on_cpu``) gets them wrapped by :func:`host_offload_hooks`, so the counter still sees
    what they keep. A saved tensor counts as *host* when it is on another device than the
    compute device, pinned, returned packed by an offloading hook, or registered by
    :func:`mark_host` (torch's offload on a CPU device, where ``device_put`` to the CPU is an
    alias). Excluded everywhere: parameters (and views of them, such as the transposed weights
    compiled graphs save) and tensors of at most one element (fxckpt's offload handles are
    0-d int64 tensors; RNG seeds and offsets look the same). fxckpt's host pool buffers are
    never saved tensors, so the hook cannot see them: its offloaded bytes are read from
    ``fxckpt.stats()`` instead.
    """

    def __init__(self, params: Iterator[nn.Parameter], device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.resident: dict[tuple[str, int], int] = {}
        self.host: dict[tuple[str, int], int] = {}
        self.host_keys: set[tuple[str, int]] = set()

    def record(self, t: Any, host: bool = False) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() <= 1 or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.data_ptr() in self.params:
            return
        host = (
            host
            or t.device.type != self.device.type
            or (t.device.type == "cpu" and self.device.type != "cpu" and t.is_pinned())
            or key in self.host_keys
        )
        (self.host if host else self.resident)[key] = storage.nbytes()

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.record(t)
        return t

    @contextlib.contextmanager
    def counting(self) -> Iterator[SavedCounter]:
        self.resident.clear()
        self.host.clear()
        self.host_keys.clear()
        _ACTIVE.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _ACTIVE.remove(self)


def host_offload_hooks(device: torch.device) -> torch.autograd.graph.saved_tensors_hooks:
    """``save_on_cpu`` as transformers uses it, its pack hook seen by the active counter.

    ``pin_memory=True`` on an accelerator, as transformers passes it. On a CPU-only build that
    raises ("no pinned memory allocator"), so the CPU row uses ``pin_memory=False``, whose
    ``tensor.cpu()`` returns the tensor itself: no copy is made there.
    """
    hooks = torch.autograd.graph.save_on_cpu(
        pin_memory=device.type != "cpu", device_type=device.type
    )
    if _ACTIVE:
        counter, pack = _ACTIVE[-1], hooks.pack_hook

        def counted_pack(t: torch.Tensor) -> Any:
            packed = pack(t)
            counter.record(packed[1], host=True)
            return packed

        hooks.pack_hook = counted_pack
    return hooks


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Identity that tells the active counter ``t`` is a host copy (see :class:`SavedCounter`)."""
    if _ACTIVE and isinstance(t, torch.Tensor):
        _ACTIVE[-1].host_keys.add((str(t.device), t.untyped_storage().data_ptr()))
    return t


# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------

# memory_budget placeholders: the harness replaces each with the named baseline's measured
# absolute step peak (full_checkpoint's, save_on_cpu's): the bytes the device held at its
# step's peak, what it held when the step started (parameters, buffers, the batch) included,
# which is what memory_budget bounds.
AT_FULL_CHECKPOINT = "at_full_checkpoint"
AT_SAVE_ON_CPU = "at_save_on_cpu"
BUDGET_SOURCES = {"full_checkpoint": AT_FULL_CHECKPOINT, "save_on_cpu": AT_SAVE_ON_CPU,
                  "save_on_cpu_link": AT_SAVE_ON_CPU}


def start_of(placeholder: str) -> str:
    """The key, in a harness's ``budgets``, of what the device held when the named baseline's
    measured step started (its ``start_bytes``): :func:`scaled` scales the part above it."""
    return f"{placeholder}.start"


def scaled(placeholder: str, factor: float) -> str:
    """A memory_budget placeholder at ``factor`` of the way from the baseline's start level to
    its absolute step peak: ``at_full_checkpoint*0.5`` is what the step started with plus half
    of what the baseline's step added to it (a budget in bytes, like the placeholder's)."""
    return f"{placeholder}*{factor:g}"


@dataclass(frozen=True)
class MethodSpec:
    name: str
    kind: str  # eager, full_checkpoint, save_on_cpu, compiled, torch_offload, torch_budget, fxckpt
    options: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""


def fxckpt_spec(name: str, description: str, **options: Any) -> MethodSpec:
    return MethodSpec(name, "fxckpt", dict(options), description)


BASELINE_SPECS: tuple[MethodSpec, ...] = (
    MethodSpec("eager", "eager", description="no checkpointing"),
    MethodSpec("full_checkpoint", "full_checkpoint",
               description="torch.utils.checkpoint(use_reentrant=False) per block"),
    MethodSpec("save_on_cpu", "save_on_cpu",
               description="transformers offload=True: save_on_cpu around each checkpointed block"),
    MethodSpec("compiled", "compiled", description="torch.compile, plain min-cut"),
    MethodSpec("torch_offload", "torch_offload",
               description="enable_activation_offloading, every forward node tagged, sync mode"),
    MethodSpec("torch_budget", "torch_budget", {"activation_memory_budget": 0.5},
               description="activation_memory_budget=0.5 around the first call"),
)  # fmt: skip


def default_fxckpt_specs(min_offload_bytes: int | str) -> tuple[MethodSpec, ...]:
    m = {"min_offload_bytes": min_offload_bytes}
    return (
        fxckpt_spec("fxckpt_stride1", "segment_stride=1: every block a segment", segment_stride=1,
                    **m),
        fxckpt_spec("fxckpt_stride2", "segment_stride=2", segment_stride=2, **m),
        fxckpt_spec("fxckpt_budget0.5",
                    "memory_budget=0.5: 0.5 of the way from the lowest plan to plain compile",
                    memory_budget=0.5, **m),
        fxckpt_spec("fxckpt_at_full_ckpt",
                    "memory_budget = full_checkpoint's measured absolute step peak",
                    memory_budget=AT_FULL_CHECKPOINT, **m),
        fxckpt_spec("fxckpt_offload_all", 'offload="all"', offload="all", **m),
    )  # fmt: skip


def _offload_everything_partition(joint: torch.fx.GraphModule, joint_inputs: Any,
                                  **kwargs: Any) -> tuple[torch.fx.GraphModule, ...]:
    """Tag every forward node ``should_offload``, then run torch's min-cut (which offloads).

    torch itself refuses views, getitems, outputs, static inputs and non-contiguous tensors
    (``_activation_offloading.can_offload``); everything else saved is offloaded.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    for node in joint.graph.nodes:
        tag = node.meta.get("partitioner_tag")
        if tag != "is_backward" and not node.name.startswith("tangents"):
            node.meta["should_offload"] = True
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    # On a CPU device, device_put to the CPU returns the tensor itself; mark those outputs so
    # the counter files them as host copies, as they would be on a GPU.
    for node in list(fw.graph.nodes):
        if node.name.startswith("cpu_offload_"):
            with fw.graph.inserting_after(node):
                marked = fw.graph.call_function(mark_host, (node,))
            marked.meta.update(node.meta)
            node.replace_all_uses_with(marked, delete_user_cb=lambda u, m=marked: u is not m)
    fw.recompile()
    return fw, bw


@dataclass
class Runner:
    """One method on its own copy of the model; :meth:`step` runs forward and backward."""

    spec: MethodSpec
    model: nn.Module
    call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    compiler: str  # "-" (eager), "aot_eager", "inductor", "fxckpt/eager", "fxckpt/inductor"
    options: dict[str, Any] = field(default_factory=dict)
    first_call: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    calls: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def compiled(self) -> bool:
        return self.compiler != "-"

    def step(self, idx: torch.Tensor, tgt: torch.Tensor, counter: SavedCounter | None = None,
             on_forward: Callable[[], None] | None = None, meter: Any = None,
             ) -> tuple[float, int | None, int | None]:
        """Forward and backward; returns (loss, resident saved bytes, host saved bytes) as
        the saved-tensors hook counts them.

        ``on_forward`` runs between the forward and the backward (memory probes); ``meter``
        (an ``fxckpt.Meter``) measures the forward alone.
        """
        for p in self.model.parameters():
            p.grad = None
        ctx = self.first_call() if self.calls == 0 else contextlib.nullcontext()
        self.calls += 1
        resident = host = None
        with ctx:
            with meter if meter is not None else contextlib.nullcontext():
                if counter is None:
                    loss = self.call(idx, tgt)
                else:
                    with counter.counting():
                        loss = self.call(idx, tgt)
                    resident, host = counter.resident_bytes, counter.host_bytes
                if meter is not None:
                    meter.set_output(loss)
            if on_forward is not None:
                on_forward()
            loss.backward()
        return float(loss.detach()), resident, host


def fresh_backend(name: str) -> Callable[..., Any]:
    """A new callable object wrapping the registered backend ``name``."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        return inner(gm, example_inputs, **kwargs)

    backend.__name__ = name  # type: ignore[attr-defined]
    return backend


def build_runner(spec: MethodSpec, model: Decoder, device: torch.device, compiler: str,
                 budget_bytes: int | None = None,
                 budgets: Mapping[str, int] | None = None) -> Runner:
    """``compiler``: "eager" (aot_autograd, no code generation) or "inductor".

    ``budgets``: the bytes behind each memory_budget placeholder (``AT_FULL_CHECKPOINT``,
    ``AT_SAVE_ON_CPU``: that baseline's measured absolute step peak) and, for :func:`scaled`
    ones, its start level (:func:`start_of`); ``budget_bytes`` is ``AT_FULL_CHECKPOINT``'s
    alone. Kinds ending in ``_link`` copy through the emulated host link
    (``fxckpt.emulate_link``) on the compute thread, as those methods copy on the compute
    stream: ``save_on_cpu_link`` and ``torch_offload_link`` (``benchmarks/link_peers.py``)."""
    import torch._functorch.config as fconfig

    def checkpointed(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        return checkpoint(layer, x, cos, sin, use_reentrant=False)

    def offloaded(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        with host_offload_hooks(device):
            return checkpoint(layer, x, cos, sin, use_reentrant=False)

    # A fresh backend object per runner: dynamo reuses a compiled frame whose guards pass and
    # whose backend is the same object, and with nn-module inlining two model copies pass the
    # same guards (torch_budget would silently run "compiled"'s graph).
    plain_backend = fresh_backend("aot_eager" if compiler == "eager" else "inductor")
    def offloaded_through_link(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor) -> torch.Tensor:
        from benchmarks.link_peers import link_offload_hooks

        with link_offload_hooks():
            return checkpoint(layer, x, cos, sin, use_reentrant=False)

    kind = spec.kind
    if kind in ("eager", "full_checkpoint", "save_on_cpu", "save_on_cpu_link"):
        model.block_call = {"eager": None, "full_checkpoint": checkpointed,
                            "save_on_cpu": offloaded,
                            "save_on_cpu_link": offloaded_through_link}[kind]  # fmt: skip
        return Runner(spec, model, model, "-")
    if kind == "compiled":
        return Runner(spec, model, torch.compile(model, backend=plain_backend, dynamic=False),
                      plain_backend.__name__)
    if kind == "torch_budget":
        budget = spec.options["activation_memory_budget"]
        return Runner(spec, model, torch.compile(model, backend=plain_backend, dynamic=False),
                      plain_backend.__name__, dict(spec.options),
                      lambda: fconfig.patch(activation_memory_budget=budget))
    if kind in ("torch_offload", "torch_offload_link"):
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        from benchmarks.link_peers import offload_everything_through_link

        part = (_offload_everything_partition if kind == "torch_offload"
                else offload_everything_through_link)
        be = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=part)
        return Runner(spec, model, torch.compile(model, backend=be, dynamic=False), "aot_eager",
                      {"enable_activation_offloading": True},
                      lambda: fconfig.patch(enable_activation_offloading=True))
    if kind == "fxckpt":
        import fxckpt  # noqa: F401  (registers the backend's ops)

        options = dict(spec.options)
        known = dict(budgets or {})
        if budget_bytes is not None:
            known.setdefault(AT_FULL_CHECKPOINT, int(budget_bytes))
        placeholder, _, factor = str(options.get("memory_budget", "")).partition("*")
        if placeholder in BUDGET_SOURCES.values():
            if placeholder not in known:
                raise ValueError(f"{spec.name} needs the measured bytes of {placeholder} first")
            peak, start = known[placeholder], known.get(start_of(placeholder), 0)
            options["memory_budget"] = int(start + (peak - start) * float(factor or 1.0))
        options["compiler"] = compiler
        # A fresh backend object here too: torch.compile's wrappers of a named backend compare
        # equal when their options do, and then a second copy of the model (save_on_cpu's
        # budget is full checkpointing's on the CPU) would run the first one's graphs, and
        # share its step's account (two models' parameters in one start level).
        call = torch.compile(model, backend=fresh_backend("fxckpt"), options=options,
                             dynamic=False)
        return Runner(spec, model, call, f"fxckpt/{compiler}", options)
    raise ValueError(f"unknown method kind {kind!r}")


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grads_match(ref: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor],
                **tolerances: float) -> tuple[bool, str]:
    """``torch.testing.assert_close`` on every parameter gradient; (ok, first mismatch).

    ``scale_rtol=r`` instead: each parameter's largest difference within ``r`` times its
    gradient's largest magnitude. In bf16 a gradient of ~1e-3 makes any absolute tolerance
    either blind or noise; a race moves a gradient by about its own size."""
    if set(ref) != set(got):
        return False, f"gradients differ in which parameters have one: {set(ref) ^ set(got)}"
    rel = tolerances.pop("scale_rtol", None)
    if rel is not None:
        worst, worst_ratio = "", 0.0
        for name in ref:
            a, b = ref[name].double(), got[name].double()
            scale = a.abs().max().item() if a.numel() else 0.0
            diff = (a - b).abs().max().item() if a.numel() else 0.0
            ratio = diff / max(scale, 1e-30) if diff == diff else float("inf")
            if ratio > worst_ratio or ratio != ratio:
                worst, worst_ratio = name, ratio
        if worst_ratio > rel or worst_ratio != worst_ratio:
            return False, f"{worst}: largest difference {worst_ratio:.3g} of its magnitude > {rel}"
        return True, ""
    for name in ref:
        try:
            torch.testing.assert_close(got[name], ref[name], **tolerances)
        except AssertionError as e:
            return False, f"{name}: {str(e).splitlines()[0]}"
    return True, ""


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return math.nan
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
