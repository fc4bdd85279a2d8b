"""Every ordering rule of the disk tier is needed: breaking any one fails a test.

Opt-in (``FXCKPT_MUTANTS=1``), like ``test_mutants.py``: each mutant copies the package,
breaks one rule (removes the call, or gives a buffer back early), and runs the disk tier's
CPU and CUDA-double tests against the copy in a fresh process. The table it prints (``-s``)
is the mutation proof.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.test_mutants import mutate

ROOT = Path(__file__).resolve().parents[2]
TESTS = [ROOT / "tests" / "runtime" / n for n in ("test_disk.py", "test_disk_protocol.py")]

# (rule, [(file, line as written, occurrence, replacement), ...])
MUTANTS: list[tuple[str, list[tuple[str, str, int, str]]]] = [
    ("W1 the write waits for the device-to-host copy (CPU)",
     [("runtime/disk.py", "rec.profile.engine(rec.device).wait_copied(d2h, rec)  # W1", 1, "pass")]),
    ("W1 the write waits for the device-to-host copy (CUDA)",
     [("runtime/cuda_engine.py", "d2h.synchronize()", 1, "pass")]),
    ("W2 the staging buffer goes back only after the write",
     [("runtime/disk.py", "_write_file(rec, copy)", 1,
       "_give_back(rec.profile.pool(rec.device.type), [copy.buf]); _write_file(rec, copy)"),
      ("runtime/disk.py", "_staging(rec).give(held)  # W2", 1, "_staging(rec).give([])")]),
    ("R1 the read waits for the write",
     [("runtime/disk.py", "copy.written.exception()  # R1", 1, "pass")]),
    ("R2 the staging buffer of a read goes back after its copy to the device (CUDA)",
     [("runtime/cuda_engine.py", "done.synchronize()", 1, "pass")]),
    ("R3 compute's use of a restored span is made known to the allocator (CUDA)",
     [("runtime/cuda_engine.py", "cuda.record_stream(dev, cuda.current_stream(self.device))", 1,
       "pass")]),
    ("F1 the file goes when the handle dies",
     [("runtime/disk.py", "_files.FILES.remove(copy.path)  # F1", 1, "pass")]),
    ("a failed write keeps its buffer as the host copy",
     [("runtime/disk.py", "_staging(rec).give([])  # the buffer stays", 1,
       "_staging(rec).give([copy.buf])")]),
    ("the source stays referenced until its copy was waited for",
     [("runtime/transfer.py", "rec.src = src", 1, "pass")]),
    ("the host tier waits for staging before it falls back",
     [("runtime/transfer.py", "waited = disk.wait_for_staging(staging_of(pool))", 1,
       "waited = 0.0")]),
]


@pytest.mark.skipif(os.environ.get("FXCKPT_MUTANTS") != "1", reason="opt-in: FXCKPT_MUTANTS=1")
@pytest.mark.slow
def test_each_disk_tier_rule_is_caught_when_broken(tmp_path: Path) -> None:
    table, survivors = [], []
    for n, (rule, edits) in enumerate(MUTANTS):
        tree = tmp_path / f"m{n}"
        shutil.copytree(ROOT / "fxckpt", tree / "fxckpt")
        for rel, line, occurrence, replacement in edits:
            target = tree / "fxckpt" / rel
            target.write_text(mutate(target.read_text(), line, occurrence, replacement))
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
             *map(str, TESTS)],
            capture_output=True, text=True, env=env, cwd=tree, timeout=900,
        )  # fmt: skip
        caught = re.findall(r"^FAILED \S+::(\w+)", done.stdout, re.M)
        table.append(f"{rule}\n    caught by: {', '.join(sorted(set(caught))) or 'NOTHING'}")
        if done.returncode == 0 or not caught:
            survivors.append(rule)
    print("\n" + "\n".join(table))
    assert survivors == []

