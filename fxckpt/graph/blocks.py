"""Repeated blocks of a joint graph: which forward node belongs to which block.

Blocks are numbered by the integer in their module path (``layers.7`` is block 7), not by
their position in one graph, so a stride means the same blocks on both sides of a graph break.
Where a forward holds several stacks (an encoder's and a decoder's blocks, a ResNet's
stages), each stack's blocks follow the previous stack's, in execution order.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch.fx as fx

from fxckpt.errors import OptionsError
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
# What a user's blocks= match ends in: an item ``prefix.i``, or a top-level ``i``.
_ENDS_IN_INDEX = re.compile(r"^(?:(?P<prefix>.*)\.)?(?P<index>\d+)$")


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
class Stack:
    """One repeated stack: the container ``prefix`` whose items ``prefix.i`` are blocks, and
    the offset its items are numbered from (block ``offset + i``)."""

    prefix: str
    offset: int
    indices: tuple[int, ...]

    @property
    def first(self) -> int:
        return self.offset + self.indices[0]

    @property
    def last(self) -> int:
        return self.offset + self.indices[-1]


@dataclass(frozen=True)
class BlockFacts:
    """Which forward node lies in which repeated block."""

    source: str  # "auto", "regex", "given" (the block_index option) or "none"
    index_of: dict[str, int] = field(default_factory=dict)  # node name -> block index
    stacks: tuple[Stack, ...] = ()  # in execution order; empty for "given" and group indices
    pattern: str | None = None  # the user's regex, if any

    @property
    def prefix(self) -> str | None:
        """The container of the first stack, e.g. ``"model.layers"``."""
        return self.stacks[0].prefix if self.stacks else None

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.index_of.values())))

    def notes(self, stride: int) -> list[str]:
        """What a plan says of the blocks (``stride``: the segment stride it was made with)."""
        if stride > 0 and not self.index_of:
            return ["no repeated blocks found: planned without segments"]
        if self.source == "given":
            return [f"the graph is block {self.blocks[0]} (block_index)"] if self.index_of else []
        return [self.describe()] if self.index_of else []

    def describe(self) -> str:
        """The stacks found, for the plan's notes."""
        if not self.stacks:
            return f"blocks {self.blocks[0]}..{self.blocks[-1]} matching {self.pattern!r}"
        if len(self.stacks) == 1:
            return f"blocks {self.blocks[0]}..{self.blocks[-1]} under {self.prefix!r}"
        parts = ", ".join(f"{s.prefix} {s.first}..{s.last}" for s in self.stacks)
        return f"blocks {self.blocks[0]}..{self.blocks[-1]} in {len(self.stacks)} stacks: {parts}"

    def block_of(self, node: fx.Node) -> int | None:
        """The block of any node, also one the partitioner created (found by its module)."""
        if node.name in self.index_of:
            return self.index_of[node.name]
        if self.source == "none":
            return None
        if self.source == "given":
            return self.blocks[0] if self.index_of else None
        compiled = re.compile(self.pattern) if self.pattern is not None else None
        offsets = {s.prefix: s.offset for s in self.stacks}
        for path in module_stack(node):
            member = _member_of_path(path, compiled, offsets)
            if member is not None:
                prefix, index = member
                return offsets.get(prefix, 0) + index
        return None


def _member_of_path(
    path: str, pattern: re.Pattern[str] | None, prefixes: dict[str, int] | set[str]
) -> tuple[str, int] | None:
    """The (stack, index) of the block ``path`` is, or None: with ``pattern``, a match whose
    first group holds an integer is block ``int(group)`` of one stack named ``""``; any other
    match is the item ``prefix.i`` that the match ends in. Without a pattern, ``path`` is an
    item of one of ``prefixes``."""
    if pattern is not None:
        m = pattern.search(path)
        if m is None:
            return None
        if m.groups() and m.group(1) is not None and (digits := re.findall(r"\d+", m.group(1))):
            return "", int(digits[-1])
        item = _ENDS_IN_INDEX.search(path[: m.end()])
        if item is None:
            raise OptionsError(
                "blocks",
                pattern.pattern,
                "a regex whose match ends at a block's index, such as r'layers\\.\\d+$' or "
                "r'(?:encoder|decoder)\\.block\\.\\d+$', or whose first group holds the index",
                f"it matches module {path!r} in {m.group(0)!r}, which ends at no index to "
                "number the block by",
            )
        return item.group("prefix") or "", int(item.group("index"))
    m = _TRAILING_INDEX.match(path)
    if m is None or m.group("prefix") not in prefixes:
        return None
    return m.group("prefix"), int(m.group("index"))


