"""The provisioner's learned state, saved with a training checkpoint and loaded on resume.

Owns ``save`` and ``load``, which ``Provisioner.state_dict`` / ``load_state_dict`` call
(torch's ``Stateful`` convention, so ``torch.distributed.checkpoint`` saves the provisioner
beside the model and the optimizer), and ``signature``, what a state is checked against.

A state holds what decisions are made from (the provisioner's pieces, ``Learned.pieces``: the
cost model, the footprint, the routing record, the stacking, the calibration count, the
unplanned keys, the excess) and a few counters the provisioner passes (``RunCounters.saved``);
a resumed run with it decides as the run that saved it would have: no micro-batch is profiled
or calibrated again, and one that the saved run would have planned is planned.

Format: ``{"rank_<r>": {"version", "gates", "modules", "learned"}}``, ``r`` this process's rank
in the default process group (0 without one). Each rank saves its own entry (expert-parallel
ranks see different loads), under its own key, as torchtitan's data loader does, so a
checkpointer that merges every rank's state keeps them apart; the values are an int, strings
and bytes (a checkpointer replaces such values on load rather than filling tensors in place,
so a fresh provisioner's own ``state_dict()`` is a valid template to load into). ``learned``
is a pickle read back with an unpickler that makes nothing but bagualu2's own classes and
plain containers.

Invariants: a state from another version, another model (its modules or gates differ; its
profiled operators differ from this provisioner's, when both profiled) or another rank layout
is refused with a ``ValueError`` naming the first difference; a state that cannot be read whole
(truncated, corrupt, a field missing) is refused before anything is changed: ``load`` checks
and reads everything first, then changes the pieces in place, with steps that cannot fail.
Pieces keep their identity (objects that hold one, such as ``GateDecisions``, see the loaded
state); references between pieces are saved as references.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Dict, Mapping, Sequence

import torch

from bagualu2.plan.cost_model import GROUPED
from bagualu2.provision.excess import WholeMemory

__all__ = ["VERSION", "load", "rank_key", "save", "signature"]

VERSION = 4
"""4: the footprint learns what tracing itself pins (``Footprint.traced_bytes``); a version-3 (or
older) state is read with none seen yet. 3: the excess an allocator view taught
(``provision/excess.py``) is a piece; a version-2 or -1 state is read with nothing learned of it.
2: the cost model's grouped-expert index became ``GROUPED = -2`` (it was -1, the value of
``SIZE``); a version-1 state is still read, its grouped operators' -1 as ``GROUPED``."""
_FIELDS = ("version", "gates", "modules", "learned")


def _from_version_3(fields: Dict[str, Any]) -> None:
    """A version-3 footprint never measured what tracing pins: read as none seen yet."""
    fields.get("footprint", {}).setdefault("traced_bytes", 0)


def _from_version_2(fields: Dict[str, Any]) -> None:
    """A version-2 state has no excess piece: it is read as one that learned nothing."""
    fields.setdefault("excess", dict(vars(WholeMemory())))
    _from_version_3(fields)


def _from_version_1(fields: Dict[str, Any]) -> None:
    """A version-1 state's grouped operators, expert -1, read as ``GROUPED`` (no other op has a
    negative expert). Only the freshly read objects change: pieces are objects of their own."""
    memory = fields.get("cost", {}).get("memory")
    for op in getattr(memory, "ops", {}).values():
        if op.expert == -1:
            op.expert = GROUPED
    _from_version_2(fields)


# version -> what brings its fields to this one
_READS = {1: _from_version_1, 2: _from_version_2, 3: _from_version_3, VERSION: lambda fields: None}


def rank_key() -> str:
    """This process's key in a state: its rank in the default process group, 0 without one."""
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"rank_{rank}"


