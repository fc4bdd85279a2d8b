"""Repeated blocks of a joint graph: which forward node belongs to which block.

Blocks are numbered by the integer in their module path (``layers.7`` is block 7), not by
their position in one graph, so a stride means the same blocks on both sides of a graph break.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch.fx as fx

from fxckpt.graph import meta

log = logging.getLogger(__name__)

# The root a dynamo path starts from: L['self'], L['mod'], or L['args'][0] for a model
# passed positionally, with any ._modules['x'] / [i] steps written in either form.
_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\](?:\[\d+\]|\['[^']*'\])*")
# A module reached through ``__dict__`` (dynamo writes ``.__dict__['_modules']['x']`` for the
# children of a module held by a wrapper, e.g. a diffusers model inside a loss module).
_MODULES_ITEM = re.compile(r"\.(?:__dict__\['_modules'\]|_modules)\['([^']+)'\]")
_INDEX_ITEM = re.compile(r"\[(\d+)\]")
# An item of a ModuleList / Sequential: "layers.3". The dot is required: an attribute named
# like "fc1" is not the second item of a container "fc".
_TRAILING_INDEX = re.compile(r"^(?P<prefix>.*)\.(?P<index>\d+)$")


def module_path(raw: str) -> str:
    """Normalise a dynamo module path (``L['self'].layers[0].ln``) to ``layers.0.ln``."""
    path = _DYNAMO_ROOT.sub("", raw)
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _INDEX_ITEM.sub(r".\1", path)
    return path.lstrip(".")


def module_stack(node: fx.Node) -> list[str]:
    """The normalised module paths of a node, outermost first."""
    stack = node.meta.get(meta.NN_MODULE_STACK) or node.meta.get(meta.FWD_NN_MODULE_STACK) or {}
    paths: list[str] = []
    for value in stack.values():
        raw = value[0] if isinstance(value, tuple) else str(value)
        paths.append(module_path(raw))
    return paths


def node_module(node: fx.Node) -> str:
    """The innermost module path of a node, or "" outside every module."""
    stack = module_stack(node)
    return stack[-1] if stack else ""


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on a tangent, i.e. belong to the backward."""
    bw: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if str(node.target).startswith("tangents") or node.meta.get(
                meta.PARTITIONER_TAG
            ) == "is_backward":
                bw.add(node)
        elif node.op == "call_function" and (
            node.meta.get(meta.PARTITIONER_TAG) == "is_backward"
            or any(inp in bw for inp in node.all_input_nodes)
        ):
            bw.add(node)
    return bw


def forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Call nodes of a joint graph that belong to the forward, in graph order."""
    bw = backward_nodes(graph)
    return [n for n in graph.nodes if n.op == "call_function" and n not in bw]


@dataclass(frozen=True)
class BlockFacts:
    """Which forward node lies in which repeated block."""

    prefix: str | None  # module path of the block container, e.g. "model.layers"
    source: str  # "auto", "regex", "given" (the block_index option) or "none"
    index_of: dict[str, int] = field(default_factory=dict)  # node name -> block index

    pattern: str | None = None  # the user's regex, if any

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.index_of.values())))

    def block_of(self, node: fx.Node) -> int | None:
        """The block of any node, also one the partitioner created (found by its module)."""
        if node.name in self.index_of:
            return self.index_of[node.name]
        if self.source == "none":
            return None
        if self.source == "given":
            return self.blocks[0] if self.index_of else None
        compiled = re.compile(self.pattern) if self.pattern is not None else None
        for path in module_stack(node):
            block = _block_of_path(path, compiled, self.prefix)
            if block is not None:
                return block
        return None


def _block_of_path(path: str, pattern: re.Pattern[str] | None, prefix: str | None) -> int | None:
    if pattern is not None:
        m = pattern.search(path)
        if m is None:
            return None
        text = m.group(1) if m.groups() else m.group(0)
        digits = re.findall(r"\d+", text)
        return int(digits[-1]) if digits else None
    m = _TRAILING_INDEX.match(path)
    if m is None or m.group("prefix") != prefix:
        return None
    return int(m.group("index"))


def _auto_prefix(nodes: list[fx.Node]) -> str | None:
    """The module container with the most repeated children, counted in forward nodes."""
    members: dict[str, set[int]] = defaultdict(set)
    weight: Counter[str] = Counter()
    for node in nodes:
        seen: set[str] = set()
        for path in module_stack(node):
            m = _TRAILING_INDEX.match(path)
            if m is None or "." not in path and not m.group("prefix"):
                continue
            prefix = m.group("prefix")
            if prefix in seen:
                continue
            seen.add(prefix)
            members[prefix].add(int(m.group("index")))
            weight[prefix] += 1
    repeated = [p for p, idx in members.items() if len(idx) >= 2]
    if not repeated:
        return None
    # Most nodes wins; on a tie the outermost (shortest) container, then by name.
    return min(repeated, key=lambda p: (-weight[p], len(p), p))


def find_blocks(
    joint: fx.GraphModule, pattern: str | None = None, *, block_index: int | None = None
) -> BlockFacts:
    """Number the repeated blocks of ``joint``'s forward.

    With ``pattern``, a module path whose ``re.search`` matches is a block; the index is the
    last integer of the first group (or of the whole match). Without it, the container with
    the most repeated integer-indexed children (``layers.0``, ``layers.1``, ...) is chosen.
    With ``block_index``, the whole forward is that one block (a block compiled on its own).
    """
    fw = forward_nodes(joint.graph)
    if block_index is not None:
        whole = {n.name: block_index for n in fw}
        return BlockFacts(prefix=None, source="given", index_of=whole)
    compiled = re.compile(pattern) if pattern is not None else None
    prefix = None if compiled is not None else _auto_prefix(fw)
    if compiled is None and prefix is None:
        return BlockFacts(prefix=None, source="none")
    index_of: dict[str, int] = {}
    for node in fw:
        for path in module_stack(node):  # the outermost matching module wins
            block = _block_of_path(path, compiled, prefix)
            if block is not None:
                index_of[node.name] = block
                break
    source = "regex" if compiled is not None else "auto"
    if not index_of:
        return BlockFacts(prefix=prefix, source="none")
    return BlockFacts(prefix=prefix, source=source, index_of=index_of, pattern=pattern)
