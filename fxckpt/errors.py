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

    ``smallest_bytes`` is the smallest resident peak the planner could reach, and
    ``suggestions`` lists options that would go lower. Under dynamic shapes ``sizes`` names the
    lengths the plan was made for (``L['idx'].size()[1]=512``).

    ``scope`` is ``"graph"`` (one graph missed its own budget, under ``budget_scope="graph"``)
    or ``"step"``: the graphs of one step together cannot meet the step's budget, and
    ``smallest_bytes`` is the smallest the step reaches, ``detail`` each graph's part.
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
    ) -> None:
        self.graph = graph
        self.option = option
        self.budget_bytes = budget_bytes
        self.smallest_bytes = smallest_bytes
        self.suggestions = list(suggestions)
        self.sizes = sizes
        self.scope = scope
        hint = ("; to go lower: " + ", ".join(suggestions)) if suggestions else ""
        at = f" at {sizes}" if sizes else ""
        if scope == "step":
            self.summary = (
                f"fxckpt: {graph} cannot meet memory_budget={budget_bytes} bytes for the "
                f"step: the smallest the step reaches is {smallest_bytes} bytes "
                f"({detail}){hint}."
            )
        elif option == "peak_budget":
            self.summary = (
                f"fxckpt: graph {graph!r} cannot meet peak_budget={budget_bytes} bytes{at}: the "
                f"smallest step peak the planner reaches there is {smallest_bytes} bytes (saved "
                f"activations, what the backward rebuilds and restores, gradients and "
                f"temporaries){hint}."
            )
        else:
            self.summary = (
                f"fxckpt: graph {graph!r} cannot meet {option}{at}: it leaves the saved "
                f"activations {budget_bytes} bytes, and the smallest resident peak the planner "
                f"reaches there is {smallest_bytes} bytes{hint}."
                if option != "memory_budget" else
                f"fxckpt: graph {graph!r} cannot meet memory_budget={budget_bytes} bytes{at}: "
                f"the smallest resident peak the planner reaches there is {smallest_bytes} "
                f"bytes{hint}."
            )  # fmt: skip
        super().__init__(
            f"{self.summary} Raise {option}, or pass on_infeasible='warn' to run the "
            "smallest plan."
        )


class RuntimeCopyError(FxckptError, RuntimeError):
    """A host/device copy of an offloaded activation failed."""
