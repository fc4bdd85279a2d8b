"""Streamed weights' gradients in the compiled backward: copied to the host behind compute.

A trainable streamed weight's gradient reaches the host through ``fxckpt::stream_out``, which
copies on the compute side and is complete on return: compute waits for every gradient's
copy. :func:`schedule_grads` splits each ``stream_out`` of a partitioned backward in three:

- ``fxckpt::grad_offload`` where the gradient is produced: its copy starts on the engine's
  device-to-host queue, FIFO with the activations' offloads, and runs behind the compute that
  produces the next gradients;
- ``fxckpt::offload_done`` (the activations' join, the gradient as its keepalive) once the
  gradients produced after it would put more than ``lead_bytes`` of them on their way: compute
  waits for the copy there, and the device gradient may be freed after it;
- ``fxckpt::grad_host`` at the backward's end: the host waits for the copy too, and autograd
  gets the host tensor, to accumulate into the host parameter's ``.grad`` as before.

So the device holds at most ``lead_bytes`` of gradients on their way beside the one just
produced, and every host ``.grad`` is complete when the backward returns. The ops carry the
roles :func:`fxckpt.passes.schedule.pin_positions` pins under Inductor.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxckpt.graph import meta
from fxckpt.graph.sizes import numel_bytes
from fxckpt.passes.offload import _handle_val, _token_val

STREAM_OUT = torch.ops.fxckpt.stream_out.default
GRAD_OFFLOAD = torch.ops.fxckpt.grad_offload.default
GRAD_HOST = torch.ops.fxckpt.grad_host.default
OFFLOAD_DONE = torch.ops.fxckpt.offload_done.default


def schedule_grads(bw: fx.GraphModule, profile: str | None, lead_bytes: int | None = None
                   ) -> fx.GraphModule:
    """Replace each ``stream_out`` of the backward ``bw`` by a copy started where the gradient
    is produced, joined once ``lead_bytes`` of later gradients are on their way (``None``:
    twice the largest gradient), and handed to autograd at the end."""
    outs = list(bw.graph.find_nodes(op="call_function", target=STREAM_OUT))
    if not outs:
        return bw
    graph = bw.graph
    output = graph.output_node()
    sizes = [_bytes(n.args[0]) for n in outs]
    lead = 2 * max(sizes) if lead_bytes is None else lead_bytes
    on_the_way: list[tuple[fx.Node, fx.Node, int]] = []  # (handle, gradient, bytes)

    def join(before: fx.Node) -> None:
        handle, grad, _ = on_the_way.pop(0)
        with graph.inserting_before(before):
            done = graph.call_function(OFFLOAD_DONE, (handle, grad))
        done.meta.update({"val": _token_val(grad.meta["val"]), meta.ROLE: meta.ROLE_OFFLOAD_DONE,
                          meta.SOURCE: grad.name})  # fmt: skip

    for node, size in zip(outs, sizes, strict=True):
        grad = node.args[0]
        assert isinstance(grad, fx.Node)
        val = grad.meta["val"]
        while on_the_way and sum(s for *_, s in on_the_way) + size > lead:
            join(node)
        with graph.inserting_before(node):
            handle = graph.call_function(GRAD_OFFLOAD, (grad,), {"profile": profile})
        handle.meta.update({"val": _handle_val(val), meta.ROLE: meta.ROLE_OFFLOAD, meta.SOURCE: grad.name})
        on_the_way.append((handle, grad, size))
        with graph.inserting_before(output):
            host = graph.call_function(GRAD_HOST, (handle, list(val.shape), val.dtype))
        host.meta.update({"val": node.meta["val"], meta.ROLE: meta.ROLE_OFFLOAD_DONE, meta.SOURCE: grad.name})
        node.replace_all_uses_with(host)
        graph.erase_node(node)
    first_host = next(n for n in graph.nodes if n.target is GRAD_HOST)
    while on_the_way:
        join(first_host)
    graph.lint()
    bw.recompile()
    return bw


def _bytes(node: object) -> int:
    val = getattr(node, "meta", {}).get("val")
    return numel_bytes(val) if isinstance(val, torch.Tensor) else 0
