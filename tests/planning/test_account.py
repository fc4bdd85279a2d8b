"""The step's account in plain numbers: each run's bytes around the others, and the targets it
gives a graph (fxckpt.planning.account)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxckpt.planning.account import HEADROOM, GraphFigures, PeakTarget, compose, targets


def test_one_graph_is_its_own_peak_over_the_start_level() -> None:
    g = GraphFigures(forward_peak=300, backward_peak=500, held=200, gradients=100)
    acct = compose(1000, [g])
    assert acct.peak == 1500 and acct.phase == "backward" and acct.run == 0
    assert acct.parts() == {"start_bytes": 1000, "gradients_bytes": 0, "activations_bytes": 500,
                            "total_bytes": 1500}


def test_each_run_counts_what_the_runs_before_it_hold_and_what_the_runs_after_it_made() -> None:
    layer = GraphFigures(forward_peak=50, backward_peak=80, held=40, gradients=10, inputs=8,
                         saved_inputs=8)
    acct = compose(100, [layer] * 4)
    # The first run's backward (the last to run): three runs' held and saved inputs before
    # it, the later three runs' gradients made, its own saved input and backward.
    # forward of run 3: 100 + 3 * 48 + 8 + 50 = 302; backward of run 3: 100 + 144 + 8 + 80 = 332;
    # backward of run 0: 100 + 0 + 8 + 30 + 80 = 218.
    assert acct.peak == 332 and (acct.run, acct.phase) == (3, "backward")
    assert compose(100, [layer]).peak == 100 + 8 + 80


def test_eager_gradients_count_from_the_backwards_start() -> None:
    g = GraphFigures(forward_peak=10, backward_peak=10, held=0, gradients=0)
    assert compose(0, [g], gradients=500).peak == 510
    assert compose(0, [g]).peak == 10


def test_a_graph_that_runs_once_gets_what_the_rest_leaves_it_in_each_phase() -> None:
    emb = GraphFigures(forward_peak=20, backward_peak=30, held=16, gradients=64)
    head = GraphFigures(forward_peak=40, backward_peak=60, held=32, gradients=8)
    t = targets(10_000, 1000, [emb], ["emb"], "head", own=head)
    assert t == PeakTarget(10_000 - HEADROOM - 1000 - 16, 10_000 - HEADROOM - 1000 - 16)
    # emb's backward runs after head's: head's gradient is made by then.
    t = targets(10_000, 1000, [emb, head], ["emb", "head"], "emb")
    assert t.backward == 10_000 - HEADROOM - 1000 - 8 and t.forward == 10_000 - HEADROOM - 1000


def test_a_graph_that_runs_n_times_must_keep_a_share_of_what_is_left() -> None:
    layer = GraphFigures(forward_peak=300, backward_peak=500, held=200)
    t = targets(HEADROOM + 1000 + 2000, 1000, [layer] * 4, ["L"] * 4, "L")
    assert t.held is not None
    # 4 runs: 4 * held + what its backward holds beside it (300) must fit in 2000.
    assert t.held == (2000 - 300) // 4
    # Keeping that, each phase may have what the last run leaves it: 2000 - 3 * held, the
    # forward too (its working set is smaller, so it gets more than held + 100).
    assert t.backward == t.forward == 2000 - 3 * t.held
    # ... and the account of four runs at that target fits.
    planned = GraphFigures(t.forward, t.backward, t.held)
    assert compose(1000, [planned] * 4).peak <= HEADROOM + 1000 + 2000 - HEADROOM


def test_a_plan_that_keeps_less_than_its_share_may_peak_higher() -> None:
    """The backward's peak of a layer need not shrink with what its forward keeps: a plan that
    keeps less than the target's point and peaks above it fits the step all the same, and the
    target says so."""
    layer = GraphFigures(forward_peak=300, backward_peak=500, held=200)
    budget = HEADROOM + 1000 + 2000
    t = targets(budget, 1000, [layer] * 4, ["L"] * 4, "L")
    assert t.held is not None
    # Keeping 100 less a run leaves the last run's backward 300 more: 3 * 100.
    less, peak = t.held - 100, t.backward + 300
    assert t.met_by(t.forward, peak, less)
    assert compose(1000, [GraphFigures(t.forward, peak, less)] * 4).peak <= budget - HEADROOM
    assert t.over_by(t.forward, peak + 1, less) == 1
    assert t.over_by(t.forward, t.backward, t.held + 1) == 3  # the last run finds 3 earlier ones


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500), st.integers(0, 300),
                       st.integers(0, 100), st.sampled_from("ab")), min_size=2, max_size=8),
    st.integers(0, 2000), st.integers(0, 5000),
    st.tuples(st.integers(0, 800), st.integers(0, 800), st.integers(0, 400)),
)
def test_a_target_judges_a_plan_as_the_step_account_does(runs, start, room, plan) -> None:
    """For a graph that runs several times, the target's verdict on any plan of it is the
    account's: its own runs fit exactly when the target is met (what it keeps within the room
    later graphs' runs leave it)."""
    figures = [GraphFigures(max(f, h), max(b, h), h, g) for f, b, h, g, _ in runs]
    keys = [k for *_, k in runs]
    budget = start + room + HEADROOM
    key = keys[0]
    if keys.count(key) < 2:
        return
    t = targets(budget, start, figures, keys, key)
    fw, bw, held = plan
    mine = GraphFigures(max(fw, held), max(bw, held), held, figures[0].gradients)
    fitted = [mine if k == key else f for f, k in zip(figures, keys, strict=True)]
    own_runs_fit = all(max(_forward_at(start, fitted, j), _backward_at(start, fitted, j))
                       <= budget - HEADROOM for j, k in enumerate(keys) if k == key)
    within_cap = t.cap is None or mine.held <= t.cap
    assert t.met_by(mine.forward_peak, mine.backward_peak, mine.held) == (own_runs_fit and within_cap)