def _module_items(node: fx.Node) -> list[tuple[str, str]]:
    """(normalised path, module class) of each module around ``node``, outermost first."""
    stack = node.meta.get(meta.NN_MODULE_STACK) or node.meta.get(meta.FWD_NN_MODULE_STACK) or {}
    items: list[tuple[str, str]] = []
    for value in stack.values():
        raw, cls = (value[0], value[1]) if isinstance(value, tuple) else (str(value), "")
        items.append((module_path(raw), getattr(cls, "__qualname__", str(cls))))
    return items


def _auto_stacks(nodes: list[fx.Node]) -> list[str]:
    """Every outermost container of repeated integer-indexed items (``layers.0``,
    ``layers.1``, ...) in the forward.

    A container counts when it has two items or more and they are alike: all of one module
    class, or all modules made of modules (a UNet's down blocks differ in class, a ResNet's
    stages hold blocks). A pipeline of single layers of different kinds (``Sequential(conv,
    norm, act)``) is not a stack, unless nothing else is found (then the container with the
    most nodes is taken, as a single stack). One nested inside an item of another stack is
    part of that block.
    """
    members: dict[str, set[int]] = defaultdict(set)
    classes: dict[str, set[str]] = defaultdict(set)
    weight: Counter[str] = Counter()
    parents: set[str] = set()  # every module path that has modules inside it
    for node in nodes:
        seen: set[str] = set()
        for path, cls in _module_items(node):
            parts = path.split(".")
            parents.update(".".join(parts[:k]) for k in range(1, len(parts)))
            m = _TRAILING_INDEX.match(path)
            if m is None or not m.group("prefix"):
                continue
            prefix = m.group("prefix")
            members[prefix].add(int(m.group("index")))
            classes[prefix].add(cls)
            if prefix not in seen:
                seen.add(prefix)
                weight[prefix] += 1
    repeated = [p for p, idx in members.items() if len(idx) >= 2]
    if not repeated:
        return []

    def composite(prefix: str) -> bool:
        return all(f"{prefix}.{i}" in parents for i in members[prefix])

    alike = [p for p in repeated if len(classes[p]) == 1 or composite(p)]
    if not alike:
        # Most nodes wins; on a tie the outermost (shortest) container, then by name.
        return [min(repeated, key=lambda p: (-weight[p], len(p), p))]
    items = {f"{p}.{i}" for p in alike for i in members[p]}

    def nested(prefix: str) -> bool:
        parts = prefix.split(".")
        return any(".".join(parts[:k]) in items for k in range(1, len(parts) + 1))

    return [p for p in alike if not nested(p)]


def find_blocks(
    joint: fx.GraphModule, pattern: str | None = None, *, block_index: int | None = None
) -> BlockFacts:
    """Number the repeated blocks of ``joint``'s forward.

    Blocks are found in stacks: the items ``prefix.i`` of a container. Without ``pattern``,
    every outermost stack of alike items is found (an encoder's and a decoder's, a ResNet's
    stages, a UNet's down, mid and up blocks). With ``pattern``, a module path whose
    ``re.search`` matches is a block: the item its match ends in (``encoder.block.3``), or,
    where the pattern's first group holds an integer, block ``int(group)``. Stacks are
    numbered one after another in execution order: block ``offset + i``, the offset being one
    past the previous stack's last block; a single stack keeps its own indices, so a stride
    means the same blocks on both sides of a graph break. With ``block_index``, the whole
    forward is that one block (a block compiled on its own).
    """
    fw = forward_nodes(joint.graph)
    if block_index is not None:
        whole = {n.name: block_index for n in fw}
        return BlockFacts(source="given", index_of=whole)
    compiled = re.compile(pattern) if pattern is not None else None
    prefixes = set() if compiled is not None else set(_auto_stacks(fw))
    if compiled is None and not prefixes:
        return BlockFacts(source="none")
    member_of: dict[str, tuple[str, int]] = {}
    first_seen: dict[str, int] = {}
    for position, node in enumerate(fw):
        for path in module_stack(node):  # the outermost matching module wins
            member = _member_of_path(path, compiled, prefixes)
            if member is not None:
                member_of[node.name] = member
                first_seen.setdefault(member[0], position)
                break
    if not member_of:
        return BlockFacts(source="none", pattern=pattern)
    indices: dict[str, set[int]] = defaultdict(set)
    for prefix, index in member_of.values():
        indices[prefix].add(index)
    stacks: list[Stack] = []
    offset = 0
    for prefix in sorted(indices, key=first_seen.__getitem__):
        stacks.append(Stack(prefix, offset, tuple(sorted(indices[prefix]))))
        offset += max(indices[prefix]) + 1
    offsets = {s.prefix: s.offset for s in stacks}
    index_of = {name: offsets[prefix] + i for name, (prefix, i) in member_of.items()}
    named = tuple(s for s in stacks if s.prefix)
    source = "regex" if compiled is not None else "auto"
    return BlockFacts(source=source, index_of=index_of, stacks=named, pattern=pattern)
