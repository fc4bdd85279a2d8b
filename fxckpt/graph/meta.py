"""The ``node.meta`` keys fxckpt reads and writes, as constants.

Passes find the nodes they inserted through these keys, never by name prefix.
"""

from __future__ import annotations

# Written by fxckpt.
BLOCK = "fxckpt.block"  # int: index of the repeated block the node belongs to
SEGMENT = "fxckpt.segment"  # int: index of the recompute segment, for interior nodes
DECISION = "fxckpt.decision"  # planning.plan.Decision of a saved node
ROLE = "fxckpt.role"  # one of the ROLE_* values below, on inserted nodes
ROLE_OFFLOAD = "offload"
ROLE_OFFLOAD_DONE = "offload_done"
ROLE_PREFETCH = "prefetch"
ROLE_WAIT = "wait"
ROLE_NOTE = "note"
SOURCE = "fxckpt.source"  # name of the saved node an inserted node acts for
STEP_PEAK = "fxckpt.step_peak"  # passes.inductor_peak.Tag, on each graph's output node

# Written by torch (read only).
NN_MODULE_STACK = "nn_module_stack"
FWD_NN_MODULE_STACK = "fwd_nn_module_stack"
RECOMPUTE = "recompute"
AC_GRAPH_ID = "ac_graph_id"
PARTITIONER_TAG = "partitioner_tag"
