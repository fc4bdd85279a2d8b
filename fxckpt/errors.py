"""The exceptions fxckpt raises. Every one of them derives from :class:`FxckptError`."""

from __future__ import annotations


class FxckptError(Exception):
    """Base class of every error fxckpt raises on purpose."""


class OptionsError(FxckptError, ValueError):
    """An option has a value fxckpt cannot accept.

    ``option`` names the option, ``value`` is what was received and ``accepted`` says what to
    write instead.
    """

    def __init__(self, option: str, value: object, accepted: str, detail: str = "") -> None:
        self.option = option
        self.value = value
        self.accepted = accepted
        self.detail = detail
        why = f" ({detail})" if detail else ""
        super().__init__(f"fxckpt option {option!r}: got {value!r}{why}; expected {accepted}")


class BudgetError(FxckptError):
    """No plan fits the memory budget.

    ``smallest_bytes`` is the smallest budget the planner reaches: written back as
    ``memory_budget``, it runs and holds. ``parts`` splits it where it peaks (``start_bytes``:
    what the device held when the step began; ``gradients_bytes``; ``activations_bytes``:
    everything else the step holds there), and ``suggestions`` lists options that would go
    lower. Under dynamic shapes ``sizes`` names the lengths the plan was made for
    (``L['idx'].size()[1]=512``).

    ``scope`` is ``"step"`` (the step as a whole, every graph and run counted) or ``"graph"``
    (one graph's range of sizes under ``mark_dynamic``, its saved activations against what its
    plan allows there).
    """

    def __init__(
        self,
        graph: str,
        budget_bytes: int,
        smallest_bytes: int,
        suggestions: list[str],
        sizes: str = "",
        *,
        scope: str = "graph",
        detail: str = "",
        option: str = "memory_budget",
        parts: dict[str, int] | None = None,
    ) -> None:
        from fxckpt.units import format_bytes

        self.graph = graph
        self.option = option
        self.budget_bytes = budget_bytes
        self.smallest_bytes = smallest_bytes
        self.suggestions = list(suggestions)
        self.sizes = sizes
        self.scope = scope
        self.parts = dict(parts or {})
        hint = ("; to go lower: " + ", ".join(suggestions)) if suggestions else ""
        at = f" at {sizes}" if sizes else ""
        if scope == "step":
            split = ""
            if self.parts:
                p = self.parts
                split = (f": {format_bytes(p.get('start_bytes', 0))} held when the step starts, "
                         f"{format_bytes(p.get('gradients_bytes', 0))} of gradients, "
                         f"{format_bytes(p.get('activations_bytes', 0))} of activations and "
                         "temporaries where it peaks")
            more = f" ({detail})" if detail else ""
            self.summary = (
                f"fxckpt: {graph}{at} cannot meet memory_budget={budget_bytes} bytes "
                f"({format_bytes(budget_bytes)}): the smallest budget it runs under is "
                f"memory_budget={smallest_bytes} ({format_bytes(smallest_bytes)}){split}{more}{hint}."
            )
        else:
            self.summary = (
                f"fxckpt: graph {graph!r} cannot meet {option}{at}: its plan allows the saved "
                f"activations {budget_bytes} bytes there, and the smallest the planner reaches "
                f"is {smallest_bytes} bytes{hint}."
            )
        super().__init__(
            f"{self.summary} Write memory_budget={smallest_bytes} or more, or pass "
            "on_infeasible='warn' to run the smallest plan."
            if scope == "step" else
            f"{self.summary} Raise {option}, or pass on_infeasible='warn' to run the smallest plan."
        )


class RuntimeCopyError(FxckptError, RuntimeError):
    """A host/device copy of an offloaded activation failed."""
