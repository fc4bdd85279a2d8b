"""Streamed weights in the plan: one row per weight in ``fxckpt.last_plans()``, in
``fxckpt inspect`` (offline, on meta tensors) as a table, JSON and HTML, for a model the user
hands over unmodified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli import run, validate
from test_weights import Blocks

import fxckpt
from fxckpt.report.json_doc import SCHEMA
from fxckpt.report.table import WEIGHT_COLUMNS

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "flux_stream.py")


# The step's budget, in bytes: room beside the all-streamed step (about 90 KiB here) to keep
# some of the weights' copies (130 KiB in all) on the device, not every one.
BUDGET = 200_000


def test_inspect_plans_streamed_weights_offline_and_leaves_the_model_alone() -> None:
    model = Blocks()
    names = [n for n, _ in model.named_parameters()]
    plans = fxckpt.inspect(model, torch.randn(8, 64, requires_grad=True),
                           stream_weights={"min_bytes": 0}, memory_budget=BUDGET)  # fmt: skip
    (plan,) = plans
    assert len(plan.weights) == 16
    assert {w.decision for w in plan.weights} == {"stream", "resident"}
    assert plan.weight_h2d_bytes == sum(w.step_h2d_bytes for w in plan.weights) > 0
    # The model is the caller's, untouched: planning streamed a meta copy.
    assert [n for n, _ in model.named_parameters()] == names
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_compiled_plan_and_the_offline_one_place_the_weights_alike() -> None:
    torch.manual_seed(0)
    model = Blocks()
    offline = fxckpt.inspect(Blocks(), torch.randn(8, 64, requires_grad=True),
                             stream_weights={"min_bytes": 0}, memory_budget=BUDGET)  # fmt: skip
    torch._dynamo.reset()
    fxckpt.reset_stats()
    fxckpt.stream_weights(model, min_bytes=0)
    compiled = torch.compile(model, backend="fxckpt", options={"compiler": "eager", "memory_budget": BUDGET})
    compiled(torch.randn(8, 64, requires_grad=True)).backward()
    (plan,) = fxckpt.last_plans()
    assert {w.decision for w in plan.weights} == {"stream", "resident"}
    assert [(w.parameter, w.decision) for w in plan.weights] == [(w.parameter, w.decision) for w in offline[0].weights]


@pytest.mark.skipif(not all(__import__("importlib").util.find_spec(m) for m in ("diffusers", "peft")),
                    reason="needs diffusers and peft")  # fmt: skip
@pytest.mark.heavy
def test_the_cli_shows_a_dit_with_lora_streaming_its_base(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = (f"{EXAMPLE}:small", "--stream-weights", "--frozen-only", "--budget", "2MiB", "-q")
    code, out, err = run(capsys, *args)
    assert code == 0, err
    header = next(line for line in out.splitlines() if "parameter" in line and "reason" in line)
    assert header.split() == [w for c in WEIGHT_COLUMNS for w in c.split()]
    assert "streamed weights" in out and "copied per step" in out
    code, out, err = run(capsys, *args, "--format", "json", "--html", str(tmp_path / "plan.html"))
    assert code == 0, err
    doc = json.loads(out)
    validate(doc, SCHEMA)
    (graph,) = doc["graphs"]  # one graph: the block loop with streamed weights does not break
    rows = graph["weights"]
    # The frozen base streams; the LoRA adapters do not (they train, and are small).
    assert rows and all("lora_" not in r["parameter"] for r in rows)
    assert graph["weight_h2d_bytes"] == sum(r["step_h2d_bytes"] for r in rows) > 0
    assert {r["decision"] for r in rows} <= {"stream", "resident"}
    page = (tmp_path / "plan.html").read_text()
    assert "streamed weights" in page and rows[0]["parameter"] in page


def test_frozen_only_without_streamed_weights_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, f"{EXAMPLE}:small", "--frozen-only")
    assert code == 2 and "--stream-weights" in err
