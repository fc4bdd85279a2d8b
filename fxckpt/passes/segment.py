"""Segment-stride tagging, with SimpleTuner's semantics, inside the joint graph."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.fx as fx

from fxckpt._torch_compat import CheckpointPolicy
from fxckpt.graph import meta
from fxckpt.graph.blocks import BlockFacts
from fxckpt.graph.costs import is_random, random_output

log = logging.getLogger(__name__)


def segment_of(block: int, stride: int, width: int) -> int | None:
    """The segment a block lies in, or None when it is outside every segment.

    Block *i* is in a segment when ``i % stride < width``; the blocks of one stride group
    that qualify form one segment, numbered ``i // stride``.
    """
    if stride <= 0 or width <= 0:
        return None
    return block // stride if block % stride < width else None


EXTRA_SEGMENT_BASE = 100_000  # ids of one-block segments the budget adds


@dataclass(frozen=True)
class SegmentReport:
    """What the segment pass did, for the plan's reasons and the log."""

    segments: dict[int, tuple[int, ...]]  # segment id -> its blocks
    tagged: int  # forward nodes tagged for recompute
    kept_user_tags: int  # nodes whose user checkpoint policy was left alone
    kept_random: int  # random ops left saved, so their masks are not redrawn


def tag_segments(
    joint: fx.GraphModule,
    blocks: BlockFacts,
    stride: int,
    width: int,
    *,
    extra_blocks: frozenset[int] = frozenset(),
) -> SegmentReport:
    """After this pass, every forward node inside a segment prefers recompute.

    Each segment's nodes share one ``ac_graph_id``, so torch's min-cut saves only the segment
    input and recomputes the interior (``cleanup_recompute_tags`` forces a save at each
    boundary between consecutive ids). Policies a user set with selective checkpointing win
    over the stride. Random ops stay saved: recomputing them needs RNG-state replay, which
    torch only offers on CUDA. ``extra_blocks`` become one-block segments of their own
    (the planner adds them when a budget needs more recompute).
    """
    segments: dict[int, set[int]] = {}
    tagged = kept_user = kept_random = 0
    if stride > 0 and not blocks.index_of:
        log.info("fxckpt: no repeated blocks found; segment_stride=%d has nothing to tag", stride)
    for node in joint.graph.nodes:
        block = blocks.index_of.get(node.name)
        if block is None:
            continue
        node.meta[meta.BLOCK] = block
        seg = segment_of(block, stride, width)
        if seg is None and block in extra_blocks:
            seg = EXTRA_SEGMENT_BASE + block
        if seg is None:
            continue
        segments.setdefault(seg, set()).add(block)
        if meta.RECOMPUTE in node.meta:
            kept_user += 1
            continue
        if is_random(node):
            # A multi-output random op cannot be saved itself; its getitems are saved.
            kept_random += 1
            continue
        if random_output(node):
            node.meta[meta.RECOMPUTE] = CheckpointPolicy.MUST_SAVE
            continue
        node.meta[meta.RECOMPUTE] = CheckpointPolicy.PREFER_RECOMPUTE
        # Offset the ids so they never collide with ids of a user's own checkpoint regions.
        node.meta[meta.AC_GRAPH_ID] = 1_000_000 + seg
        node.meta[meta.SEGMENT] = seg
        tagged += 1
    report = SegmentReport(
        segments={s: tuple(sorted(b)) for s, b in sorted(segments.items())},
        tagged=tagged,
        kept_user_tags=kept_user,
        kept_random=kept_random,
    )
    log.debug("fxckpt: segments %s (tagged %d nodes)", report.segments, tagged)
    return report


def tag_recompute(joint: fx.GraphModule, names: set[str] | frozenset[str]) -> None:
    """After this pass, min-cut must rebuild the named forward nodes in the backward."""
    for node in joint.graph.nodes:
        if node.name in names:
            node.meta[meta.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE


def tag_save(joint: fx.GraphModule, names: set[str] | frozenset[str]) -> None:
    """After this pass, min-cut saves the named forward nodes, though a segment that is
    recomputed holds them: the rest of the segment is rebuilt around them."""
    for node in joint.graph.nodes:
        if node.name in names:
            node.meta[meta.RECOMPUTE] = CheckpointPolicy.MUST_SAVE
            node.meta.pop(meta.AC_GRAPH_ID, None)
            node.meta.pop(meta.SEGMENT, None)
