"""Every ordering call of the CUDA runtime is needed: removing any one fails a protocol test.

Opt-in (``FXCKPT_MUTANTS=1``): each mutant copies the package, removes one call, and runs
``tests/runtime/test_cuda_protocol.py`` and ``tests/runtime/test_cuda_buckets.py`` (the same
rules for a bucket of tensors copied together) against the copy in a fresh process, about ten
seconds each. The table it prints (``-s``) is the mutation proof: removed call, then the
tests that caught it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = [ROOT / "tests" / "runtime" / name
            for name in ("test_cuda_protocol.py", "test_cuda_buckets.py")]

# (file, line as written, which occurrence, replacement): one ordering rule each.
MUTANTS = [
    ("runtime/cuda_engine.py", "side.wait_stream(compute)  # the source is written", 1, "pass"),
    # The offload's and the prefetch's copies share one done.record (CudaEngine._copy).
    ("runtime/cuda_engine.py", "done.record(side)", 1, "pass"),
    ("runtime/cuda_engine.py",
     "self._join(_cuda.CUDA.current_stream(self.device), rec.d2h, rec.meter)", 1, "pass"),
    ("runtime/cuda_engine.py", "side.wait_stream(compute)", 2, "pass"),
    ("runtime/cuda_engine.py", "side.wait_event(rec.d2h)", 1, "pass"),
    ("runtime/cuda_engine.py", "self._join(compute, rec.h2d, rec.meter)", 1, "pass"),
    ("runtime/cuda_engine.py", "cuda.record_stream(dev, compute)", 1, "pass"),
    ("runtime/cuda_engine.py", "rec.dev_stream.wait_event(rec.h2d)", 1, "pass"),
    ("runtime/cuda_engine.py", "rec.src_stream.wait_event(rec.d2h)", 1, "pass"),
    ("runtime/cuda_engine.py", "compute.wait_event(copied)", 1, "pass"),
    ("runtime/cuda_engine.py", "return tuple(e.query for e in (rec.d2h, rec.h2d)", 1,
     "return ()"),
    ("runtime/cuda_engine.py", "reached.record(compute)", 1, "pass"),
    ("runtime/cuda_engine.py", "released.record(compute)", 1, "pass"),
    ("runtime/transfer.py", "rec.src = src", 2, "pass"),  # the host tier's (#1: the disk tier's)
    ("runtime/pool.py", "if all(done() for done in checks):", 1, "if True:"),
    # Streamed weights: the optimizer's host write waits for the copies still reading it.
    ("runtime/weight_ops.py", "_pending(rec.h2d)", 1, "pass"),
    ("runtime/weight_ops.py", "done.synchronize()", 1, "pass"),
    # A streamed weight's gradient: the host reads it only once it has seen its copy complete.
    ("runtime/weight_ops.py", "rec.profile.engine(rec.device).wait_copied(rec.d2h, rec)", 1, "pass"),
]


def mutate(src: str, line: str, occurrence: int, replacement: str) -> str:
    lines = src.splitlines(keepends=True)
    hits = [i for i, text in enumerate(lines) if text.strip().startswith(line)]
    assert len(hits) >= occurrence, f"{line!r}: {len(hits)} occurrence(s), wanted #{occurrence}"
    i = hits[occurrence - 1]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = f"{indent}{replacement}\n"
    return "".join(lines)


@pytest.mark.skipif(os.environ.get("FXCKPT_MUTANTS") != "1", reason="opt-in: FXCKPT_MUTANTS=1")
@pytest.mark.slow
def test_each_ordering_call_is_caught_when_removed(tmp_path):
    table, survivors = [], []
    for n, (rel, line, occurrence, replacement) in enumerate(MUTANTS):
        tree = tmp_path / f"m{n}"
        shutil.copytree(ROOT / "fxckpt", tree / "fxckpt")
        target = tree / "fxckpt" / rel
        target.write_text(mutate(target.read_text(), line, occurrence, replacement))
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
             *map(str, PROTOCOL)],
            capture_output=True, text=True, env=env, cwd=tree, timeout=600,
        )
        if n == 0:  # the copy, not the checkout, is what the tests import
            where = subprocess.run([sys.executable, "-c", "import fxckpt; print(fxckpt.__file__)"],
                                   capture_output=True, text=True, env=env, cwd=tree)
            assert where.stdout.strip().startswith(str(tree)), where.stdout + where.stderr
        caught = re.findall(r"^FAILED \S+?(\w+)\.py::(\w+)", done.stdout, re.M)
        caught = [f"{test} ({'bucket' if file.endswith('buckets') else 'single'})"
                  for file, test in caught]
        label = f"{rel}: {line} (#{occurrence}) -> {replacement}"
        table.append(f"{label}\n    caught by: {', '.join(caught) or 'NOTHING'}")
        if done.returncode == 0 or not caught:
            survivors.append(label)
    print("\n" + "\n".join(table))
    assert survivors == []
