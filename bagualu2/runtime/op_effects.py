"""Op effects: what an operator does besides returning its outputs, read once per overload.

Owns ``OpInfo`` (per ``OpOverload``: printable name, which arguments it writes, whether it is
random, and why it cannot be replayed) and the rules behind it: schema aliasing annotations,
the argument-name rules for c10d collectives whose schemas declare no writes, and the aten ops
that write running statistics without declaring it. ``TracingMode`` asks it what each op
wrote; ``Step.name`` asks it for the op's name.

Invariants: an op's facts depend only on its overload, so they are computed once and cached by
the overload's identity (the info holds the overload, so the id is never reused). An op is
replayable only when a replay repeats no effect outside the storages it makes: collectives
(a replay on one rank would desynchronize the ranks), ops from outside aten and prims, and the
batch-norm ops that update running statistics are never replayed. A tensor a collective only
reads is never counted as written, so a saved activation that was sent is not taken for
modified at its unpack.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator

import torch

__all__ = ["OpInfo", "written_tensors"]


# aten ops that update their running_mean / running_var arguments in place although their
# schemas do not mark them written: replaying one would update the statistics a second time.
_UNDECLARED_WRITES = frozenset({
    "aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm",
    "aten::batch_norm_update_stats", "aten::batch_norm_gather_stats_with_counts",
})

# Namespaces of collectives. Their ops write into tensors they were given without their schemas
# saying so (``c10d::alltoall_base_`` fills its output, ``_c10d_functional::wait_tensor`` is
# where a functional collective's result becomes valid), and replaying one in backward would
# issue a collective on one rank only: a deadlock, or ranks out of step.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor", "symm_mem"})


def _tensor_arg(arg: Any) -> bool:
    """Whether a schema argument holds tensors (``Tensor``, ``Tensor?``, ``Tensor[]``, ...)."""
    return "Tensor" in str(arg.type)


# Collectives that only read their tensors.
_SENDS = frozenset({"send", "isend"})


def _collective_writes(arg: Any, op_name: str) -> bool:
    """Whether a collective writes ``arg``: c10d's schemas declare no writes, but name what a
    collective reads ``input*`` (all-gather, all-to-all, reduce-scatter: ``output*`` is written)
    and what it updates in place ``tensors`` (all-reduce, broadcast, receive), and
    ``wait_tensor``'s ``tensor`` is where a functional collective's result becomes valid. A
    tensor a collective only reads must not count as written: a saved activation that was sent
    would look modified at its unpack."""
    return (_tensor_arg(arg) and op_name not in _SENDS and not arg.name.startswith("input")
            and arg.name != "sparse_indices")


def _is_collective(func: Any) -> bool:
    schema = func._schema
    return func.namespace in _COLLECTIVE_NAMESPACES or any(
        "c10d" in str(a.type) for a in (*schema.arguments, *schema.returns))


def _declares_writes(func: Any) -> bool:
    """Whether ``func``'s schema annotates what it writes: aten and prims ops do, and so does any
    op whose schema annotates aliasing at all. c10d's collectives annotate nothing."""
    if func.namespace in ("aten", "prims"):
        return True
    schema = func._schema
    return any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))


class OpInfo:
    """Per-OpOverload facts computed once: printable name, written args, random, and why it
    cannot be replayed ("" when it can).

    Which arguments an op writes: what its schema declares; for collectives whose schemas
    declare nothing (c10d's), what ``_collective_writes`` reads from their argument names. Other
    ops are taken at their schemas' word, as torch's functionalization takes them: a custom op
    that writes without declaring it is outside what the tracer can see. Collectives and ops
    from outside aten are never replayed: what they wrote or made is kept or offloaded, and a
    recompute chain stops there.
    """

    __slots__ = ("func", "name", "written", "random", "why_not", "replayable", "collective")
    _cache: Dict[int, "OpInfo"] = {}

    def __init__(self, func: Any) -> None:
        self.func = func
        self.name = str(func)
        schema = func._schema
        self.collective = _is_collective(func)
        if self.collective and not _declares_writes(func):
            op_name = schema.name.partition("::")[2]
            self.written = tuple(i for i, a in enumerate(schema.arguments) if _collective_writes(a, op_name))
        else:
            self.written = tuple(
                i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
            )
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        if self.collective:
            self.why_not = f"{self.name} is a collective: replaying it in backward would desynchronize ranks"
        elif func.namespace not in ("aten", "prims"):
            self.why_not = f"{self.name} is not an aten op"
        elif schema.name in _UNDECLARED_WRITES:
            self.why_not = f"{self.name} updates running statistics in place: a replay would update them again"
        else:
            self.why_not = ""
        self.replayable = not self.why_not

    @classmethod
    def of(cls, func: Any) -> "OpInfo":
        # Keyed by id: an OpOverload hashes in Python, and lives as long as its op (the info
        # holds it, so the id is never reused).
        info = cls._cache.get(id(func))
        if info is None:
            info = cls._cache[id(func)] = OpInfo(func)
        return info


def written_tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors in a written argument (a tensor, or lists of them: ``Tensor(a!)[]``)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from written_tensors(v)
