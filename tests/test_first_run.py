"""A first run prints nothing alarming: no warning from torch, none of the profiler's lines.

The CPU meter starts and stops torch's profiler, whose C++ library logs each start and stop to
stderr; fxckpt drops exactly those lines (fxckpt/_profiler_log.py) and lets everything else
through. The subprocess tests run in a clean environment, as a new user's shell would be.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fxckpt._profiler_log import quiet_trace_lines, without_trace_lines

ROOT = Path(__file__).parents[1]
START = b"USDT:2026-12-01 13:48:48 6230:6230 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
STOP = b"USDT:2026-12-01 13:48:48 6230:6230 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"
NO_GPU = b"ERROR:2026-12-01 13:56:49 8936:8936 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n"
OTHER_ERROR = (
    b"ERROR:2026-12-01 13:56:49 8936:8936 SyncActivityProfilerHandler.cpp:61] "
    b"Cancelling current trace request in order to start higher priority synchronous request\n"
)


def test_only_the_trace_start_and_stop_lines_are_dropped() -> None:
    data = START + b"a line of the program's own\n" + STOP + OTHER_ERROR + b"USDT: profiler_start, quoted\n"
    assert without_trace_lines(data) == b"a line of the program's own\n" + OTHER_ERROR + b"USDT: profiler_start, quoted\n"


def test_the_failure_to_count_gpus_is_dropped_only_where_torch_sees_none() -> None:
    kept = without_trace_lines(NO_GPU)
    assert kept == (NO_GPU if torch.cuda.is_available() else b"")


def test_what_else_reaches_stderr_inside_the_block_comes_out(capfd: pytest.CaptureFixture[str]) -> None:
    # (Python's own writes to sys.stderr inside the block: the subprocess test below.)
    with quiet_trace_lines():
        os.write(2, START + b"a real error from C++\n")
        os.write(2, OTHER_ERROR + STOP)
    assert capfd.readouterr().err == "a real error from C++\n" + OTHER_ERROR.decode()


def test_an_exception_in_the_block_propagates_and_stderr_is_restored(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="profiler failed"):
        with quiet_trace_lines():
            os.write(2, START + b"what it said before failing\n")
            raise RuntimeError("profiler failed")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "what it said before failing\nafter\n"


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """A new user's shell: the interpreter's directory, /usr/bin and /bin on PATH, a fresh
    home and compile cache, and nothing of torch's, kineto's or pytest's settings."""
    home = tmp_path / "home"
    home.mkdir()
    return {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]),
        "HOME": str(home),
        "TMPDIR": str(tmp_path),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "PYTHONPATH": str(ROOT),
        "LANG": "C.UTF-8",
    }


def test_the_cpu_meter_prints_nothing_and_real_errors_still_surface(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, warnings
        import torch
        import fxckpt

        model = torch.compile(torch.nn.Linear(8, 8), backend=fxckpt.backend(compiler="eager"))
        x = torch.randn(4, 8)
        model(x).sum().backward()
        for _ in range(3):
            m = fxckpt.measure(model, x)
        print(m.resident_bytes > 0)

        def noisy():
            os.write(2, b"a real error, written by C code during the measured call\\n")
            warnings.warn("a real warning")
            return model(x)

        fxckpt.measure(noisy)

        from fxckpt._profiler_log import quiet_trace_lines

        with quiet_trace_lines():  # as if torch warned while the profiler stopped
            warnings.warn("a warning while the profiler stops")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], env=_clean_env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True\n"
    lines = done.stderr.splitlines()
    assert lines[0] == "a real error, written by C code during the measured call", done.stderr
    assert "UserWarning: a real warning" in lines[1], done.stderr
    assert "UserWarning: a warning while the profiler stops" in lines[2], done.stderr
    assert len(lines) == 3, done.stderr  # (code run by -c has no source line to show)


def _torch_cuda_home_line(stderr: str) -> str:
    """torch's own warning on a machine with a CUDA toolkit and no GPU (a CUDA build of torch
    finds ``nvcc`` or ``/usr/local/cuda`` when Inductor imports ``torch.utils.cpp_extension``);
    plain ``torch.compile`` prints it the same. Empty where the machine gives no cause."""
    from torch.utils import cpp_extension

    cause = torch.version.cuda and not torch.cuda.is_available() and cpp_extension.CUDA_HOME
    return next((ln for ln in stderr.splitlines() if "No CUDA runtime is found" in ln), "") if cause else ""


@pytest.mark.slow
@pytest.mark.inductor
def test_the_quickstart_prints_nothing_on_stderr(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "2", "--seq", "64"]
    done = subprocess.run(cmd, env=_clean_env(tmp_path), cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "losses  fxckpt" in done.stdout
    machine = _torch_cuda_home_line(done.stderr)
    assert done.stderr.replace(machine + "\n", "", 1) == "", done.stderr
