"""Saved-tensor runtime: applies KEEP / OFFLOAD / RECOMPUTE to every saved activation.

Design note
-----------
While a provisioned forward runs (a *frame*, one micro-batch), ``ActivationRuntime`` has a
``TracingMode`` and a pair of saved-tensor hooks installed. For every tensor autograd saves, the
pack hook finds the storage's ``StorageNode`` (its producing op) and applies that op's choice
from the frame's plan:

* KEEP: the tensor itself is held, as autograd would.
* OFFLOAD: the whole storage is copied once into the ``HostArena`` through the ``CopyEngine``;
  every saved view of it refers to that one copy. Backward reloads it, prefetching the next
  offloaded storages of the frame (in reverse pack order) so the copy overlaps compute.
* RECOMPUTE: nothing is held but the node; unpack replays the recipe (``Replayer``), rebuilding
  inputs that were dropped or offloaded first, in dependency order. A frame that recomputes
  whole blocks (``Frame.rerun_blocks``) runs them untraced instead and reruns each in backward
  (``BlockRerun``).

A traced frame whose plan releases from a few outermost blocks only (``Frame.released_modules``)
runs the rest untraced, its saves kept as an untraced frame's are (``runtime.calm_blocks``).

This module owns the deciding half: frames (and closing what an interrupt left open), the
module hooks that name operators and run blocks untraced, and the pack hook. Carrying the
choices out (the ledger, the budget, kept storages, offloads, the unpack hook) is the
``Residency`` it owns (``runtime.residency``; ``bagualu2.runtime.residency``, which states the
accounting and budget invariants); what a save becomes is in ``bagualu2.runtime.stores``.

Invariants:

* Exactness: the tensor unpack returns is bitwise equal to, and has the same size, strides,
  storage offset and dtype as, the tensor that was packed.
* Nothing lost: data is freed only with the packed objects that own it. Autograd drops those
  when the graph dies (after backward, or when the graph is discarded without one), so a packed
  activation may be unpacked any number of times (``retain_graph``) or never.
* Budget: with ``enforce_budget`` set, a storage that would push the ledger over the budget is
  offloaded or recomputed instead of kept (waiting for in-flight offloads first); what cannot be
  released is a violation, reported through ``on_exceed``. An untraced frame (one whose plan was
  not expected to release anything) has no recipes, so there such a storage is offloaded.
  A rerun block's captured saves are the one exception to backward holding within the budget
  (``Residency``): one rerun makes them all.
* Fallbacks never lose data: an offload the arena cannot take becomes a recompute (or a keep),
  a recompute that cannot be replayed becomes an offload (or a keep), an offload whose copy
  fails keeps its device source (``OffloadStore.settle``), and each is recorded. A reload that
  fails raises, naming the activation.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_flatten

from bagualu2.shared import Choice, Event
from bagualu2.runtime.attachment import AttachedHook, Hooks, _Attachment
from bagualu2.runtime import calm_blocks
from bagualu2.runtime.compiled import CompiledRegions
from bagualu2.runtime.frame import Frame, TraceScope, check_keys, profile_saves
from bagualu2.runtime.ledger import _drain_failed_backward, _drain_graph, CalmPack, Kept, KeptUnpack, Pin
from bagualu2.runtime.residency import Residency
from bagualu2.runtime.rerun import BlockRerun, RerunSaved, unrestorable
from bagualu2.runtime.regions import compiled_regions, holds_collectives
from bagualu2.runtime.stores import _Offloaded, _Recomputed, observed_hook, regeneration_source
from bagualu2.runtime.verify import Fingerprint, Verifier
from bagualu2.runtime.recipes import StorageNode, ViewMeta, is_plain, recipe_refs, view_meta

__all__ = ["ActivationRuntime", "AttachedHook"]


class _Checked:
    """A released save with the fingerprint ``enable(verify=...)`` took of it."""

    __slots__ = ("packed", "fingerprint")

    def __init__(self, packed: Any, fingerprint: Fingerprint) -> None:
        self.packed = packed
        self.fingerprint = fingerprint


def _refuse_outer_hooks() -> None:
    """Raise when the provisioned forward is about to run inside saved-tensor hooks of someone
    else's (``torch.autograd.graph.save_on_cpu``, a framework's activation offloading): only the
    innermost pair applies, so bagualu2's would hide every save of the forward from them, and
    the two would each count on deciding what stays on the device."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return
    pack = hooks[0]
    name = f"{getattr(pack, '__module__', None) or type(pack).__module__}." \
           f"{getattr(pack, '__qualname__', None) or type(pack).__qualname__}"
    raise RuntimeError(
        f"bagualu2: the provisioned forward runs inside other saved-tensor hooks (pack hook {name}, e.g. "
        f"torch.autograd.graph.save_on_cpu or a training framework's activation offloading). Only the "
        f"innermost hooks apply, so bagualu2's would take every save of this forward from them: turn the "
        f"outer offloading off for the model bagualu2 provisions (bagualu2 offloads per operator itself), or "
        f"use those hooks inside a block instead (hooks inside bagualu2's apply there, exactly)")


