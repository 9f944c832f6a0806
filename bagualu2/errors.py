"""Exceptions that bagualu2 raises for conditions a user can act on."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["BudgetExceededError", "ExactnessError", "InfeasibleBudgetError", "exceed_hint", "recorded_memory_violation",
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
    many bytes resident. Raised before anything of the micro-batch is allocated. ``budget`` is the
    whole budget; ``outside``, what an allocator view showed allocated beyond the activations (0
    without one), which the activations' ``floor`` must fit beside."""

    def __init__(self, budget: int, floor: int, where: str, outside: int = 0) -> None:
        self.budget = budget
        self.floor = floor
        self.where = where
        self.outside = outside  # what an allocator view showed allocated beyond the activations
        head = f"budget {budget:,} bytes cannot be met at {where}"
        if outside:
            head += (f": the allocator shows {outside:,} bytes allocated beyond the activations, which "
                     f"leaves them {max(0, budget - outside):,}")
        super().__init__(
            f"{head}: even with every activation offloaded or recomputed, {floor:,} bytes of them stay "
            f"resident; raise the budget to at least {floor + outside:,} bytes or shrink the micro-batch"
        )


class ExactnessError(RuntimeError):
    """A released activation came back to backward different from what autograd saved
    (``enable(verify=...)``): the gradients of that backward pass are not the model's.

    ``key`` is the operator whose saved tensor differs, ``micro_batch`` the provisioned forward
    that saved it (counted from 1 since ``enable``), ``how`` the way it was released
    (``"offloaded"``, ``"recomputed"``, ``"rerun"``), and ``index`` the flat index of the first
    sampled element that differs, with its ``expected`` and ``got`` values (all None when only
    the checksum over every element differs).
    """

    def __init__(self, key: str, micro_batch: int, how: str, index: Optional[int], expected: Any, got: Any) -> None:
        self.key = key
        self.micro_batch = micro_batch
        self.how = how
        self.index = index
        self.expected = expected
        self.got = got
        where = (f"element {index} was {expected!r} and came back {got!r}" if index is not None
                 else "the checksum over its elements differs (no sampled element does)")
        super().__init__(
            f"bagualu2: the activation of {key} from micro-batch {micro_batch}, {how} in forward, came back "
            f"different in backward: {where}. Something wrote it where bagualu2 could not see (through .data, "
            f"a NumPy or DLPack alias), a block read state its rerun no longer finds, or this is a bagualu2 "
            f"bug: keep that operator (a fixed plan) and report it")
