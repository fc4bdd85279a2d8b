"""Let trainers that name their compile backend reach fxckpt.

accelerate (and so the Hugging Face ``Trainer``, since accelerate 1.2) checks
``TrainingArguments(torch_compile_backend=...)`` against its own ``DynamoBackend`` enum,
which lists only the backends accelerate knows. A backend registered with torch under
another name is refused with ``ValueError: 'FXCKPT' is not a valid DynamoBackend``.
:func:`register_with_accelerate` adds fxckpt to that enum, so the string works::

    import fxckpt
    fxckpt.register_with_accelerate()
    args = TrainingArguments(..., torch_compile=True, torch_compile_backend="fxckpt")

Options come from the ``FXCKPT_OPTIONS`` environment variable (a JSON object), since the
Trainer has no way to pass ``options=``.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from fxckpt.errors import FxckptError

log = logging.getLogger(__name__)

NAME = "FXCKPT"


def register_with_accelerate() -> None:
    """Add ``"FXCKPT"`` to accelerate's ``DynamoBackend`` enum; idempotent.

    accelerate lower-cases the member's value into ``torch.compile(backend="fxckpt")``, the
    name fxckpt registers with torch. Call it once, before building the ``Trainer`` (or the
    ``Accelerator``). Raises :class:`fxckpt.FxckptError` when accelerate is not installed or
    its enum is not the shape this function knows.
    """
    try:
        from accelerate.utils import DynamoBackend
    except ImportError as err:
        raise FxckptError(
            "register_with_accelerate() needs accelerate; install it with "
            "`pip install accelerate`, or compile the model yourself with "
            "torch.compile(model, backend='fxckpt') and pass it to the Trainer"
        ) from err
    if NAME in DynamoBackend.__members__:
        return
    _add_member(DynamoBackend, NAME)
    log.info("fxckpt: accelerate's DynamoBackend now accepts %r", NAME)


def _add_member(cls: Any, name: str) -> None:
    """Add a member named and valued ``name`` to the ``str`` enum ``cls``.

    ``Enum`` offers no way to extend a class; this sets the three tables its lookups read
    (``cls(value)``, ``cls[name]``, iteration), as the class statement would have.
    """
    tables = ("_member_map_", "_value2member_map_", "_member_names_")
    if not (isinstance(cls, enum.EnumMeta) and issubclass(cls, str)) or not all(
        hasattr(cls, t) for t in tables
    ):
        raise FxckptError(
            f"accelerate's DynamoBackend is not the str enum fxckpt knows ({cls!r}); "
            "compile the model yourself with torch.compile(model, backend='fxckpt') and pass "
            "it to the Trainer"
        )
    enum_cls: Any = cls  # past the checks above; mypy narrows cls to type[str]
    member: Any = str.__new__(enum_cls, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = enum_cls
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[name] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
