"""Every torch internal fxckpt touches goes through ``fxckpt/_torch_compat.py``: the one file
to read, and to change, when a torch release moves one."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import fxckpt

PACKAGE = Path(fxckpt.__file__).parent
COMPAT = PACKAGE / "_torch_compat.py"


def internal_uses(source: str) -> list[tuple[int, str]]:
    """``torch._name`` in code (imports included), not in strings or comments."""
    names = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type in (tokenize.NAME, tokenize.OP)]
    triples = zip(names, names[1:], names[2:], strict=False)
    return [(a.start[0], f"torch.{c.string}") for a, b, c in triples
            if a.string == "torch" and b.string == "." and c.string.startswith("_")]


def test_the_scan_sees_uses_and_skips_text() -> None:
    code = ('import torch._dynamo\nfrom torch._guards import X\ny = torch._C.Tag\n'
            '"torch._dynamo.mark_dynamic in a message"  # torch._ops in a comment\n')
    assert internal_uses(code) == [(1, "torch._dynamo"), (2, "torch._guards"), (3, "torch._C")]


def test_no_torch_internal_outside_the_compat_module() -> None:
    found = {f"{path.relative_to(PACKAGE)}:{line}: {name}"
             for path in PACKAGE.rglob("*.py") if path != COMPAT
             for line, name in internal_uses(path.read_text())}
    assert not found, "go through fxckpt/_torch_compat.py:\n" + "\n".join(sorted(found))
