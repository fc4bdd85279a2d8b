"""The package's layout holds what a newcomer relies on: modules are modules, files stay
short, torch's internals stay in one file (``fxckpt/_torch_compat.py``), and every document a
text names exists."""

from __future__ import annotations

import re
import types
from pathlib import Path

import fxckpt

PACKAGE = Path(fxckpt.__file__).parent
ROOT = PACKAGE.parent
MAX_LINES = 450
# The one exception: every torch internal is in this one file, by rule, so it is as long as
# the internals fxckpt touches (about 640 lines).
LONG_BY_RULE = {"_torch_compat.py"}


def test_public_functions_do_not_shadow_their_modules() -> None:
    import fxckpt.backend as backend_module
    import fxckpt.inspect as inspect_module

    assert isinstance(backend_module, types.ModuleType)
    assert isinstance(inspect_module, types.ModuleType)
    # ... and calling them is calling their function, as the docs write it.
    assert isinstance(fxckpt.backend(memory_budget=0.5), backend_module.Backend)
    assert fxckpt.inspect is inspect_module


def test_no_package_file_is_over_the_line_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if p.name not in LONG_BY_RULE
            and (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, f"split these (over {MAX_LINES} lines): {long}"


def test_torch_internals_are_named_only_in_the_compat_module() -> None:
    # Text included (messages, docstrings): the compat module names them for the others.
    found = [f"{p.relative_to(ROOT)}:{k}" for p in PACKAGE.rglob("*.py")
             if p.name != "_torch_compat.py"
             for k, line in enumerate(p.read_text().splitlines(), 1) if "torch._" in line]  # fmt: skip
    assert not found, found


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