def _forward_at(start: int, runs: list[GraphFigures], j: int) -> int:
    """What the device holds while run ``j``'s forward runs (compose's forward term)."""
    return start + sum(r.held + r.saved_inputs for r in runs[:j]) + runs[j].inputs + runs[j].forward_peak


def _backward_at(start: int, runs: list[GraphFigures], j: int) -> int:
    """What the device holds while run ``j``'s backward runs (compose's backward term)."""
    before = sum(r.held + r.saved_inputs for r in runs[:j])
    grads = sum(r.gradients for r in runs[j + 1:])
    return start + before + runs[j].saved_inputs + grads + runs[j].backward_peak


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500), st.integers(0, 300),
                       st.integers(0, 100), st.sampled_from("abc")), min_size=1, max_size=8),
    st.integers(0, 2000), st.integers(0, 5000),
)
def test_a_graph_that_meets_its_target_keeps_the_step_within_the_budget(runs, start, room) -> None:
    """A graph planned exactly to its target (what it keeps scaled down where it runs more
    than once), the others unchanged: none of its own runs puts the step over the budget (a
    peak over it falls in another graph's run, which that graph's target is for)."""
    figures = [GraphFigures(max(f, h), max(b, h), h, g) for f, b, h, g, _ in runs]
    keys = [k for *_, k in runs]
    budget = start + room + HEADROOM
    for key in set(keys):
        t = targets(budget, start, figures, keys, key)
        own = next(f for f, k in zip(figures, keys, strict=True) if k == key)
        if t.held is None:
            mine = GraphFigures(t.forward, t.backward, min(own.held, t.forward, t.backward),
                                own.gradients)
        else:
            if t.held < 0 or t.forward < own.forward_peak - own.held or t.backward < own.backward_peak - own.held:
                continue
            mine = GraphFigures(t.forward, t.backward, t.held, own.gradients)
        fitted = [mine if k == key else f for f, k in zip(figures, keys, strict=True)]
        if min(t.forward, t.backward) <= 1:
            continue  # no target at all: the step cannot fit whatever this graph does
        acct = compose(start, fitted)
        assert acct.peak <= budget - HEADROOM or keys[acct.run] != key, (key, t, acct)


@pytest.mark.parametrize("by", [0, 10, 10_000])
def test_a_lowered_target_never_goes_below_one_byte(by: int) -> None:
    t = PeakTarget(100, 200, 50).lowered(by)
    assert t.forward == max(1, 100 - by) and t.backward == max(1, 200 - by)
    assert t.held == max(0, 50 - by)
    assert t.over_by(100, 200, 50) == (0 if by == 0 else min(by, 200 - 1))


def _problem() -> object:
    from fxckpt.planning.memory import Candidates, Problem, Timeline

    # Two saved tensors of 100 bytes over a 3 + 3 position step; the first can be offloaded.
    tl = Timeline(step_ms=[1.0] * 6, num_forward=3, bandwidth_bytes_per_ms=1e9)
    c = Candidates(bytes=[100, 100], produced=[0, 1], last_fw_use=[0, 1], first_bw_use=[4, 3],
                   last_bw_use=[5, 4], recompute_ms=[float("inf")] * 2, can_offload=[True, False])
    return Problem(tl, c)


def test_in_the_step_counts_every_live_byte_and_holds_each_phase_to_its_limit() -> None:
    from fxckpt.planning.memory import simulate
    from fxckpt.planning.problem import in_the_step

    pb = _problem()
    # The partition's liveness: the kept candidates plus 50 bytes of other tensors throughout.
    kept = simulate(pb, ["keep", "keep"]).resident
    live = [k + 50 for k in kept]
    own, zero = in_the_step(pb, live[:3], live[3:], None)
    assert zero == 0 and simulate(own, ["keep", "keep"]).resident == live
    held, budget = in_the_step(pb, live[:3], live[3:], PeakTarget(260, 300))
    assert budget == 300
    # The forward's positions carry 40 bytes more: its limit is 260 against the budget's 300.
    res = simulate(held, ["keep", "keep"]).resident
    assert [r - v for r, v in zip(res, live, strict=True)] == [40, 40, 40, 0, 0, 0]
    # A target on what the forward keeps for its backward holds its last position to it.
    _, budget = in_the_step(pb, live[:3], live[3:], PeakTarget(400, 400, held=100))
    end, _ = in_the_step(pb, live[:3], live[3:], PeakTarget(400, 400, held=100))
    assert simulate(end, ["keep", "keep"]).resident[2] - live[2] == 400 - (100 + 50)


def test_within_reach_raises_the_budget_only_where_no_plan_meets_it() -> None:
    from fxckpt.planning.layouts import lowest, within_reach

    pb = _problem()
    low = lowest(pb, None)
    same, budget, raised = within_reach(pb, max(low), None)
    assert (same, budget, raised) == (pb, max(low), 0)
    raised_pb, budget, raised = within_reach(pb, max(low) - 30, None)
    assert raised == 30 and budget == max(low)
    # Where the lowest plan is under the asked budget, the position keeps the asked budget.
    from fxckpt.planning.memory import simulate

    c = raised_pb.candidates
    res = simulate(raised_pb, [c.lowest(i) for i in range(len(c))]).resident
    assert max(res) <= budget
