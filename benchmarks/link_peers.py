"""The peers of fxckpt that copy on the compute stream, through the emulated host link.

``save_on_cpu`` (the transformers seed's ``offload=True``) and torch's synchronous partitioner
offload both copy on the compute stream: the step waits for every copy. Through an emulated
link (``fxckpt.emulate_link``) each of their copies therefore blocks for its
``overhead + bytes / bandwidth`` (``fxckpt.emulation.copy_on_compute``), while fxckpt's copies
overlap compute on the engine's queues. ``benchmarks/methods.py`` builds the rows
(``save_on_cpu_link``, ``torch_offload_link``) from these.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks import methods


def link_offload_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """``save_on_cpu(pin_memory=True)`` as transformers uses it, through the emulated link: its
    copies run on the compute stream, so each pack waits for a device-to-host copy of the
    tensor and each unpack for a host-to-device one (``fxckpt.emulation.copy_on_compute``).
    The host copies are not device memory: the meter does not see them, the counter files them
    as host."""
    from fxckpt.emulation import copy_on_compute

    def pack(t: torch.Tensor) -> Any:
        host = copy_on_compute(t, "host")
        if methods._ACTIVE:
            methods._ACTIVE[-1].record(host, host=True)
        return t.device, host

    def unpack(packed: Any) -> torch.Tensor:
        device, host = packed
        return copy_on_compute(host, "device")

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _device_put_through_link(t: torch.Tensor) -> torch.Tensor:
    from fxckpt.emulation import copy_on_compute

    return methods.mark_host(copy_on_compute(t, "host"))


def _reload_through_link(t: torch.Tensor) -> torch.Tensor:
    from fxckpt.emulation import copy_on_compute

    return copy_on_compute(t, "device")


def offload_everything_through_link(joint: torch.fx.GraphModule, joint_inputs: Any,
                                     **kwargs: Any) -> tuple[torch.fx.GraphModule, ...]:
    """:func:`benchmarks.methods._offload_everything_partition` with torch's synchronous ``device_put`` copies
    made through the emulated link: each offload (forward) and reload (backward) a copy on the
    compute stream, the forward's host copies out of the meter's sight."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    for node in joint.graph.nodes:
        tag = node.meta.get("partitioner_tag")
        if tag != "is_backward" and not node.name.startswith("tangents"):
            node.meta["should_offload"] = True
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    for gm, prefix, fn in ((fw, "cpu_offload_", _device_put_through_link),
                           (bw, "gpu_reload_", _reload_through_link)):
        for node in list(gm.graph.nodes):
            if node.name.startswith(prefix):
                with gm.graph.inserting_after(node):
                    wrapped = gm.graph.call_function(fn, (node,))
                wrapped.meta.update(node.meta)
                node.replace_all_uses_with(wrapped, delete_user_cb=lambda u, w=wrapped: u is not w)
        gm.recompile()
    return fw, bw
