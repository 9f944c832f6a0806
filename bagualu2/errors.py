"""Exceptions that bagualu2 raises for conditions a user can act on."""

from __future__ import annotations

__all__ = ["BudgetExceededError", "InfeasibleBudgetError", "exceed_hint", "recorded_memory_violation",
           "recorded_violation"]


def exceed_hint(policy: str) -> str:
    """What would keep a run under its budget, for the policy that crossed it (``"adaptive"``,
    ``"keep_all"``, ``"recompute_all"``, ``"offload_all"``, or ``"static"`` for a fixed plan)."""
    if policy == "adaptive":
        # Adaptive releases all a plan can name; what crossed is what no plan releases (inputs,
        # labels, a save of an untraced forward with no copy engine to offload it to).
        return ("adaptive already releases what it can, so what crossed is held by nothing a plan "
                "releases: raise the budget or shrink the micro-batch")
    if policy == "recompute_all":
        return "recompute_all releases all it can already: raise the budget or shrink the micro-batch"
    return (f"policy {policy!r} does not adapt to the routing: use policy='adaptive' (it keeps, "
            f"offloads or recomputes per micro-batch to fit) or raise the budget")


def recorded_violation(micro_batch: int, budget: int, peak: int, violations: int, policy: str) -> str:
    """The warning ``on_exceed="record"`` gives at a provisioner's first violation: on a device it
    would have been an out-of-memory crash, and a recorded count alone goes unread."""
    return (f"bagualu2: micro-batch {micro_batch} went over the activation budget ({budget:,} bytes): "
            f"peak {peak:,} bytes, {violations} save(s) over it. {exceed_hint(policy)}. Recorded, not raised "
            f"(on_exceed='record'): report()['violations'] counts them; this warning is shown once per provisioner")


def recorded_memory_violation(micro_batch: int, budget: int, peak: int) -> str:
    """The warning at a provisioner's first whole-memory crossing, which its allocator view shows
    as the next forward begins (an activation limit crossed warns through ``recorded_violation``)."""
    return (f"bagualu2: the allocator's peak {peak:,} bytes from micro-batch {micro_batch} to the next crossed the "
            f"budget ({budget:,} bytes): what lies outside the activations grew beyond what was left for it; it is "
            f"now left for at that load. report()['memory_violations'] counts such micro-batches; this warning "
            f"is shown once per provisioner")


class BudgetExceededError(RuntimeError):
    """Resident activation bytes went over the budget (raised with ``on_exceed="raise"``).

    On a device this is the point where the job would have run out of memory. ``resident`` and
    ``budget`` are in bytes; ``where`` names the operator whose activation crossed the line;
    ``policy`` is the provisioner's (the message says what would help under it).
    """

    def __init__(self, resident: int, budget: int, where: str, policy: str = "adaptive") -> None:
        self.resident = resident
        self.budget = budget
        self.where = where
        self.policy = policy
        super().__init__(
            f"activation bytes {resident:,} exceed the budget {budget:,} by {resident - budget:,} "
            f"at {where}; {exceed_hint(policy)}"
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
