"""``import fxckpt`` registers its ops and does nothing else: no thread, no process, no CUDA
context or stream, no pinned buffer, no host pool, and no optional dependency imported.

Each check runs in a fresh interpreter, since this one has long since imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch

    calls = []

    def spy(owner, name):
        real = getattr(owner, name)
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        setattr(owner, name, wrapper)

    # Anything that would start CUDA, make a stream or event, or pin host memory.
    for name in ("_lazy_init", "init", "current_stream", "set_device", "synchronize"):
        spy(torch.cuda, name)
    for name in ("Stream", "Event"):
        spy(torch.cuda, name)
    for name in ("empty", "zeros", "empty_strided"):
        real = getattr(torch, name)
        def pinned_spy(*args, _real=real, _name=name, **kwargs):
            if kwargs.get("pin_memory"):
                calls.append(_name + "(pin_memory=True)")
            return _real(*args, **kwargs)
        setattr(torch, name, pinned_spy)
    spy(torch.Tensor, "pin_memory")

    def tasks():
        return sorted(os.listdir("/proc/self/task"))

    def children():
        out = []
        for t in os.listdir("/proc/self/task"):
            try:
                out += open(f"/proc/self/task/{t}/children").read().split()
            except OSError:
                pass
        return out

    before = {"threads": [t.name for t in threading.enumerate()], "tasks": tasks(),
              "children": children()}
    import fxckpt
    backend = fxckpt.backend(offload="all", memory_budget="1GiB")  # validating is not running
    from fxckpt.runtime import engine, pool, stats
    after = {"threads": [t.name for t in threading.enumerate()], "tasks": tasks(),
             "children": children()}
    print("RESULT " + json.dumps({
        "before": before,
        "after": after,
        "calls": calls,
        "cuda_initialized": torch.cuda.is_initialized(),
        "engines": len(engine._engines),
        "pools": len(pool._pools),
        "pool_bytes": stats.snapshot()["pool_bytes"],
        "ops": [str(op) for op in (torch.ops.fxckpt.offload.default, torch.ops.fxckpt.wait.default)],
        "heavy": [m for m in ("transformers", "rich", "scipy", "torch._inductor.compile_fx")
                  if m in sys.modules],
        "plans": len(fxckpt.last_plans()),
    }))
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts OS threads in /proc")
def test_import_fxckpt_creates_no_thread_stream_cuda_context_or_pinned_buffer() -> None:
    # A malformed FXCKPT_OPTIONS must not matter either: options are read at the backend's
    # entry, never at import.
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env["FXCKPT_OPTIONS"] = "{not json"
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    r = json.loads(line[len("RESULT ") :])
    assert r["after"]["threads"] == r["before"]["threads"]  # no Python thread
    assert r["after"]["tasks"] == r["before"]["tasks"]  # no native thread (OpenMP, workers)
    assert r["after"]["children"] == r["before"]["children"] == []  # no compile workers
    assert r["calls"] == []  # no CUDA init, stream, event or pinned allocation
    assert r["cuda_initialized"] is False
    assert (r["engines"], r["pools"], r["pool_bytes"]) == (0, 0, 0)
    assert r["ops"] == ["fxckpt.offload.default", "fxckpt.wait.default"]  # registered
    assert r["heavy"] == []  # optional extras and Inductor load only when used
    assert r["plans"] == 0


# The child hides (or keeps) the installed entry point: torch reads entry points through
# importlib.metadata.entry_points at its first unknown lookup, imported at call time.
BACKEND_CHILD = textwrap.dedent(
    """
    import importlib.metadata as md, json, sys
    import torch

    HIDE = sys.argv[1] == "hide"
    real = md.entry_points

    def entry_points(**kw):
        eps = real(**kw)
        if HIDE and kw.get("group") == "torch_dynamo_backends":
            return md.EntryPoints([e for e in eps if e.name != "fxckpt"])
        return eps

    md.entry_points = entry_points
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    if sys.argv[2] == "lookup-first":  # torch loads the entry point, which imports fxckpt
        found = lookup_backend("fxckpt")
        import fxckpt
    else:
        import fxckpt
        found = lookup_backend("fxckpt")
    x = torch.randn(8, requires_grad=True)
    torch.compile(lambda t: (t.sin() * 2).sum(), backend="fxckpt",
                  options={"compiler": "eager"})(x).backward()
    from fxckpt.backend import fxckpt_backend
    print("RESULT " + json.dumps({"same": found is fxckpt_backend,
                                  "listed": "fxckpt" in list_backends(),
                                  "grad_ok": bool(torch.allclose(x.grad, 2 * x.cos()))}))
    """
)


@pytest.mark.parametrize(
    "entry_point, order",
    [("hide", "import-first"), ("keep", "import-first"), ("keep", "lookup-first")],
)
def test_backend_name_resolves_from_a_source_tree_and_beside_an_installed_entry_point(
    entry_point: str, order: str
) -> None:
    from importlib.metadata import entry_points

    installed = any(e.name == "fxckpt" for e in entry_points(group="torch_dynamo_backends"))
    if entry_point == "keep" and not installed:
        pytest.skip("fxckpt is not installed here: no entry point to keep")
    # "hide": running from a source tree (PYTHONPATH=.), no entry point anywhere; "keep": the
    # package is installed, and torch may load its entry point before or after the import.
    done = subprocess.run(
        [sys.executable, "-c", BACKEND_CHILD, entry_point, order],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert json.loads(line[len("RESULT ") :]) == {"same": True, "listed": True, "grad_ok": True}
