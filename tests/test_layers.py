"""The package's layers import downwards only: ``graph`` (facts read off FX graphs) ->
``planning`` (deciding, and the simulator it decides with) -> ``passes`` (carrying a plan
out) -> the backend. ``runtime`` imports nothing of the compiler side (tests/runtime/test_engine.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fxckpt

PACKAGE = Path(fxckpt.__file__).parent
# What each layer must not import.
FORBIDDEN = {
    "graph": ("fxckpt.planning", "fxckpt.passes", "fxckpt.backend", "fxckpt.inspect"),
    "planning": ("fxckpt.passes", "fxckpt.backend", "fxckpt.inspect"),
    "passes": ("fxckpt.backend", "fxckpt.inspect"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    wrong = sorted(
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in (PACKAGE / layer).glob("*.py")
        for name in _imports(path)
        if name.startswith(FORBIDDEN[layer])
    )
    assert not wrong, wrong


def test_the_scan_sees_an_import_from_a_higher_layer(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from fxckpt.passes.offload import Placement\nimport fxckpt.backend\n")
    assert {"fxckpt.passes.offload", "fxckpt.backend"} <= _imports(f)
