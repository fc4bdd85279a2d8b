"""Will the step fit on a card? ``fxckpt inspect --device-memory ... --optimizer ...``.

The offline answer counts the parameters, their gradients, the optimizer's state, the
activations at the peak and the batch; a card it says the step fits is checked by training the
same model for real on the CPU at that capacity (``fxckpt.emulate_device_memory``) with AdamW,
and measuring the step with the allocator's meter, which never reads a plan.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from fixtures.tiny_gpt import gpt
from test_cli import GPT, run, validate

import fxckpt
from fxckpt import sizing
from fxckpt.errors import OptionsError
from fxckpt.options import auto_budget
from fxckpt.report.json_doc import SCHEMA


def _param_bytes(trainable: bool = False) -> int:
    model = gpt()[0]
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p.requires_grad or not trainable) + sum(
        b.numel() * b.element_size() for b in model.buffers()) * (not trainable)  # fmt: skip


def _step_peak(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run(capsys, GPT, "--format", "json", "-q", *argv)
    assert code == 0, err
    doc = json.loads(out)
    validate(doc, SCHEMA)
    return doc


def test_the_step_peak_counts_the_optimizer_and_says_whether_it_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = _step_peak(capsys, "--device-memory", "1GiB")["step_peak"]
    doc = _step_peak(capsys, "--device-memory", "1GiB", "--optimizer", "adamw")
    peak = doc["step_peak"]
    assert doc["options"]["memory_budget"] == auto_budget(2**30)  # the card's "auto"
    assert peak["device_memory_bytes"] == 2**30 and peak["fits"] is True
    assert peak["parameters_bytes"] == _param_bytes()
    assert peak["optimizer_bytes"] == 2 * _param_bytes(trainable=True)  # AdamW's two moments
    assert peak["total_bytes"] == max(g["step"]["total_bytes"] for g in doc["graphs"])
    assert peak["total_bytes"] == plain["total_bytes"] + peak["optimizer_bytes"]
    assert plain["optimizer_bytes"] == 0 and plain["optimizer"] == "none"
    parts = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
             "weights_bytes", "other_bytes")  # fmt: skip
    assert sum(peak[k] for k in parts) == peak["total_bytes"]
    sgd = _step_peak(capsys, "--device-memory", "1GiB", "--optimizer", "sgd")["step_peak"]
    assert sgd["optimizer_bytes"] == _param_bytes(trainable=True)  # one momentum buffer


def test_a_card_too_small_is_named_in_the_table_and_the_html(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    page = tmp_path / "plan.html"
    code, out, err = run(capsys, GPT, "--device-memory", "1MiB", "--optimizer", "adamw", "-q",
                         "--html", str(page))  # fmt: skip
    assert code == 0, err
    line = next(line for line in out.splitlines() if "DOES NOT FIT" in line)
    assert "does not fit on 1.0 MiB, by" in line
    assert "optimizer state" in out and "(adamw)" in out
    assert '<tr class="bad"><td>DOES NOT FIT</td><td>does not fit on 1.0 MiB, by' in page.read_text()


def test_the_sweep_gives_each_budget_s_step_peak_on_the_card(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("--device-memory", "6MiB", "--optimizer", "adamw", "--sweep", "auto,1.0", "-q")
    code, out, err = run(capsys, GPT, *argv, "--format", "json")
    assert code == 0, err
    auto, full = (row["step_peak"] for row in json.loads(out)["sweep"])
    assert auto["fits"] is True and full["fits"] is False  # plain's step peak is over 6 MiB
    assert auto["total_bytes"] < full["total_bytes"]
    code, out, err = run(capsys, GPT, *argv)
    assert code == 0, err
    assert "step peak" in out and "on the card" in out
    short = (full["total_bytes"] - 6 * 2**20) / 2**20
    assert re.search(rf"^\s*1\.0\s.*no, by {short:.1f} MiB\s*$", out, re.M), out
    assert re.search(r"^\s*auto\s.*\syes\s*$", out, re.M), out


def test_named_cards_and_bad_sizes() -> None:
    assert sizing.device_memory("H200") == 139 * 2**30
    assert sizing.device_memory("h100-80gb") == 79 * 2**30
    assert sizing.device_memory("24GiB") == 24 * 2**30
    with pytest.raises(OptionsError, match="--device-memory.*h100-80gb"):
        sizing.device_memory("80 apples")
    with pytest.raises(OptionsError, match="--device-memory"):
        sizing.device_memory("0")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--device-memory", "80 apples"], "--device-memory"),
    (["--device-memory", "h200", "--budget", "none"], "--device-memory"),
    (["--optimizer", "adam"], "--optimizer"),
])  # fmt: skip
def test_bad_card_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run(capsys, GPT, *argv, "-q")
    assert code == 2 and out == "", err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_card_the_step_is_said_to_fit_holds_it_when_trained(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The card: 0.85 of what the step holds with nothing planned away (AdamW's state counted),
    # so the budget binds. Offline the step is said to fit; trained for real with AdamW at that
    # capacity, the third step's measured absolute peak is within it.
    roomy = _step_peak(capsys, "--device-memory", "1GiB", "--optimizer", "adamw",
                       "--budget", "1.0")["step_peak"]  # fmt: skip
    card = int(0.85 * roomy["total_bytes"])
    peak = _step_peak(capsys, "--device-memory", str(card), "--optimizer", "adamw")["step_peak"]
    assert peak["fits"] is True, peak

    model, inputs, loss_fn = gpt()
    torch.manual_seed(0)
    model = model.to_empty(device="cpu") if any(p.is_meta for p in model.parameters()) else model
    opt = fxckpt.watch(torch.optim.AdamW(model.parameters()))
    with fxckpt.emulate_device_memory(card):
        compiled = torch.compile(model, backend=fxckpt.backend(memory_budget="auto",
                                                               compiler="eager"))  # fmt: skip

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(compiled(*inputs)).backward()
            opt.step()

        for _ in range(2):
            step()
        opt.zero_grad(set_to_none=True)
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        got = fxckpt.measure(lambda: loss_fn(compiled(*inputs)).backward(),
                             holding=(model, inputs, state))  # fmt: skip
    assert got.absolute_peak_bytes <= card, (got.absolute_peak_bytes, card, peak)
