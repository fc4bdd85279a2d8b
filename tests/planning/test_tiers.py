"""The tier assignment on plain numbers: host, disk, recompute or keep, and the read-ahead."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxckpt.planning.tiers import DiskRates, Item, TierChoice, assign, read_ahead, staging_bytes

KiB = 1024


def item(n: int, *, fw: float = 10.0, bw: float = 10.0, r: float = math.inf) -> Item:
    return Item(nbytes=n, host_bytes=n, staged_bytes=n + 4 * KiB, write_window_ms=fw,
                read_window_ms=bw, recompute_ms=r)  # fmt: skip


FAST = DiskRates(1e9, 1e9)  # bytes per ms: every copy hides


def kinds(tiers: list) -> list[str]:
    return [t.kind for t in tiers]


def test_no_budget_or_enough_room_keeps_every_offload_in_host_memory() -> None:
    items = [item(8 * KiB) for _ in range(4)]
    assert kinds(assign(items, None, FAST, allow_recompute=True)) == ["host"] * 4
    assert kinds(assign(items, 32 * KiB, None, allow_recompute=True)) == ["host"] * 4
    assert all(t.reason == "" for t in assign(items, 32 * KiB, FAST, allow_recompute=True))


def test_with_a_disk_the_earliest_produced_go_to_disk_until_the_rest_and_staging_fit() -> None:
    items = [item(8 * KiB) for _ in range(8)]
    tiers = assign(items, 32 * KiB, FAST, allow_recompute=True)
    # 32 KiB hold the runtime's two 12 KiB staging buffers and one host tensor: seven go to disk.
    assert kinds(tiers) == ["disk"] * 7 + ["host"]
    assert all("offload → disk" in t.reason and "host_budget 32.0 KiB" in t.reason
               for t in tiers[:6])  # fmt: skip
    assert 8 * KiB + staging_bytes(items, tiers, 32 * KiB) <= 32 * KiB


def test_without_a_disk_recomputable_ones_go_first_then_the_latest_produced_are_kept() -> None:
    items = [item(8 * KiB, r=1.0), item(8 * KiB), item(8 * KiB), item(8 * KiB)]
    tiers = assign(items, 16 * KiB, None, allow_recompute=True)
    assert kinds(tiers) == ["recompute", "host", "host", "keep"]
    assert "there is no disk tier (offload_dir)" in tiers[0].reason
    assert tiers[3].reason.startswith("keep: host_budget 16.0 KiB holds 16.0 KiB")
    # The planner's last round cannot recompute: it keeps, latest produced first.
    assert kinds(assign(items, 16 * KiB, None, allow_recompute=False)) == ["host", "host", "keep", "keep"]


def test_recompute_wins_over_a_disk_that_cannot_hide_the_copy() -> None:
    slow = DiskRates(100.0, 100.0)  # 8 KiB take 82 ms each way, against 10 ms windows
    items = [item(8 * KiB, r=0.5), item(8 * KiB, r=500.0), item(8 * KiB), item(8 * KiB)]
    tiers = assign(items, 20 * KiB, slow, allow_recompute=True)
    assert kinds(tiers) == ["recompute", "disk", "disk", "host"]
    assert "costs less than the disk time it cannot hide" in tiers[0].reason
    assert "ms exposed" in tiers[1].reason


def test_a_tensor_whose_staging_alone_exceeds_the_budget_never_goes_to_disk() -> None:
    items = [item(64 * KiB), item(4 * KiB)]
    tiers = assign(items, 16 * KiB, FAST, allow_recompute=True)
    assert kinds(tiers) == ["keep", "host"]
    assert "its staging buffer (68.0 KiB) alone exceeds it" in tiers[0].reason


def test_read_ahead_issues_a_prefetch_early_by_the_read_time() -> None:
    S = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # 8 nodes of 1 ms, forward = first 3
    assert read_ahead(S, 3, 7, 0.0) == 7
    assert read_ahead(S, 3, 7, 2.0) == 5  # node 5 starts 2 ms before node 7
    assert read_ahead(S, 3, 7, 2.5) == 4  # running when the read must start
    assert read_ahead(S, 3, 7, 100.0) == 3  # never before the backward starts


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64 * KiB), min_size=1, max_size=12),
    budget=st.integers(0, 256 * KiB),
    disk=st.booleans(),
    recomputable=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_the_host_tier_and_its_staging_always_fit_the_budget(
    sizes: list[int], budget: int, disk: bool, recomputable: list[bool]
) -> None:
    items = [item(n, r=1.0 if recomputable[i] else math.inf) for i, n in enumerate(sizes)]
    tiers = assign(items, budget, FAST if disk else None, allow_recompute=True)
    host = sum(it.host_bytes for it, t in zip(items, tiers, strict=True) if t.kind == "host")
    assert host + staging_bytes(items, tiers, budget) <= budget
    for it, t in zip(items, tiers, strict=True):
        assert t.kind != "disk" or disk
        assert t.kind != "recompute" or math.isfinite(it.recompute_ms)
        assert t.kind == "host" or t.reason  # every move says why


@pytest.mark.parametrize(("budget", "slots", "staged"), [
    (40 * KiB, 2, 24 * KiB), (40 * KiB, 1, 12 * KiB), (30 * KiB, 2, 24 * KiB),
    (20 * KiB, 2, 12 * KiB), (None, 2, 24 * KiB),
])  # fmt: skip
def test_staging_takes_the_slots_the_budget_holds_or_one(budget: int | None, slots: int,
                                                        staged: int) -> None:
    # As the runtime keeps them: its staging slabs grow to ``slots`` buffers wherever the
    # budget holds that many, whatever the host tier then needs.
    items = [item(8 * KiB), item(6 * KiB), item(8 * KiB)]
    tiers = [TierChoice("disk"), TierChoice("disk"), TierChoice("host")]
    assert staging_bytes(items, tiers, budget, slots) == staged


def test_a_pinned_pool_asks_the_slab_layout_not_the_sum() -> None:
    from fxckpt.runtime.slabs import MIN_SLAB_BYTES, carving_fits

    MiB = 2**20
    # 64 MiB + 64 MiB of slabs under a 130 MiB cap: three 40 MiB buffers sum to 120 MiB, but
    # the first slab's 24 MiB tail and the second's cannot take a third.
    assert MIN_SLAB_BYTES == 64 * MiB
    assert not carving_fits([40 * MiB] * 3, 130 * MiB)
    assert carving_fits([40 * MiB] * 3 + [20 * MiB] * 2, 160 * MiB + 2 * MiB) is False
    assert carving_fits([24 * MiB, 40 * MiB, 24 * MiB, 40 * MiB], 128 * MiB)
    items = [item(40 * MiB) for _ in range(4)]
    by_sum = assign(items, 130 * MiB, None, allow_recompute=False)
    by_slabs = assign(items, 130 * MiB, None, allow_recompute=False,
                      fits=lambda classes, staging: carving_fits(classes, 130 * MiB))
    assert kinds(by_sum).count("host") == 3 and kinds(by_slabs).count("host") == 2
