"""The runtime's side of compiled regions: a region call is one plan unit of its frame.

Owns ``CompiledRegions``, which the activation runtime owns (``runtime.regions``) to enter and
leave a region call and pack what it saves; the record of one region call while it runs
(``RegionState``) is a part of its frame's runtime state, in ``bagualu2.runtime.frame``. Which modules
are regions and their keys are in ``bagualu2.runtime.regions``.

Design note
-----------
At a region's entry (a hook that runs outside compiled code) the tracing mode leaves torch's
dispatch stack, so Dynamo never sees it, and the call's inputs, RNG and autocast states are
held in a ``BlockRerun`` when the region may be recomputed. The saved-tensor hooks stay on:
the region's saves reach the pack hook when its forward returns, and its choice
(``Frame.choice("<path>:compiled")``) is read at the first of them, so a gate inside the
region (``regions.report_gate``) may still set it. KEEP: kept, counted (offloaded instead when
that would cross an enforced budget); OFFLOAD: each storage copied once to the host arena and
reloaded, prefetched, in backward; RECOMPUTE: packed as indices into the ``BlockRerun``, which
reruns the region whole at its first unpack (the compiled code again, no recompile). At the
exit the tracing mode is back on the stack, and the region's saved bytes (and, in a profiled
frame, its forward seconds) are recorded under its key for the cost model.

Invariants: bit-exactness as for blocks (``rerun.py``); a region that may issue collectives
(``regions.holds_collectives``), is called with an object its forward may change
(``rerun.unrestorable``) or was seen writing its own inputs, parameters or buffers in place is
never recomputed (offloaded instead; its first call planned to be rerun reruns from copies of
its inputs and buffers, taken as it begins, since a region split by graph breaks packs its first
saves before the rest of it runs, and compiled code writes a buffer after its saves): nothing
bagualu2 does in backward issues a collective; nothing of bagualu2 runs inside the compiled
code but ``report_gate``.

A rerun reads, besides the inputs it holds, whatever the region's code reads as backward finds
it, and no tracer sees those reads inside compiled code (issue #61). So a call is recomputed
only if what its compiled code reads is known to be its arguments and parameters and buffers of
the region's own modules (``regions.CompiledReads``, read off Dynamo's guards as the call
begins); any other read (a tensor an earlier block stashed on a module or in a container, a
global), a graph break, or code that could not be inspected offloads the call instead, counted
as a fallback naming why. The parameters and buffers it reads are held with their versions as
the call began (``BlockRerun.snapshot``, ``watch``): its rerun refuses, naming the tensor, if
one was written in place or rebound since, as autograd refuses a saved tensor written in place.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from bagualu2.shared import Choice
from bagualu2.runtime.frame import Frame, RegionState
from bagualu2.runtime.ledger import Kept, Pin
from bagualu2.runtime.recipes import is_plain, is_recomputing, view_meta
from bagualu2.runtime.regions import CompiledReads, region_key
from bagualu2.runtime.rerun import BlockRerun, unrestorable
from bagualu2.runtime.residency import Residency
from bagualu2.runtime.stores import _Offloaded

__all__ = ["CompiledRegions", "RegionState"]


class CompiledRegions:
    """Entering, leaving and packing compiled region calls (see the module note): the part of
    an ``ActivationRuntime`` that its compiled regions need, owned by it (``runtime.regions``),
    carrying out what regions save through the runtime's ``residency``."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        self.mode = residency.mode
        self.ledger = residency.ledger
        # Region keys whose calls were seen to leave their inputs as they found them, and those
        # seen writing them in place (never rerun: a rerun would start from the written inputs).
        self._vetted: Set[str] = set()
        self._write_inputs: Set[str] = set()
        # What the compiled code of the region call running now reads (when it may be rerun).
        self._reads: Optional[CompiledReads] = None

    def hooks(self, name: str, block: bool, rerunnable: bool = True
                      ) -> Tuple[Callable[..., None], Callable[..., None]]:
        """The entry and exit of the compiled region at ``name`` (``block``: an outermost block;
        ``rerunnable``: it issues no collective, see ``regions.holds_collectives``)."""

        def enter(mod: torch.nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
            frame = self.residency.frame
            if frame is None or not frame.traced or self.mode.suspended or frame.runtime_state.rerun is not None:
                return
            if block:
                frame.runtime_state.past_blocks = False
            self.enter(mod, name, args, kwargs, rerunnable)

        def leave(mod: torch.nn.Module, args: tuple, out: Any, failed: bool = False) -> None:
            frame = self.residency.frame
            if frame is None or frame.runtime_state.region is None:
                return
            self.leave()
            if block:
                frame.runtime_state.past_blocks = True

        return enter, leave

    def enter(self, module: Any, path: str, args: tuple, kwargs: Dict[str, Any],
                     rerunnable: bool = True) -> None:
        """A region call begins (``module``: what a rerun calls again with ``args``; not
        ``rerunnable``: never recomputed)."""
        frame = self.residency.frame
        run = frame.runtime_state if frame is not None else None
        if run is None or run.region is not None or run.rerun is not None or is_recomputing():
            return
        modes = _get_current_dispatch_mode_stack()
        tracing = bool(modes) and modes[-1] is self.mode
        if tracing:
            self.mode.__exit__(None, None, None)  # Dynamo must never trace into the mode
        key = region_key(path)
        rerun = None
        enforced = self.residency.enforce_budget
        if rerunnable and key not in self._write_inputs and (
                frame.choice(key) == Choice.RECOMPUTE or enforced or key in frame.choices):
            flat, spec = tree_flatten((args, kwargs))
            if unrestorable(flat) is None:
                rerun = BlockRerun(module, path or "the compiled model", flat, spec, self.residency.pin_leaf,
                                   lambda s: Pin(self.ledger, s))
                if key not in self._vetted and frame.choice(key) == Choice.RECOMPUTE:
                    # Its first call planned to be rerun: it may write its inputs (see ``leave``).
                    rerun.hold_copies()
        # Read off Dynamo's guards as the call begins (see ``regions.CompiledReads``).
        self._reads = CompiledReads(module, args, kwargs) if rerun is not None else None
        if rerun is not None and self._reads.module is not None:
            rerun.snapshot(self._reads.module)
        frame.runtime_state.region = RegionState(key, rerun, tracing)

    def running(self) -> Optional[Tuple[str, Choice, int]]:
        """The compiled region call running in the frame now, once its first save has read its
        choice (what the rest of its saves follow): ``(key, choice, bytes it saved so far)``;
        None when no region runs or it has saved nothing yet. A gate inside a region that a
        graph break splits fires after the part before the break saved: the region is no
        longer the gate's to plan, and what it saved is already resident."""
        frame = self.residency.frame
        state = frame.runtime_state.region if frame is not None else None
        if state is None or state.choice is None:
            return None
        return state.key, state.choice, sum(state.storages.values())

    def leave(self) -> None:
        """The region call running in the frame ended (returned or raised)."""
        frame = self.residency.frame
        state = frame.runtime_state.region if frame is not None else None
        if state is None:
            return
        frame.runtime_state.region = None
        self._reads = None
        if state.tracing:
            self.mode.__enter__()
        nbytes = sum(state.storages.values())
        frame.keys_seen.setdefault(state.key, nbytes)
        if state.rerun is not None and state.rerun.holds_copies:
            # A region's first call reruns from copies of its inputs: its first saves were packed
            # before the rest of its code ran (a graph break ends a graph), so whether it writes
            # its inputs is known only now. One that does keeps its copies and is never rerun again.
            if state.rerun.inputs_written() or state.rerun.state_written():
                self._write_inputs.add(state.key)
            else:
                state.rerun.drop_copies()
                self._vetted.add(state.key)
        elif state.rerun is not None and state.rerun.state_written():
            # It wrote a parameter or buffer it reads, seen only now: its rerun refuses (the
            # error names it); its later calls are not rerun.
            self._write_inputs.add(state.key)
        if state.choice == Choice.RECOMPUTE and state.rerun is not None:
            frame.stats.rerun_blocks += 1
            frame.stats.bytes_by_choice["recompute"] += nbytes
            state.rerun.storages.clear()
        if frame.profile:
            frame.region_profile[state.key] = (nbytes, time.perf_counter() - state.start)

    def pack(self, frame: Frame, state: RegionState, t: torch.Tensor) -> Any:
        """Pack one tensor a region saved, as the region's choice says."""
        frame.stats.packed += 1
        if state.choice is None:
            choice = frame.choice(state.key)
            if choice == Choice.RECOMPUTE and state.rerun is None:
                frame.stats.fallbacks.append(f"{state.key}: recompute -> offload (it issues collectives, is "
                                             f"called with an object its forward may change, or writes its "
                                             f"own inputs or state in place)")
                choice = Choice.OFFLOAD
            elif choice == Choice.RECOMPUTE:
                why, read = self._reads.result() if self._reads is not None else ("its reads are unknown", [])
                if why is not None:
                    frame.stats.fallbacks.append(f"{state.key}: recompute -> offload ({why})")
                    choice = Choice.OFFLOAD
                else:
                    state.rerun.watch(read)
            state.choice = choice
            if choice != Choice.RECOMPUTE:
                state.rerun = None  # its inputs need not be held
        counted = is_plain(t) and not self.residency.is_parameter(t)
        if state.choice == Choice.RECOMPUTE:
            assert state.rerun is not None
            packed = state.rerun.save(t, counted)
            if counted:
                storage = t.untyped_storage()
                state.storages.setdefault(storage._cdata, storage.nbytes())
            return packed
        if not counted:
            return Kept(t)
        storage = t.untyped_storage()
        state.storages.setdefault(storage._cdata, storage.nbytes())
        store = frame.runtime_state.offloaded(storage, t._version)
        if store is not None:  # another saved view of a storage offloaded in this frame
            frame.stats.shared_bytes += storage.nbytes()
            return _Offloaded(store, view_meta(t), None, t._version, t)
        if state.choice == Choice.KEEP:
            if not self.residency.over_budget(storage):
                return self.residency.keep(frame, t, storage)
            self.residency.settle(wait=True)
            if not self.residency.over_budget(storage):
                return self.residency.keep(frame, t, storage)
            if not self.residency.enforce_budget:
                return self.residency.violate(frame, t, state.key)
            frame.stats.fallbacks.append(f"{state.key}: keep -> offload (budget)")
        store = self.residency.start_offload(frame, storage, state.key)
        if store is None:
            frame.stats.fallbacks.append(f"{state.key}: offload -> keep (arena full or no engine)")
            if self.residency.over_budget(storage):
                return self.residency.violate(frame, t, state.key)
            return self.residency.keep(frame, t, storage)
        frame.runtime_state.note_offload(storage, t._version, store)
        return _Offloaded(store, view_meta(t), None, t._version, t)

