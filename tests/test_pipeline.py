"""The partitioner's stages run in the order STAGES lists, and listeners hear each one."""

from __future__ import annotations

import torch
from models import GPT, gpt_inputs

import fxckpt
from fxckpt.passes.partition import STAGES
from fxckpt.passes.pipeline import Stage, StageDone, listening, run


def _heard(**options: object) -> list[str]:
    torch._dynamo.reset()
    heard: list[StageDone] = []
    with listening(heard.append):
        model = torch.compile(GPT(n_layers=2), backend=fxckpt.backend(compiler="eager", **options))
        model(*gpt_inputs()).backward()
    assert heard and all(d.seconds >= 0 for d in heard)
    return [d.name for d in heard]


def test_the_stages_report_in_the_order_they_are_listed() -> None:
    names = _heard()
    listed = [s.name for s in STAGES if s.report]
    reported = [n for n in names if n in listed]
    assert reported == [n for n in listed if n in reported]  # STAGES' order
    assert {"cse", "blocks", "baseline min-cut", "min-cut", "offload", "note"} <= set(reported)
    # Under the eager compiler the Inductor-only stages neither run nor report; without a
    # stride nothing is segmented.
    assert not {"pin positions", "saved layouts", "segment"} & set(names)


def test_the_plan_stage_reports_its_rounds_between_its_neighbours() -> None:
    names = _heard(memory_budget=0.5)
    rounds = [k for k, n in enumerate(names) if n.startswith("plan round")]
    assert rounds and names.index("assumptions") < rounds[0] and rounds[-1] < names.index("offload")


def test_a_stride_runs_the_segment_stage() -> None:
    names = _heard(segment_stride=1)
    assert names.index("baseline min-cut") < names.index("segment") < names.index("min-cut")


def test_listening_ends_with_its_block_and_skipped_stages_are_not_heard() -> None:
    ran: list[str] = []
    stages = (Stage("a", lambda c: ran.append("a")), Stage("b", lambda c: ran.append("b"), when=lambda c: False),
              Stage("c", lambda c: ran.append("c"), report=False))  # fmt: skip
    heard: list[str] = []
    with listening(lambda d: heard.append(d.name)):
        run(None, "g", stages)
    run(None, "g", stages)
    assert ran == ["a", "c", "a", "c"] and heard == ["a"]


def test_the_context_carries_the_plan_to_the_end() -> None:
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.compile(GPT(n_layers=2), backend=fxckpt.backend(compiler="eager"))(*gpt_inputs()).backward()
    (plan,) = fxckpt.last_plans()
    assert plan.predicted_step_peak_bytes and plan.baseline_saved_bytes
