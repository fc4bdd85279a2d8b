"""Modules that are also their main function.

``fxckpt.backend`` is the module ``fxckpt/backend.py`` and, called, its ``backend`` factory;
``fxckpt.inspect`` likewise. So ``import fxckpt.backend as m`` binds the module, and
``fxckpt.backend(memory_budget=0.5)`` still builds a backend.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class CallableModule(types.ModuleType):
    """A module whose call is the call of its function of the same name."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


def make_callable(name: str) -> None:
    """Let the module ``name`` (already in ``sys.modules``) be called as its function."""
    sys.modules[name].__class__ = CallableModule
