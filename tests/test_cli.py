"""``fxckpt inspect``: tables, the JSON document, the HTML report, sweeps and exit codes."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fxckpt.cli import main
from fxckpt.report.json_doc import SCHEMA
from fxckpt.report.table import COLUMNS, SWEEP_COLUMNS

HERE = Path(__file__).parent
GPT = str(HERE / "fixtures" / "tiny_gpt.py") + ":gpt"
QWEN3 = str(HERE / "fixtures" / "qwen3_tiny")
QWEN3_8B = str(HERE / "fixtures" / "qwen3_8b")
WIDE_72B = str(HERE / "fixtures" / "wide_72b")  # 72B params in 18 wide layers: quick to trace


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    got = capsys.readouterr()
    return code, got.out, got.err


# A small JSON Schema checker (type, const, enum, minimum, required, properties, items): enough
# for SCHEMA, and no dependency on the jsonschema package.
_TYPES: dict[str, Any] = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
    "integer": int, "number": (int, float),
}  # fmt: skip


def validate(doc: Any, schema: dict[str, Any], path: str = "$") -> None:
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(
            isinstance(doc, _TYPES[k]) and not (k in ("integer", "number") and isinstance(doc, bool))
            for k in kinds
        )
        assert ok, f"{path}: {doc!r} is not of type {kinds}"
    if "const" in schema:
        assert doc == schema["const"], f"{path}: {doc!r} != {schema['const']!r}"
    if "enum" in schema:
        assert doc in schema["enum"], f"{path}: {doc!r} not in {schema['enum']}"
    if "minimum" in schema and isinstance(doc, (int, float)):
        assert doc >= schema["minimum"], f"{path}: {doc} < {schema['minimum']}"
    if isinstance(doc, dict):
        for key in schema.get("required", []):
            assert key in doc, f"{path}: missing {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in doc:
                validate(doc[key], sub, f"{path}.{key}")
    if isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            validate(item, schema["items"], f"{path}[{i}]")


def test_the_schema_checker_rejects_bad_documents() -> None:
    with pytest.raises(AssertionError, match="missing 'totals'"):
        validate({"version": 1, "fxckpt_version": "x", "target": "", "options": {},
                  "graphs": []}, SCHEMA)  # fmt: skip
    row = SCHEMA["properties"]["graphs"]["items"]["properties"]["activations"]["items"]
    with pytest.raises(AssertionError, match="not in"):
        validate({"decision": "drop"}, row["properties"]["decision"])
    with pytest.raises(AssertionError, match="not of type"):
        validate({"bytes": 1.5}, {"properties": {"bytes": row["properties"]["bytes"]}})


def test_table_for_a_gpt_factory(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, GPT, "--stride", "2")
    assert code == 0, err
    header = next(line for line in out.splitlines() if "module" in line and "reason" in line)
    assert re.findall(r"[a-z]+", header) == list(COLUMNS)
    for label in ("baseline saved", "resident peak", "offloaded to host", "offloaded to disk",
                  "recomputed", "est. added step time", "device / host / disk"):  # fmt: skip
        assert label in out
    assert "interior of segment" in out and "layers.0" in out
    assert "done in" in err  # progress lines on stderr, not in the table


def test_module_factory_form_and_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "fixtures.tiny_gpt:gpt_logits", "-q")
    assert code == 0, err
    assert err == "" and "embedding" in out


def test_json_for_a_tiny_qwen3_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--hf-config", QWEN3, "--seq", "64", "--batch", "2",
                         "--budget", "0.5", "--stride", "2", "--format", "json")  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    validate(doc, SCHEMA)
    assert doc["options"]["memory_budget"] == 0.5 and doc["options"]["segment_stride"] == 2
    graphs, totals = doc["graphs"], doc["totals"]
    assert totals["baseline_saved_bytes"] == sum(g["baseline_saved_bytes"] for g in graphs)
    assert totals["resident_peak_bytes"] == sum(g["resident_peak_bytes"] for g in graphs)
    cfg = json.loads((Path(QWEN3) / "config.json").read_text())
    tokens = 2 * 64
    assert totals["baseline_saved_bytes"] >= cfg["num_hidden_layers"] * tokens * cfg["hidden_size"] * 2
    assert "Qwen3ForCausalLM" in doc["target"]


def test_json_budget_is_met(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, GPT, "--budget", "0.3", "--format", "json", "-q",
                         "--cost-model", "unit", "--min-offload", "0")  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    validate(doc, SCHEMA)
    for g in doc["graphs"]:
        # A fraction is the graph's own target, 30 % of the way from its lowest plan's step
        # peak to plain min-cut's; the step's budget is that over the start level.
        target, step = g["target"], g["step"]
        assert g["budget_bytes"] == step["start_bytes"] + max(target["forward_bytes"], target["backward_bytes"])
        assert any("memory_budget=0.3: " in note for note in g["notes"]), g["notes"]
        assert g["forward_peak_bytes"] <= target["forward_bytes"], g["notes"]
        assert g["backward_peak_bytes"] <= target["backward_bytes"], g["notes"]
        assert step["total_bytes"] <= g["budget_bytes"], g["notes"]
        assert g["resident_peak_bytes"] < g["baseline_saved_bytes"]  # it saves less than plain
    assert doc["totals"]["over_budget"] == []


def test_html_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    page = tmp_path / "plan.html"
    code, out, err = run(capsys, GPT, "--budget", "0.5", "--html", str(page), "-q")
    assert code == 0, err
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") >= 2
    assert "budget" in html and "<table" in html and "layers.0" in html
    assert "predicted step peak" in html and "predicted step time" in html
    # One name per figure in both charts; the timeline's positions are on its axis; a long
    # table wraps its cells within the page instead of running off its side.
    charts = re.findall(r"<svg.*?</svg>", html, re.S)
    assert sum("plain min-cut saves" in c for c in charts) >= 2, "one name for the baseline"
    assert "min-cut peak" not in html and "baseline (plain" not in html
    timeline = next(c for c in charts if "forward → backward" in c)
    assert len(re.findall(r'class="xtick"', timeline)) == 5
    assert "table.rows{width:100%}" in html and "overflow-wrap:anywhere" in html
    # Self-contained: nothing to fetch (the SVG namespace URI is an identifier, not a fetch).
    assert not re.search(r"<script|<link|<img|@import|src=|url\(", html)
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", html)


def test_sweep_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, GPT, "--sweep", "0.25", "-q", "--cost-model", "unit")
    assert code == 0, err
    header = next(line for line in out.splitlines() if "budget" in line and "fits" in line)
    assert [c for c in SWEEP_COLUMNS if c in header] == list(SWEEP_COLUMNS)
    assert re.search(r"^\s*0\.25\s.*(yes|no)\s*$", out, re.M)
    code, out, err = run(capsys, GPT, "--sweep", "1.0,0.25", "-q", "--format", "json",
                         "--cost-model", "unit")  # fmt: skip
    assert code == 0, err
    sweep = json.loads(out)["sweep"]
    assert [s["budget"] for s in sweep] == ["1.0", "0.25"]
    peaks = [s["totals"]["resident_peak_bytes"] for s in sweep]
    assert peaks[1] <= peaks[0]


def test_output_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    code, out, _ = run(capsys, GPT, "--format", "json", "-q", "-o", str(target))
    assert code == 0 and out == ""
    validate(json.loads(target.read_text()), SCHEMA)


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([GPT, "--budget", "1.5"], "memory_budget"),
        ([GPT, "--budget", "auto"], "memory_budget"),
        ([GPT, "--budget", "12 parsecs"], "memory_budget"),
        ([GPT, "--stride", "two"], "segment_stride"),
        ([GPT, "--stride", "2", "--width", "3"], "segment_width"),
        ([GPT, "--offload", "sometimes"], "offload"),
        ([GPT, "--min-offload=-1MiB"], "min_offload_bytes"),
        ([GPT, "--bandwidth", "0"], "bandwidth"),
        ([GPT, "--cost-model", "flop"], "cost_model"),
        ([GPT, "--blocks", "("], "blocks"),
        ([GPT, "--sweep", "0.5,7.5"], "memory_budget"),
        ([GPT, "--sweep", ","], "--sweep"),
        ([GPT, "--bogus"], "unrecognized"),
        ([GPT, "--format", "yaml"], "--format"),
        ([], "TARGET"),
        ([GPT, "--hf-config", QWEN3], "either"),
        (["no_such_module_xyz:make"], "no_such_module_xyz"),
        ([str(HERE / "fixtures" / "tiny_gpt.py") + ":missing"], "missing"),
        ([str(HERE / "fixtures" / "tiny_gpt.py") + ":not_a_pair"], "example_inputs"),
        ([str(HERE / "fixtures" / "tiny_gpt.py") + ":frozen"], "requires grad"),
        (["--hf-config", str(HERE / "fixtures")], "config.json"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run(capsys, *argv, "-q")
    assert code == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxckpt inspect: error:"), err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_console_script_exit_code() -> None:
    """The installed entry point, end to end: a bad flag is exit code 2 without a traceback."""
    proc = subprocess.run([sys.executable, "-m", "fxckpt.cli", "inspect", GPT, "--budget", "-3"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "memory_budget" in proc.stderr and "Traceback" not in proc.stderr


def test_python_dash_m_fxckpt_is_the_command() -> None:
    """``python -m fxckpt`` runs the same command (a source tree has no console script)."""
    proc = subprocess.run([sys.executable, "-m", "fxckpt", "inspect", GPT, "--budget", "-3"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("fxckpt inspect: error:") and "memory_budget" in proc.stderr


def _planned_in_child(tmp_path: Path, *argv: str, timeout: int) -> tuple[dict[str, Any], int]:
    """Run the CLI in a fresh process; return its JSON document and its peak RSS in bytes."""
    out = tmp_path / "plan.json"
    code = (
        "import resource, sys; from fxckpt.cli import main; rc = main(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "inspect", *argv, "--format", "json", "-o", str(out)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = int(proc.stdout.strip().splitlines()[-1]) * 1024  # ru_maxrss is in KiB on Linux
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert children >= rss  # the two measurements agree on what the child peaked at
    return json.loads(out.read_text()), rss


@pytest.mark.slow
def test_a_70b_model_plans_in_a_few_gib(tmp_path: Path) -> None:
    """A 72B-parameter Llama: 145 GB of bf16 weights, far more than a CI machine's RAM.

    (tests/fixtures/llama_70b, Llama-3-70B's real shape, plans the same way in about two
    minutes; docs/cli.md has the command and its figures.)
    """
    doc, rss = _planned_in_child(tmp_path, "--hf-config", WIDE_72B, "--seq", "256",
                                 "--budget", "0.25", "-q", timeout=900)  # fmt: skip
    validate(doc, SCHEMA)
    found = re.search(r"\(([\d.]+)B params\)", doc["target"])
    assert found is not None, doc["target"]
    params = float(found.group(1)) * 1e9
    assert params > 65e9
    assert rss < 4 * 2**30 < params * 2 / 30, f"peak RSS {rss / 2**30:.1f} GiB"
    cfg = json.loads((Path(WIDE_72B) / "config.json").read_text())
    assert doc["totals"]["baseline_saved_bytes"] >= cfg["num_hidden_layers"] * 256 * cfg["hidden_size"] * 2


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("FXCKPT_BIG_TESTS"),
    reason="about 2 minutes; set FXCKPT_BIG_TESTS=1 (docs/cli.md has the measured command)",
)
def test_qwen3_8b_at_32k_tokens_meets_24gib(tmp_path: Path) -> None:
    # Segments of one block (--stride 1) are needed: offloading alone peaks at 27.6 GiB, held
    # up by the loss's 18.5 GiB float32 log-softmax, which can be neither offloaded nor
    # recomputed, plus views of the attention outputs.
    doc, rss = _planned_in_child(tmp_path, "--hf-config", QWEN3_8B, "--seq", "32768",
                                 "--budget", "24GiB", "--stride", "1", "-q", timeout=1200)  # fmt: skip
    validate(doc, SCHEMA)
    cfg = json.loads((Path(QWEN3_8B) / "config.json").read_text())
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    assert doc["totals"]["baseline_saved_bytes"] >= layers * 32768 * hidden * 2
    assert rss < 6 * 2**30
    for g in doc["graphs"]:
        assert g["budget_bytes"] == 24 * 2**30
        assert g["resident_peak_bytes"] <= g["budget_bytes"], g["notes"]


def test_module_target_is_found_in_the_current_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "cwd_pkg_for_inspect"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(
        "import torch\n"
        "def make():\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())\n"
        "    return net, (torch.zeros(32, 64),), lambda y: y.sum()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    code, out, err = run(capsys, "cwd_pkg_for_inspect.net:make", "-q", "--format", "json")
    assert code == 0, err
    shapes = [a["shape"] for g in json.loads(out)["graphs"] for a in g["activations"]]
    assert shapes == [[32, 64]]  # tanh's output, saved for its backward


def test_piped_output_takes_its_width_from_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def widest(*argv: str) -> int:
        code, out, err = run(capsys, GPT, "-q", *argv)
        assert code == 0, err
        return max(len(line) for line in out.splitlines())

    assert widest() == 200  # piped, no COLUMNS: wide enough for the reasons
    monkeypatch.setenv("COLUMNS", "100")
    assert widest() == 100


def test_html_options_and_notes_speak_in_units(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    page = tmp_path / "plan.html"
    code, out, err = run(capsys, GPT, "--budget", "3MiB", "--html", str(page), "-q")
    assert code == 0, err
    html = page.read_text()
    options = next(line for line in html.splitlines() if "options: " in line)
    assert "memory_budget=&#x27;3.0 MiB&#x27;" in options, options
    assert str(3 * 2**20) not in html


def test_host_memory_past_the_machines_ram_is_warned(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fxckpt import _host

    code, out, err = run(capsys, GPT, "--offload", "all", "-q")
    assert code == 0 and "host memory" not in err, err  # this machine holds it
    monkeypatch.setattr(_host, "total_bytes", lambda: 2**20)
    code, out, err = run(capsys, GPT, "--offload", "all", "-q")
    assert code == 0, err
    assert "to host memory; this machine has 1.0 MiB of RAM" in err, err
    # The plan at --seq under --max-seq too.
    monkeypatch.setattr(_host, "total_bytes", lambda: 2**10)
    code, out, err = run(capsys, "tests/models.py:gpt_seq_factory", "--offload", "all", "-q",
                         "--device-memory", "24MiB", "--max-seq", "80")  # fmt: skip
    assert code == 0, err
    assert "to host memory; this machine has 1.0 KiB of RAM" in err, err


def test_the_report_points_at_the_models_own_waste(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A causal LM's float32 log-softmax and its seq x seq mask, among the largest kept
    tensors, are named once each with their fix; a model without them gets no such line."""
    monkeypatch.delenv("COLUMNS", raising=False)  # 200 columns: each line unfolded
    code, out, err = run(capsys, "--hf-config", QWEN3, "--seq", "256", "--batch", "2",
                         "--dtype", "float32", "-q")  # fmt: skip
    assert code == 0, err
    assert out.count("log-softmax over the vocabulary (512×512, 1.0 MiB)") == 1, out
    assert out.count("attention mask built whole (2×1×256×256, 512.0 KiB)") == 1, out
    assert "chunked cross-entropy" in out and "is_causal" in out
    code, out, err = run(capsys, "fixtures.tiny_gpt:gpt_logits", "-q")
    assert code == 0, err
    assert "in the model" not in out