class ActivationRuntime:
    """Applies per-operator KEEP / OFFLOAD / RECOMPUTE choices to saved activations: picks each
    save's choice here; the ``Residency`` it owns (``residency``) holds, counts and serves back
    what was picked, within the budget.

    Args:
        engine: a ``bagualu2.CopyEngine`` for OFFLOAD, or None (OFFLOAD then falls back).
        min_bytes: storages smaller than this are kept, unless keeping one would cross the budget.
        budget_bytes: the activation budget the ledger is held to, or None for no budget; a
            frame with a ``Budget`` of its own is held to that while its forward runs.
        enforce_budget: release (offload, else recompute) a storage that would exceed the budget
            instead of keeping it. Static baselines turn this off to show what they would do.
        on_exceed: called with (resident, budget, key) when the budget is exceeded anyway; it may
            raise (``on_exceed="raise"`` in ``bagualu2.enable``).
        prefetch_bytes: how far ahead of use backward reloads offloaded storages.
        reload_in_place: backward reads an offloaded cpu storage where it lies in the host arena
            instead of copying it back (see ``OffloadStore``); False copies it back as on a
            device (the way to exercise reloads and prefetches on a cpu-only machine).
        verify, on_mismatch: the exactness check of what is released (``bagualu2.runtime.verify``):
            ``"off"``, ``"sample"`` or ``"all"``; ``"raise"`` or ``"fallback"``.
    """

    def __init__(self, engine: Any = None, *, min_bytes: int = 0, budget_bytes: Optional[int] = None,
                 enforce_budget: bool = True,
                 on_exceed: Optional[Callable[[int, int, str], None]] = None,
                 prefetch_bytes: int = 64 << 20, reload_in_place: bool = True, verify: str = "off",
                 on_mismatch: str = "raise") -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes={min_bytes} must be >= 0")
        # What is held, within which budget, and how backward gets it back: the runtime's own.
        self.residency = Residency(engine, budget_bytes=budget_bytes, enforce_budget=enforce_budget,
                                   on_exceed=on_exceed, prefetch_bytes=prefetch_bytes,
                                   reload_in_place=reload_in_place)
        self.ledger = self.residency.ledger  # the residency's, read by all who ask the runtime
        self.mode = self.residency.mode  # the tracing mode, whose recipes' pins the residency charges
        self.regions = CompiledRegions(self.residency)  # entering, leaving and packing compiled region calls
        self.min_bytes = min_bytes
        # ``fn(frame)`` as each frame starts (the overlap driver: OverlapDriver). While any
        # subscriber listens, frames also list the storages they release by recompute
        # (``Frame.recompute_nodes``).
        self.on_frame_start = Event("frame_start")
        # ``fn(frame)`` as each frame's forward ends, before the runtime's cleanup of it (one
        # that raises leaves that cleanup to the next frame or ``collect``, as an interrupt would).
        self.on_frame_end = Event("frame_end")
        # Timing (benchmarks): ``fn(hook, record, seconds)`` after each saved-tensor hook of the
        # frames that start while any subscriber listens: hook "pack" or "unpack", record what
        # was packed or unpacked (``_record``). Without one the hooks run unwrapped: no cost.
        self.on_hook = Event("hook")
        self._told_unrestorable = False  # a block call that could not be rerun was warned of
        # The exactness check (``enable(verify=...)``): off, the hooks are the plain ones.
        self.verifier = Verifier(verify, on_mismatch)
        self._traced_blocks: Set[str] = set()  # outermost blocks seen traced: whether they issue collectives is known
        # Plain outermost blocks in the order the model holds them, and those no state of theirs
        # (running statistics) keeps from being rerun
        # Blocks (outermost, and those nested in them: experts) in the order the model holds
        # them, and those no state of theirs (running statistics) keeps from being rerun
        self.blocks: List[str] = []
        self._rerunnable: Set[str] = set()
        self._called_with_objects: Set[str] = set()  # blocks a call chosen to rerun passed an object (a KV cache)
        # Bytes of what each block's last traced call returned (its own, not its storage's),
        # which what follows the block saves whether or not the block is rerun
        self.block_outputs: Dict[str, int] = {}
        self._attachments: List["_Attachment"] = []  # module trees attached (``attach``)
        self._scopes = calm_blocks.Scopes()  # their outermost blocks, and what a frame traces of them
        # The thread and the Python frame of the ``with frame(...)`` running now: a frame whose
        # forward is no longer on that thread's stack was left by an interrupt (``_frame_left``).
        self._frame_owner: Optional[Tuple[int, Any]] = None

    # -- frames -----------------------------------------------------------------------------
    @property
    def active_frame(self) -> Optional[Frame]:
        return self.residency.frame

    def frame(self, frame: Frame) -> ContextManager[Frame]:
        """Trace and provision one micro-batch's forward (``with runtime.frame(f): ...``).

        A frame that an interrupt left open (the interrupt landed in its cleanup, or in the
        ``with`` statement's exit before the cleanup began) is closed by the next ``frame`` or
        ``collect``: one whose ``with`` statement is no longer running on its thread. A frame
        still running on another thread is an error, as is one started inside another."""
        holder: List[Any] = []
        scope = self._frame_scope(frame, holder)
        holder.append(weakref.ref(scope.gen))  # type: ignore[attr-defined]
        return scope

    @contextlib.contextmanager
    def _frame_scope(self, frame: Frame, holder: List[Any]) -> Iterator[Frame]:
        if self.residency.frame is not None and not self._close_left_frame():
            thread = self._frame_owner[0] if self._frame_owner is not None else None
            if thread is not None and thread != threading.get_ident():
                raise RuntimeError(
                    "bagualu2: a provisioned forward of this model is running on another thread; a "
                    "provisioned model runs one forward at a time (give each thread its own model)")
            raise RuntimeError(
                "bagualu2: a provisioned forward started inside another one; enable bagualu2 on "
                "the outer module only"
            )
        self._clear_left_scopes()
        _refuse_outer_hooks()
        self.collect()
        _drain_graph()  # made before this frame's graph: see _drain_failed_backward
        self.mode.reset()
        self.mode.suspended = 0  # what an interrupt between a suspension's step and its ``try`` left
        self.mode.profile = frame.profile
        # A model whose forward writes storages across blocks is traced whole (see
        # ``TracingMode.writes_across_blocks``).
        if frame.rerun_chosen is not None:
            # Reruns blocks, traces nothing: the hooks of the blocks alone, each block's to
            # open its rerun if it is chosen when it begins.
            scope = frame.runtime_state.scope = TraceScope(frozenset(), False)
            for attachment in self._attachments:
                attachment.install(True, blocks_only=True)
        else:
            scope = frame.runtime_state.scope = None if self.mode.writes_across_blocks else self._scopes.of(frame)
            self._module_hooks(frame.traced, scope.blocks if scope is not None and not scope.whole else None)
        # The caller of ``with``: this generator's caller is contextlib's __enter__.
        self._frame_owner = (threading.get_ident(), sys._getframe(2), holder[0])
        self.residency.frame = frame
        if self.on_frame_start.subscribers:
            self.on_frame_start.emit(frame)
            if scope is not None and frame.on_saved.subscribers:  # a subscriber follows its saves: traced whole
                scope = frame.runtime_state.scope = None
                self._module_hooks(frame.traced)
        frame.stats.start_resident = self.ledger.resident
        self.ledger.reset_peak()
        grad = torch.is_grad_enabled()
        calm = None
        try:
            # The hooks' common cases run in C++ (bagualu2._saves): the pack hook keeps a calm
            # save (``FrameRun.calm``: all of an untraced frame's, a calm block's in a traced
            # one) of a plain tensor that fits the budget, the unpack hook serves a kept record
            # back; the rest goes to ``_pack`` and ``residency.unpack``. Made per frame: held by
            # the runtime, they would hold it in a cycle the garbage collector cannot see into.
            traced_outside = frame.traced and (scope is None or scope.whole)  # the mode is on outside the blocks
            frame.runtime_state.calm = not traced_outside
            checked = self.verifier.every != 0
            if checked:
                self.verifier.micro_batch += 1
            pack = calm = CalmPack(self.ledger, self.residency, frame, self._pack_checked if checked else self._pack)
            unpack = KeptUnpack(self._unpack_checked if checked else self.residency.unpack)
            if self.on_hook.subscribers:
                pack, unpack = observed_hook("pack", pack, self.on_hook.emit), observed_hook("unpack", unpack, self.on_hook.emit)
            # The tracing mode goes on and off by state (``TracingMode.place``), not as a ``with``: a rerun
            # block takes it off and puts it back inside the forward, and an interrupt between
            # the two must not turn the exit into a second, failing, pop.
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                try:
                    self.mode.place(traced_outside)
                    frame.runtime_state.outer_mode = torch.utils._python_dispatch._get_current_dispatch_mode()
                    yield frame
                finally:
                    if frame.runtime_state.region is not None:  # the region raised: its exit did not run
                        self.regions.leave()
                    if frame.runtime_state.rerun is not None:  # the block raised: its forward hook did not run
                        self._close_rerun(frame)
                    if frame.runtime_state.calm_block is not None:
                        calm_blocks.leave(frame, self.mode)
                    self.mode.place(False)
            if frame.strict:
                check_keys(frame, self.mode.nodes.values())
        finally:
            # The caller's grad mode, whatever an interrupt stopped inside the forward (the
            # entry of a gate's ``torch.no_grad()``, after it switched grad off) left.
            torch.set_grad_enabled(grad)
            if calm is not None:  # what the C++ pack hook kept, counted there
                stats = frame.stats
                stats.packed += calm.packed
                stats.bytes_by_choice["keep"] += calm.kept_bytes
                stats.shared_bytes += calm.shared_bytes
            if self.on_frame_end.subscribers:
                self.on_frame_end.emit(frame)
            self._close_frame(frame)

    def _clear_left_scopes(self) -> None:
        """Undo what an interrupt inside the entry of one of bagualu2's ``with`` statements left
        on this thread: the entry had pushed its state, the ``with`` never owned it, so no exit
        popped it. Called where a frame starts and ends, where none of them is in use."""
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        while hooks is not None and getattr(getattr(hooks[0], "fallback", hooks[0]), "__self__", None) is self:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        self.mode.place(False)

    def _close_frame(self, frame: Frame) -> None:
        """End ``frame``: the frame's own cleanup, and the repair of one an interrupt left open.
        Every step may run again (an interrupt may stop this one too): the frame stays the
        running one, for ``_close_left_frame`` to close again, until the last step."""
        frame.stats.peak_resident = max(frame.stats.peak_resident, self.ledger.peak)
        if frame.profile and not frame.saved_profile:
            frame.saved_profile, frame.unsaved_seconds = profile_saves(frame, self.mode.nodes.values())
        self.residency.settle()
        for node in frame.anchors:
            if node.offloaded:
                node.anchor = None
        frame.anchors = []
        frame.runtime_state.untraced_offloads = {}
        frame.runtime_state.recomputed = set()
        frame.runtime_state.rerun = None
        frame.runtime_state.calm_block = None
        frame.runtime_state.region = None
        self.mode.reset()  # the frame's nodes, and the anchors they pin
        self._clear_left_scopes()
        self._frame_owner = None
        self.residency.frame = None

    def _close_left_frame(self) -> bool:
        """Close the running frame if an interrupt left it open: its ``with`` statement's frame
        is off its thread's stack, or the scope's generator is done (its cleanup began). True
        when it was so (or no frame runs)."""
        frame, owner = self.residency.frame, self._frame_owner
        if frame is None:
            return True
        if owner is not None:
            thread, caller, gen_ref = owner
            gen = gen_ref()
            running = gen is not None and gen.gi_frame is not None and not gen.gi_running
            if running:
                top = sys._getframe(1) if thread == threading.get_ident() else sys._current_frames().get(thread)
                while top is not None and top is not caller:
                    top = top.f_back
                running = top is not None
            if running:
                return False
        self._frame_owner = None
        # What the interrupted exit did not undo: the tracing mode and the saved-tensor hooks
        # (this thread's stacks) and the frame's module hooks.
        self.mode.place(False)
        top_hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top_hooks is not None and getattr(top_hooks[1], "__self__", None) is self:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._close_frame(frame)
        return True

    def collect(self) -> None:
        """Give back what an interrupt left held: a frame it left open (``frame``), ledger
        counts of dead pins, the arena blocks of offload stores that died while their copies
        ran, and what a failed backward left queued. Idempotent, and resumable after an
        interrupt of its own: an entry goes only once what it held is given back."""
        residency = self.residency
        if residency.frame is not None:
            self._close_left_frame()
        self.ledger.collect()
        if residency.engine is not None:
            residency.engine.prune()  # tickets of stores that died, kept while their copies ran
        # Something still held outside a frame may be what a failed backward left queued.
        if residency.frame is None and (self.ledger.resident or residency.arena_in_use()) and _drain_failed_backward():
            self.ledger.collect()
            if residency.engine is not None:
                residency.engine.prune()

    # -- module hooks -----------------------------------------------------------------------
    def attach(self, root: torch.nn.Module, root_compiled: bool = False) -> List[Any]:
        """Name operators by module path and anchor block inputs, through module hooks that
        traced frames install.

        A *block* is a module held in a ``ModuleList`` (transformer layers, experts). Its first
        tensor input is anchored: held for the frame's recipes so a recompute chain never reaches
        back past the block, as with per-block checkpointing. An anchor whose storage is
        offloaded is dropped when the forward ends. The inputs of outermost blocks (layers, not
        the experts inside them) also bound the recompute cache (``RecomputeCache``), and their
        ends tell which saves come after the blocks (``Frame.after_blocks``); in a frame with
        ``rerun_blocks`` they run untraced, to be rerun in backward.

        The hooks are on ``root``'s modules only from a traced frame's start to the next
        untraced frame's: an untraced forward calls its modules with no hooks of bagualu2's, on
        torch's fast path (a module with a hook takes the slow one, a cost a calm step, which
        needs none of them, should not pay). Each
        module's pre-hook is installed ahead of the module's other pre-hooks and its forward
        hook behind its other forward hooks, so the module's path names what its own hooks run,
        and a rerun block is called with the arguments its call had before any pre-hook changed
        them. Returns handles whose ``remove()`` detaches.

        A compiled region (``bagualu2.runtime.regions``; all of ``root`` with ``root_compiled``)
        gets region hooks instead (``CompiledRegions``), and the modules inside it none.
        """
        blocks = {id(child) for m in root.modules() if isinstance(m, torch.nn.ModuleList) for child in m}
        block_paths = [name for name, m in root.named_modules() if id(m) in blocks]
        outermost = [p for p in block_paths if not any(p.startswith(q + ".") for q in block_paths)]
        hooks: List[Hooks] = []
        calls: List[Hooks] = []
        regions = {} if root_compiled else compiled_regions(root)
        # Plain outermost blocks (not compiled regions): the units a scoped frame traces.
        self._scopes.outermost.update(p for p in outermost if p not in regions and not root_compiled)

        def outer_block(name: str) -> Optional[str]:
            return next((p for p in outermost if name == p or name.startswith(p + ".")), None)

        for name, module in root.named_modules():
            if module is root or root_compiled or any(name.startswith(p + ".") for p in regions):
                continue  # inside compiled code: Dynamo would trace a hook of ours
            if name in regions:
                enter, leave = self.regions.hooks(name, id(module) in blocks, not holds_collectives(module))
                if isinstance(module, torch.nn.Module) and getattr(module, "_compiled_call_impl", None) is not None:
                    calls.append((module, enter, leave, outer_block(name), False))
                else:  # torch.compile(module): its own hooks run outside Dynamo
                    hooks.append((module, AttachedHook(enter), AttachedHook(leave), outer_block(name), False))
                continue
            block = 0
            if id(module) in blocks:
                nested = any(name.startswith(p + ".") for p in block_paths)
                block = 1 if nested else 2
            rerunnable = block != 0 and not any(
                isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats for m in module.modules())
            if block:
                self.blocks.append(name)
            if rerunnable:
                self._rerunnable.add(name)

            def enter(mod: torch.nn.Module, args: tuple, kwargs: Dict[str, Any], _name: str = name,
                      _block: int = block, _rerunnable: bool = rerunnable) -> None:
                frame = self.residency.frame
                run = None if frame is None else frame.runtime_state
                if (run is None or not frame.traced or self.mode.suspended or run.rerun is not None
                        or run.calm_block is not None):
                    return
                if frame.rerun_chosen is not None:  # rerun if chosen, else untraced
                    if _block == 2:
                        run.past_blocks = False
                    if _name in frame.rerun_chosen and _rerunnable:
                        self._open_rerun(frame, mod, _name, args, kwargs)
                    return
                if _block == 2:
                    run.past_blocks = False
                    self._scopes.framed.add(_name)
                    if _rerunnable and frame.rerun_blocks and self._open_rerun(frame, mod, _name, args, kwargs):
                        return
                    if run.scope is not None and calm_blocks.begins(frame, self.mode, mod, _name, args, kwargs):
                        return  # runs untraced
                    frame.stats.traced_blocks += 1
                    self.mode.block_begins(_name, tree_flatten((args, kwargs))[0] if kwargs else list(args))
                if _block:  # traced: whether it has effects a rerun would repeat is seen
                    self._traced_blocks.add(_name)
                self.mode.push_module(_name)
                if _block and args and isinstance(args[0], torch.Tensor):
                    self._anchor(args[0], outermost=_block == 2)

            def leave(mod: torch.nn.Module, args: tuple, out: Any, _name: str = name, _block: int = block) -> None:
                frame = self.residency.frame
                if frame is None or not frame.traced or self.mode.suspended:
                    return
                if frame.runtime_state.rerun is not None:
                    if frame.runtime_state.rerun.module is mod:
                        self._close_rerun(frame)
                        frame.runtime_state.past_blocks = _block == 2
                    return
                if frame.runtime_state.calm_block is not None:
                    if frame.runtime_state.calm_block.module is mod:
                        calm_blocks.leave(frame, self.mode)
                        frame.runtime_state.past_blocks = True
                    return
                if frame.rerun_chosen is not None:  # a block that ran untraced
                    frame.runtime_state.past_blocks = frame.runtime_state.past_blocks or _block == 2
                    return
                self.mode.pop_module()
                if _block and isinstance(out, torch.Tensor):
                    self.block_outputs[_name] = out.nelement() * out.element_size()
                if _block == 2:
                    self.mode.block_ends()
                    frame.runtime_state.past_blocks = True
                    if frame.runtime_state.scope is not None:
                        calm_blocks.traced_ends(frame, self.mode)

            hooks.append((module, AttachedHook(enter), AttachedHook(leave), outer_block(name), block != 0))
        attachment = _Attachment(self._attachments, hooks, calls)
        self._attachments.append(attachment)
        return [attachment]

    def rerunnable_blocks(self) -> List[str]:
        """The blocks a frame may rerun whole (``Frame.rerun_chosen``), in the order the model
        holds them: seen traced, holding no running statistics, with no effect a rerun would
        repeat (a collective, which backward must not issue: expert parallelism's token
        exchange), in a model that writes no storage across blocks; a block nested in one so
        listed is not (rerunning the outer one reruns it). A block a call chosen to rerun passed
        an object that is neither a tensor nor a plain value (a KV cache) is not either."""
        if self.mode.writes_across_blocks:
            return []
        out: List[str] = []
        for b in self.blocks:  # in model order: the blocks nested in one follow it
            if (b in self._rerunnable and b in self._traced_blocks and b not in self.mode.side_effect_modules
                    and b not in self._called_with_objects and not (out and b.startswith(out[-1] + "."))):
                out.append(b)
        return out

    def _module_hooks(self, on: bool, blocks: Optional[FrozenSet[str]] = None) -> None:
        """Install (``on``; only those inside the outermost ``blocks`` unless None) or remove
        every attachment's module hooks."""
        for attachment in self._attachments:
            attachment.install(on, blocks)

    def _open_rerun(self, frame: Frame, module: torch.nn.Module, name: str, args: tuple,
                    kwargs: Dict[str, Any]) -> bool:
        """Run this block call untraced, to be rerun whole in backward; False (trace it) when
        another dispatch mode was entered inside the frame's (that one must see the ops), when
        the block issues a collective or writes a storage from outside the forward, or has not
        yet been traced to tell (a rerun in backward would do it again: a collective on one rank
        only, ranks out of step or waiting for one another; a counter counted twice), or when an
        argument is an object the forward may change (``unrestorable``; told once)."""
        top = torch.utils._python_dispatch._get_current_dispatch_mode()
        if top is not (self.mode if frame.rerun_chosen is None else frame.runtime_state.outer_mode):
            return False
        flat, spec = tree_flatten((args, kwargs))
        other = unrestorable(flat)
        if other is not None and frame.rerun_chosen is not None:
            frame.stats.fallbacks.append(f"{name} is called with a {type(other).__name__}: not rerun")
            self._called_with_objects.add(name)
            return False
        if other is not None:
            why = (f"{name} is called with a {type(other).__name__}, which its forward may change: traced "
                   f"and recomputed op by op, not rerun")
            frame.stats.fallbacks.append(why)
            if not self._told_unrestorable:
                self._told_unrestorable = True
                warnings.warn(f"bagualu2: {why} (slower; a Hugging Face model passes its KV cache: set "
                              f"model.config.use_cache = False for training)", stacklevel=2)
            return False
        if name not in self._traced_blocks or name in self.mode.side_effect_modules or self.mode.writes_across_blocks:
            return False
        self.mode.place(False)  # off torch's dispatch stack: the block's ops skip Python
        frame.runtime_state.calm = False  # its saves are the rerun's, not kept (``_pack``)
        frame.runtime_state.rerun = BlockRerun(module, name, flat, spec, self.residency.pin_leaf,
                                               lambda s: Pin(self.ledger, s))
        frame.stats.rerun_blocks += 1
        return True

    def _close_rerun(self, frame: Frame) -> None:
        record, frame.runtime_state.rerun = frame.runtime_state.rerun, None
        frame.stats.bytes_by_choice["recompute"] += sum(record.storages.values())
        record.storages.clear()  # counted: the graph need not hold the addresses
        only_reruns = frame.rerun_chosen is not None  # a frame that only reruns traces nothing
        frame.runtime_state.calm = only_reruns
        self.mode.place(not only_reruns)

    def _anchor(self, t: torch.Tensor, outermost: bool) -> None:
        node = self.mode.nodes.get(t.untyped_storage()._cdata)
        if node is not None and node.anchor is None and self.residency.frame is not None:
            if self.residency.over_budget(t.untyped_storage()):
                return  # no room: recompute chains reach further back instead
            self.mode.settle()
            if t._version != node.version:
                self.mode.seen(node, t)
            with self.residency.untraced():
                held = t.detach()  # shares t's version counter; holding t's graph would be a reference cycle
            node.anchor = (held, node.state, Pin(self.ledger, t.untyped_storage()), held._version)
            self.residency.frame.anchors.append(node)
            anchors = node.cache.anchors
            if outermost and (not anchors or anchors[-1] < node.position):
                anchors.append(node.position)

    # -- pack -------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        frame = self.residency.frame
        if frame is None:
            return t
        run = frame.runtime_state
        if run.region is not None:
            return self.regions.pack(frame, run.region, t)
        if run.rerun is not None:
            frame.stats.packed += 1
            return run.rerun.save(t, counted=is_plain(t) and not self.residency.is_parameter(t))
        if self.residency.is_parameter(t):
            return Kept(t)
        self.mode.suspended += 1  # the runtime's own ops are not part of the model
        try:
            # ... and on a plain tensor they skip Python dispatch altogether: through the mode,
            # even suspended, each op (a detach, an offload's byte view) pays a Python call.
            # A subclass's ops keep their own dispatch.
            with torch._C._DisableTorchDispatch() if is_plain(t) else contextlib.nullcontext():
                seen = len(frame.keys_seen)
                packed = self._pack_in(frame, t)
                if frame.on_saved.subscribers and len(frame.keys_seen) > seen:
                    frame.on_saved.emit(next(reversed(frame.keys_seen)))  # _pack_in adds at most one key
            return packed
        finally:
            self.mode.suspended -= 1

    def _pack_checked(self, t: torch.Tensor) -> Any:
        """``_pack``, and a fingerprint of what it released (``runtime.verify``)."""
        packed = self._pack(t)
        kind = type(packed)
        if kind is _Offloaded:
            key, how = packed.store.key, "offloaded"
        elif kind is _Recomputed:
            key, how = packed.node.key, "recomputed"
        elif kind is RerunSaved:
            key, how = f"{packed.record.name} (its saved tensor {packed.index})", "rerun"
        else:
            return packed
        fp = self.verifier.saved(t, key, how)
        return packed if fp is None else _Checked(packed, fp)

    def _unpack_checked(self, packed: Any) -> torch.Tensor:
        """The residency's unpack, and the check of a fingerprinted save against what it got."""
        if type(packed) is not _Checked:
            return self.residency.unpack(packed)
        out = self.residency.unpack(packed.packed)
        self.verifier.unpacked(packed.fingerprint, out)
        return out

    def _pack_in(self, frame: Frame, t: torch.Tensor) -> Any:
        stats = frame.stats
        stats.packed += 1
        if self.residency.inflight:  # the offloads' share of the thread's time
            start = time.perf_counter()
            self.residency.settle()
            self.residency.copies.seconds += time.perf_counter() - start
        if not is_plain(t):
            stats.fallbacks.append(f"kept a {type(t).__name__} with layout {t.layout}: not a plain strided "
                                   f"tensor, so it is neither counted nor released")
            return Kept(t)
        storage = t.untyped_storage()
        node = self.mode.nodes.get(storage._cdata)
        if node is None and frame.runtime_state.calm:
            return self._pack_untraced(frame, t, storage)
        # A traced storage (saved by traced or untraced code: its plan decides) is saved in the
        # state it is in now: what code the mode did not see wrote of it since is seen first.
        if node is not None:
            self.mode.settle()
            if t._version != node.version:
                self.mode.seen(node, t)
        if node is None:
            # From outside the traced forward: no recipe, and not this frame's to release. It is
            # what the pin headroom is left for, so only the target itself bounds it.
            if not self.ledger.holds(storage):
                stats.outside_bytes += storage.nbytes()
            if self.residency.over_budget(storage, pins=True):
                self.residency.settle(wait=True)
                if self.residency.over_budget(storage, pins=True):
                    return self.residency.violate(frame, t, f"a saved input of shape {tuple(t.shape)}")
            return self.residency.keep(frame, t, storage)
        nbytes = node.nbytes
        frame.keys_seen.setdefault(node.key, nbytes)
        if nbytes < self.min_bytes and not self.residency.over_budget(storage):
            return self.residency.keep(frame, t, storage, node)
        state = node.state
        meta = view_meta(t)
        store = node.offloaded.get(state)
        if store is not None:
            stats.shared_bytes += nbytes
            return _Offloaded(store, meta, node, state)
        regenerable, source = regeneration_source(node, state)
        if regenerable:
            stats.regenerated_bytes += nbytes
            self._add_reader(node, state)
            return _Recomputed(node, state, meta, source)
        if frame.runtime_state.past_blocks and frame.after_blocks is not None:
            frame.choices.setdefault(node.key, frame.after_blocks)
        choice = frame.choice(node.key)
        if self.verifier.distrusted and choice != Choice.KEEP and node.key in self.verifier.distrusted:
            stats.fallbacks.append(f"{node.key}: {choice.name.lower()} -> keep (came back different in an "
                                   f"earlier backward: enable(verify=...))")
            choice = Choice.KEEP
        if choice == Choice.KEEP and self.residency.over_budget(storage):
            self.residency.settle(wait=True)
            if self.residency.over_budget(storage):
                if self.residency.enforce_budget:
                    choice = Choice.OFFLOAD if self.residency.engine is not None else Choice.RECOMPUTE
                    stats.fallbacks.append(f"{node.key}: keep -> {choice.name.lower()} (budget)")
                else:
                    return self.residency.violate(frame, t, node.key)
        rebuildable = node.rebuildable(state)
        why_not = node.why_not
        if rebuildable and not self.mode.rebuild_safe(node):
            rebuildable = False
            why_not = (f"its rebuild reads storages that {', '.join(sorted(node.owners))} filled and frees after "
                       f"its forward (sharded parameters)")
        if choice == Choice.RECOMPUTE:
            if rebuildable:
                return self._recompute(frame, node, state, meta)
            stats.fallbacks.append(f"{node.key}: recompute -> offload ({why_not})")
            choice = Choice.OFFLOAD
        if choice == Choice.OFFLOAD:
            packed = self.residency.offload(frame, node, storage, state, meta)
            if packed is not None:
                return packed
            if rebuildable:
                stats.fallbacks.append(f"{node.key}: offload -> recompute (arena full or no engine)")
                return self._recompute(frame, node, state, meta)
            stats.fallbacks.append(f"{node.key}: offload -> keep (arena full or no engine; not recomputable)")
        if self.residency.over_budget(storage):
            return self.residency.violate(frame, t, node.key)
        return self.residency.keep(frame, t, storage, node)

    def _pack_untraced(self, frame: Frame, t: torch.Tensor, storage: torch.UntypedStorage) -> Any:
        """Keep, unless that would cross an enforced budget: then offload (no recipe exists to
        recompute from). A storage offloaded earlier in the frame, unchanged, is shared."""
        store = frame.runtime_state.offloaded(storage, t._version)
        if store is not None:
            frame.stats.shared_bytes += storage.nbytes()
            return _Offloaded(store, view_meta(t), None, t._version, t)
        if not self.residency.over_budget(storage):
            return self.residency.keep(frame, t, storage)
        self.residency.settle(wait=True)
        if not self.residency.over_budget(storage):
            return self.residency.keep(frame, t, storage)
        store = self.residency.start_offload(frame, storage, "untraced") if self.residency.enforce_budget else None
        if store is None:
            return self.residency.violate(frame, t, f"a saved tensor of shape {tuple(t.shape)} (untraced forward)")
        frame.stats.fallbacks.append(f"untraced save over budget: offloaded {storage.nbytes()} bytes")
        frame.runtime_state.note_offload(storage, t._version, store)
        return _Offloaded(store, view_meta(t), None, t._version, t)

    def _recompute(self, frame: Frame, node: StorageNode, state: int, meta: ViewMeta) -> "_Recomputed":
        if (id(node), state) in frame.runtime_state.recomputed:  # another saved view of a released storage
            frame.stats.shared_bytes += node.nbytes
        else:
            frame.runtime_state.recomputed.add((id(node), state))
            frame.stats.bytes_by_choice["recompute"] += node.nbytes
            if self.on_frame_start.subscribers:
                frame.runtime_state.recomputes.append((node.key, weakref.ref(node), state))
        self._add_reader(node, state)
        return _Recomputed(node, state, meta)

    def _add_reader(self, node: StorageNode, state: int) -> None:
        """Count a released saved view as a reader of its storage in the recompute cache; the
        first time, also the storage's rebuild as a reader of each storage its recipe reads,
        and so on through the inputs that nothing holds now (rebuilt with it)."""
        node.cache.add_reader(node.position, state)
        stack = [(node, state)]
        while stack:
            n, s = stack.pop()
            if not n.cache.release(n.position, s):
                continue  # counted already
            for ref in recipe_refs(n, s):
                ref.node.cache.add_reader(ref.node.position, ref.state)
                if self.residency.available(ref.node, ref.state) is None:
                    stack.append((ref.node, ref.state))