def signature(model: torch.nn.Module, gates: Sequence[Any]) -> Dict[str, str]:
    """What a state must match: the gates (path, MoE layer, experts) and the modules (path,
    type, and the shape and dtype of their own parameters: what names and sizes operators),
    one line each."""
    lines = []
    for name, module in model.named_modules():
        params = ", ".join(f"{p}{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                           for p, t in module.named_parameters(recurse=False))
        lines.append(f"{name or '<root>'}: {type(module).__name__}" + (f" [{params}]" if params else ""))
    return {"gates": "\n".join(f"{g.name}: layer {g.layer}, {g.num_experts} experts" for g in gates),
            "modules": "\n".join(lines)}


class _Refs(pickle.Pickler):
    """Pickles the pieces' fields; a piece referred to from another is saved as its name."""

    def __init__(self, file: io.BytesIO, pieces: Mapping[str, Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._names = {id(obj): name for name, obj in pieces.items()}

    def persistent_id(self, obj: Any) -> Any:
        return self._names.get(id(obj))


class _Reader(pickle.Unpickler):
    """Reads what ``_Refs`` wrote: makes bagualu2's classes and plain containers only, and
    resolves a piece's name to this provisioner's piece."""

    def __init__(self, data: bytes, pieces: Mapping[str, Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._pieces = pieces

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("bagualu2.") or (module, name) in (("collections", "deque"), ("builtins", "set"),
                                                                   ("builtins", "frozenset")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a bagualu2 state")

    def persistent_load(self, pid: Any) -> Any:
        if pid not in self._pieces:
            raise pickle.UnpicklingError(f"reference to an unknown piece {pid!r}")
        return self._pieces[pid]


def save(pieces: Mapping[str, Any], counters: Mapping[str, Any], sig: Mapping[str, str]) -> Dict[str, Any]:
    """This rank's state: the fields of each of ``pieces`` (name -> object), ``counters``
    (plain values the caller restores itself) and the signature ``sig``."""
    out = io.BytesIO()
    _Refs(out, pieces).dump({"pieces": {name: dict(vars(obj)) for name, obj in pieces.items()},
                             "counters": dict(counters)})
    return {rank_key(): {"version": VERSION, "gates": sig["gates"], "modules": sig["modules"],
                         "learned": out.getvalue()}}


def _first_difference(saved: str, here: str) -> str:
    a, b = saved.split("\n"), here.split("\n")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i}: saved {x!r}, here {y!r}"
    return f"saved {len(a)} entries, here {len(b)}" + (f" (first extra: {(a + b)[min(len(a), len(b))]!r})")


def load(state_dict: Mapping[str, Any], pieces: Mapping[str, Any], sig: Mapping[str, str],
         order: Sequence[str]) -> Dict[str, Any]:
    """Check ``state_dict`` against this rank, version and signature ``sig`` (and, when this
    provisioner has profiled, its operator keys ``order``), then put the saved fields into
    ``pieces`` in place; returns the saved counters. ValueError naming the mismatch, before
    anything changes."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"bagualu2: a provisioner state is a dict from state_dict(), got {type(state_dict).__name__}")
    key = rank_key()
    if key not in state_dict:
        raise ValueError(f"bagualu2: the provisioner state has no entry for this process ({key}); it has "
                         f"{sorted(state_dict)[:8]}: it was saved by a job with other ranks. Resume with the "
                         f"same ranks, or start this provisioner without a state (it profiles again)")
    entry = state_dict[key]
    missing = [f for f in _FIELDS if not isinstance(entry, Mapping) or f not in entry]
    if missing:
        raise ValueError(f"bagualu2: the provisioner state of {key} is partial: {missing} missing; it was not "
                         f"loaded (save a whole state_dict())")
    if entry["version"] not in _READS:
        raise ValueError(f"bagualu2: the provisioner state of {key} has version {entry['version']!r}; this "
                         f"bagualu2 reads versions {sorted(_READS)}; it was not loaded")
    for field in ("gates", "modules"):
        if entry[field] != sig[field]:
            raise ValueError(f"bagualu2: the provisioner state of {key} is another model's: its {field} differ "
                             f"({_first_difference(str(entry[field]), sig[field])}); it was not loaded")
    try:
        learned = _Reader(bytes(entry["learned"]), pieces).load()
        fields, counters = learned["pieces"], learned["counters"]
        if isinstance(fields, dict):
            _READS[entry["version"]](fields)
        bad = sorted(set(pieces) ^ set(fields))
        if bad or not all(isinstance(f, dict) for f in fields.values()) or not isinstance(counters, dict):
            raise ValueError(f"pieces {bad} missing or unexpected" if bad else "fields of the wrong type")
    except Exception as e:  # noqa: BLE001 - any failure to read it whole is the one error named below
        raise ValueError(f"bagualu2: the provisioner state of {key} cannot be read whole ({type(e).__name__}: "
                         f"{e}); it is truncated or corrupt, and was not loaded") from e
    saved_order = list(fields["cost"]["memory"].order) if "cost" in fields and "memory" in fields["cost"] else []
    if order and saved_order and list(order) != saved_order:
        raise ValueError(f"bagualu2: the provisioner state of {key} is another model's: its operators differ "
                         f"({_first_difference(chr(10).join(saved_order), chr(10).join(order))}); it was not "
                         f"loaded")
    for name, obj in pieces.items():  # from here on, nothing can fail
        own = vars(obj)
        own.clear()
        own.update(fields[name])
    return counters
