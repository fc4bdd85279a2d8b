"""The package's layout holds what a newcomer relies on: modules are modules, files stay
short, torch's internals stay in one file (``fxckpt/_torch_compat.py``, each name of it
explained in docs/torch-internals.md), and every document a text names exists."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import fxckpt

PACKAGE = Path(fxckpt.__file__).parent
ROOT = PACKAGE.parent
MAX_LINES = 450
COMPAT = PACKAGE / "_torch_compat.py"
# Every torch internal must go through the compat module, so it cannot be split like the
# others; it gets a little more room, and still a limit.
COMPAT_MAX_LINES = 510
INTERNALS_DOC = ROOT / "docs" / "torch-internals.md"


def test_public_functions_do_not_shadow_their_modules() -> None:
    import fxckpt.backend as backend_module
    import fxckpt.inspect as inspect_module

    assert isinstance(backend_module, types.ModuleType)
    assert isinstance(inspect_module, types.ModuleType)
    # ... and calling them is calling their function, as the docs write it.
    assert isinstance(fxckpt.backend(memory_budget=0.5), backend_module.Backend)
    assert fxckpt.inspect is inspect_module


def test_no_package_file_is_over_the_line_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > (COMPAT_MAX_LINES if p == COMPAT else MAX_LINES)}  # fmt: skip
    assert not long, f"split these (over {MAX_LINES} lines; the compat module {COMPAT_MAX_LINES}): {long}"


def test_torch_internals_are_named_only_in_the_compat_module() -> None:
    # Text included (messages, docstrings): the compat module names them for the others.
    found = [f"{p.relative_to(ROOT)}:{k}" for p in PACKAGE.rglob("*.py")
             if p.name != "_torch_compat.py"
             for k, line in enumerate(p.read_text().splitlines(), 1) if "torch._" in line]  # fmt: skip
    assert not found, found


def _compat_public_names() -> set[str]:
    """What ``fxckpt/_torch_compat.py`` offers: its functions and module-level names, and the
    names it imports from torch; not private names, nor the modules and typing names it uses."""
    names = set()
    for node in ast.parse(COMPAT.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return {n for n in names if not n.startswith("_")}


def test_every_name_of_the_compat_module_is_explained_in_the_internals_doc() -> None:
    names = _compat_public_names()
    # The scan sees what it should: imports, constants and functions alike.
    assert {"aot_autograd", "TORCH_VERSION", "OpOverload", "run_after"} <= names
    assert not names & {"contextlib", "inspect", "torch", "Any", "Iterator", "annotations"}
    text = INTERNALS_DOC.read_text()
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"explain these in {INTERNALS_DOC.relative_to(ROOT)}: {missing}"


def _texts() -> list[Path]:
    roots = [PACKAGE, ROOT / "docs", ROOT / "benchmarks", ROOT / "examples", ROOT / "tests"]
    files = [ROOT / "README.md"]
    for r in roots:
        files += [p for p in r.rglob("*") if p.suffix in (".py", ".md") and p.is_file()]
    return files


def test_every_document_a_text_names_is_in_the_repository() -> None:
    known = {p.name for p in _texts() if p.suffix == ".md"} | {p.name for p in ROOT.glob("*.md")}
    missing = set()
    for path in _texts():
        for name in re.findall(r"[\w./-]+\.md\b", path.read_text()):
            if Path(name).name not in known:
                missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)


def test_every_source_file_a_text_names_is_in_the_repository() -> None:
    # Paths such as `planning/problem.py` or `fxckpt/graph/costs.py`, read from the docs and
    # the code; torch's own files (`torch/...`) and placeholders (`path/to/model.py`) aside.
    pattern = re.compile(r"(?<![\w./])((?:[\w]+/)+[\w]+\.py)\b")
    missing = set()
    for path in _texts():
        for name in pattern.findall(path.read_text()):
            if name.startswith(("torch/", "path/")):
                continue
            if not any((base / name).exists() for base in (ROOT, PACKAGE, ROOT / "tests")):
                missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)
