"""Exceptions that bagualu2 raises for conditions a user can act on."""

from __future__ import annotations

__all__ = ["BudgetExceededError", "InfeasibleBudgetError"]


class BudgetExceededError(RuntimeError):
    """Resident activation bytes went over the budget (raised with ``on_exceed="raise"``).

    On a device this is the point where the job would have run out of memory. ``resident`` and
    ``budget`` are in bytes; ``where`` names the operator whose activation crossed the line.
    """

    def __init__(self, resident: int, budget: int, where: str) -> None:
        self.resident = resident
        self.budget = budget
        self.where = where
        super().__init__(
            f"activation bytes {resident:,} exceed the budget {budget:,} by {resident - budget:,} "
            f"at {where}; use policy='adaptive' or raise the budget"
        )


class InfeasibleBudgetError(ValueError):
    """No plan fits the budget: even releasing every activation that can be released leaves too
    many bytes resident. Raised before anything of the micro-batch is allocated."""

    def __init__(self, budget: int, floor: int, where: str) -> None:
        self.budget = budget
        self.floor = floor
        self.where = where
        super().__init__(
            f"budget {budget:,} bytes cannot be met at {where}: even with every activation "
            f"offloaded or recomputed, {floor:,} bytes stay resident; raise the budget to at least "
            f"{floor:,} bytes or shrink the micro-batch"
        )
