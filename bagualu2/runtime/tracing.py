"""Operator tracing: stable operator keys and recomputation recipes for every storage.

Owns ``TracingMode``: the per-frame map from storage address to ``StorageNode``, the module
call stack that names ops, the record of each op's outputs and in-place writes, and what marks a
module's calls as having side effects (``side_effect_modules``) or a rebuild as unsafe
(``rebuild_safe``). The recipes it writes and their replay live in recipes.py; which arguments
an op writes, in op_effects.py.

Design note
-----------
A ``TracingMode`` (a ``TorchDispatchMode``) sees every aten op that runs inside a provisioned
module's forward, below autograd. For each *storage* an op creates it records a ``StorageNode``:

* ``key``: the stable operator key ``"<module path>:<op>:<occurrence>"``, where the occurrence
  counts ops of that name inside one call of that module (``"<key>.<i>"`` for the op's output
  ``i > 0``). It does not depend on tensor shapes, so it is the same from micro-batch to
  micro-batch whatever the token counts, as long as the ops a module call runs do not depend
  on the data; a loop that stops early shifts the numbers of the ops after it in the same
  call, so such a loop belongs in a module of its own (the reference router's selection).
* a recipe to rebuild the storage: the creating op with its arguments (tensors replaced by
  ``Ref``s to the nodes that own their storages, or held directly when they come from outside
  the traced region), then every in-place op applied to the storage. A storage's *state* is the
  number of in-place ops applied so far; a ``Ref`` names the state it read. (Autograd's version
  counter is not usable here: it is bumped above the dispatch mode, after the op returns.)
  Random ops carry the RNG state they started from.

Invariants:

* A node never references a node created after it, except itself (encoded as ``SELF``), so
  nodes form a DAG and are freed by reference counting the moment nothing needs them. An
  in-place op on an older storage that reads newer ones (``buf[i] += f(buf)``) would break
  this; it is recorded without its arguments and ends the states that can be replayed
  (``replayable``). A later op reading such a storage, or one no replay can rebuild (made by
  an op that cannot be replayed), holds it as a ``Leaf`` instead.
* Tracing never extends the life of an activation: nodes hold their storages weakly (recipes.py).
  A tensor from outside the traced forward is pinned (held and counted) only by a step a
  recipe keeps: a step left unrecorded pins nothing, even for a moment.
* Replaying a recipe runs the same aten ops on bitwise-identical inputs with the same RNG state,
  so it reproduces the storage bit for bit. Ops that mutate storages outside the traced region
  (running statistics, collectives; also the batch-norm ops whose schemas do not declare their
  running-statistics writes) or are not aten ops are marked non-recomputable, because replaying
  them would repeat their side effects.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
import torch.utils._python_dispatch as _dispatch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode

from bagualu2.runtime.op_effects import OpInfo, written_tensors
from bagualu2.runtime.recipes import (
    _NO_KWARGS, _SCALARS, SELF, Leaf, RecomputeCache, Ref, Step, StorageNode, is_plain, module_of, step_inputs,
    view_meta,
)

__all__ = ["TracingMode"]

# The module flags a TorchDispatchMode's entry saves in the mode (torch 2.13), in entry order.
_MODE_FLAGS = (("_is_in_torch_dispatch_mode", "old_dispatch_mode_flags"),
               ("_is_in_non_infra_torch_dispatch_mode", "old_non_infra_dispatch_mode_flags"),
               ("_is_in_any_mode_without_ignore_compile_internals",
                "old_without_ignore_compile_internals_dispatch_mode_flags"))


def _rng_state(func: Any, args: tuple, kwargs: dict) -> Tuple[torch.device, torch.Tensor]:
    device = kwargs.get("device")
    if device is None:
        for a in args:
            if isinstance(a, torch.Tensor):
                device = a.device
                break
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cpu":
        return device, torch.get_rng_state()
    return device, torch.cuda.get_rng_state(device)


def _reads_newer(step: Step, position: int) -> bool:
    """Whether ``step`` reads a storage created after ``position``."""
    return any(node.position > position for node in step_inputs(step))


class TracingMode(TorchDispatchMode):
    """Records a ``StorageNode`` for every storage created by ops of the traced forward.

    ``nodes`` maps a storage address to its node for the current frame. The module path of the
    innermost module call is maintained by module hooks through ``push_module`` / ``pop_module``.
    ``pin_leaf(t)`` is called for every tensor from outside the region that a recipe holds and
    returns an object that counts it for as long as the recipe lives; ``charge(storage)`` counts a
    storage rebuilt in backward while the frame's ``RecomputeCache`` holds it. With ``profile``
    set, each op is timed.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in a Dynamo-disabling shim that costs more
        # per op than the recording itself; the traced forward runs eagerly, not compiled.
        return False

    def __init__(self, pin_leaf: Callable[[torch.Tensor], Any],
                 charge: Optional[Callable[[torch.UntypedStorage], Any]] = None) -> None:
        super().__init__()
        self.nodes: Dict[int, StorageNode] = {}
        self._charge = charge
        self.cache = RecomputeCache(charge)
        self.profile = False
        self.suspended = 0
        self._pin_leaf = pin_leaf
        # The module calls running now: (path, op counts inside it, how many nodes existed as it began)
        self._calls: List[Tuple[str, Dict[str, int], int]] = [("", {}, 0)]
        self._call_counts: Dict[str, int] = {}
        # Paths of the modules whose calls, in any frame, had an effect a rerun would repeat:
        # a collective, or a write into a storage from outside the traced forward (a buffer, a
        # counter, a parameter an FSDP2 unshard fills) or from before the call began (its input:
        # a rerun would start from the written input). They are never rerun whole in backward
        # (``ActivationRuntime``'s rerun blocks).
        self.side_effect_modules: Set[str] = set()
        # Storages from outside the traced forward that an op inside it wrote, with the path of
        # the module whose call wrote them (see _record_mutation and StorageNode.owners).
        self.written_outside: Dict[int, Tuple[StorageWeakRef, str]] = {}
        self._owners: Set[str] = set()
        # The outermost block call running now, traced: (its path, how many nodes existed as it
        # began, the storages of its tensor arguments); see ``block_begins``.
        self._block: Optional[Tuple[str, int, FrozenSet[int]]] = None
        # This frame's outermost block calls so far: the paths of those each storage was an
        # argument of, and how many nodes existed as the last one began.
        self._block_args: Dict[int, Set[str]] = {}
        # Numbers the stretches of a forward: each outermost block call, and the code between
        # them (``StorageNode.read_in``).
        self._segment = 0
        # Whether any traced forward wrote in place a storage that was read before and made in
        # another stretch (another block, or the code between blocks): a frame running that
        # stretch untraced (a calm block, a block rerun whole) would hold the storage as a leaf
        # in the readers' recipes, which a rebuild would then find written. Frames of a model
        # that does this are traced whole, and none of its blocks is rerun whole
        # (``ActivationRuntime``).
        self.writes_across_blocks = False
        # The traced storages the last in-place op wrote, with the tensor it wrote each through:
        # their counters move after this mode returns (ADInplaceOrView sits above the Python
        # dispatch key; under a dispatch mode a foreach op moves none), so each node's version
        # is read at the next op, or as the mode turns off, or at the next save (``settle``).
        self._written: List[Tuple[StorageNode, torch.Tensor]] = []

    # -- module path ------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new frame: forget the previous frame's nodes and module calls."""
        self.nodes = {}
        self.written_outside = {}
        self.cache = RecomputeCache(self._charge)
        self._calls = [("", {}, 0)]
        self._call_counts = {}
        self._block = None
        self._block_args = {}
        self._segment = 0
        self._written = []

    def push_module(self, path: str) -> None:
        n = self._call_counts.get(path, 0)
        self._call_counts[path] = n + 1
        self._calls.append((path if n == 0 else f"{path}#{n}", {}, len(self.nodes)))

    def block_begins(self, path: str, args: List[Any]) -> None:
        """Outermost block ``path`` begins, traced, with the flattened arguments ``args``. A
        rerun of the block in backward passes it these arguments again (held) and reads all
        else as it is then: so a block whose call reads a storage made before it began through
        anything but its arguments (a tensor another block left in a module attribute or a
        container, which the forward may replace by the time backward reruns it) is never rerun
        whole (``side_effect_modules``); see ``_encode``."""
        storages = frozenset(a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor) and is_plain(a))
        self._block = (path, len(self.nodes), storages)
        self._segment += 1
        for cdata in storages:
            self._block_args.setdefault(cdata, set()).add(path)

    def block_ends(self) -> None:
        self._block = None
        self._segment += 1

    def pop_module(self) -> None:
        if len(self._calls) > 1:
            self._calls.pop()

    def place(self, on: bool) -> None:
        """Put this mode on (``on``) or off this thread's dispatch stack, from any state
        an interrupt left. A ``TorchDispatchMode``'s entry saves three module flags one by one
        and then pushes itself; its exit restores them one by one and then pops itself: a plain
        exit after an entry or exit stopped between those raises ``IndexError`` and hides the
        interrupt. So off is done by state: the mode leaves the stack (with the modes an
        interrupt left above it), each flag it saved is restored, and its saved flags cleared;
        on, a half-done entry or exit is undone that way first. Every line leaves a state this
        handles, so a call an interrupt stopped can be made again."""
        mode = self
        if not on and self._written:
            self.settle()
        saved = [getattr(mode, attr, None) for _, attr in _MODE_FLAGS]
        depth = torch._C._len_torch_dispatch_stack()
        top = depth > 0 and torch._C._get_dispatch_stack_at(depth - 1) is mode
        # The short ways: from a state no entry or exit stopped halfway in (each saves a flag
        # before it pushes, and pops after restoring them). Off and not stacked: every untraced
        # frame's case, several times per micro-batch. Entered once and on top, or off and
        # nothing saved: the exit or entry a ``with`` would make (around each calm block).
        if not on:
            if not depth and not any(saved):
                return
            if top and all(old is not None and len(old) == 1 for old in saved):
                mode.__exit__(None, None, None)
                return
        elif top and all(saved):
            return
        elif not any(saved) and (not depth or mode not in _get_current_dispatch_mode_stack()):
            mode.__enter__()
            return
        modes = _get_current_dispatch_mode_stack()
        while mode in modes:
            _pop_mode()
            modes.pop()
        for (flag, _), old in zip(_MODE_FLAGS, saved):
            if old:  # the value before the entry: the first saved (the mode is entered once at most)
                setattr(_dispatch, flag, old[0])
                old.clear()
        _dispatch.set_is_in_mode_without_ignore_compile_internals(
            _dispatch._is_in_any_mode_without_ignore_compile_internals)
        if on:
            mode.__enter__()

    def settle(self) -> None:
        """Read the version counters the last traced in-place op moved (see ``_written``)."""
        written, self._written = self._written, []
        for node, t in written:
            try:
                node.version = t._version
            except RuntimeError:  # an inference tensor
                node.version = -1

    def seen(self, node: StorageNode, x: torch.Tensor) -> None:
        """``x``, a tensor of ``node``'s storage, is read or written now: if its version counter
        moved since the last op this mode saw on the storage returned, code the mode did not see
        wrote it in place (an untraced block, an untraced frame's gate, a hook), through whichever
        tensor shares the counter (a view, a ``detach()``, a module attribute, a tensor in a
        container). Its states from that write on cannot be replayed, so what reads it from now
        on holds it as it is (``untraced_write``). Callers compare ``x._version`` with
        ``node.version`` first: this is the rare path."""
        try:
            version = x._version
        except RuntimeError:  # an inference tensor has no version counter, and no autograd reads it
            return
        if version != node.version:
            self.untraced_write(node, f"written in place where bagualu2 did not trace it (its version counter "
                                      f"moved from {node.version} to {version})")
            node.version = version

    def untraced_write(self, node: StorageNode, why: str) -> None:
        """``node``'s storage was written in place by ops this mode did not see: its states from
        now on cannot be replayed, so what reads it later holds it as it is."""
        if node.rebuildable(node.state):  # else the reason it already cannot be rebuilt stands
            node.why_not = why
        node.mutations += (Step(None, (), {}, None),)

    def _side_effect(self) -> None:
        """The running op has an effect a rerun would repeat: mark every module call it is in."""
        for path, _, _ in self._calls[1:]:
            self.side_effect_modules.add(path.partition("#")[0])

    def module_path(self) -> str:
        """The path of the innermost module call running now ("" outside every module)."""
        return module_of(self._calls[-1][0] + ":")

    def rebuild_safe(self, node: StorageNode) -> bool:
        """Whether a rebuild of ``node`` for a save made now reads only storages that are there
        when backward unpacks it. A storage filled in this forward by a module's call (FSDP2
        unshards a module's parameters in its pre-forward and frees them after its forward) is
        there again only while backward runs inside that module, so a save may be rebuilt from
        it only if it is made inside that module."""
        if not node.owners:
            return True
        path = self.module_path()
        return all(path == o or path.startswith(o + ".") or not o for o in node.owners)

    # -- recording --------------------------------------------------------------------------
    def _encode(self, x: Any, mutated: Optional[StorageNode],
                unpinned: Optional[List[Tuple[Leaf, torch.Tensor]]] = None) -> Any:
        """``x`` with its tensors as a recipe holds them: ``Ref``s to traced storages, ``Leaf``s
        for the rest, pinned (``pin_leaf``) unless ``unpinned`` is given: then they are listed
        there, for the caller to pin once it keeps the step."""
        if isinstance(x, torch.Tensor):
            if not is_plain(x):
                return Leaf(x, None)
            cdata = x.untyped_storage()._cdata
            node = self.nodes.get(cdata)
            if node is not None and node is not mutated:
                node.read_in = self._segment
                if x._version != node.version:
                    self.seen(node, x)
                block = self._block
                if block is not None and node.position < block[1] and cdata not in block[2]:
                    self.side_effect_modules.add(block[0])
            if node is None or (node is not mutated and not node.rebuildable(len(node.mutations))):
                if node is None and cdata in self.written_outside:
                    self._owners.add(self.written_outside[cdata][1])
                if unpinned is None:
                    return Leaf(x, self._pin_leaf(x))
                leaf = Leaf(x, None)
                unpinned.append((leaf, x))
                return leaf
            if node.owners and node is not mutated and node.anchor is None:  # a rebuild stops at a held anchor
                self._owners.update(node.owners)
            return Ref(SELF if node is mutated else node, len(node.mutations), view_meta(x))
        if isinstance(x, (list, tuple)):
            return type(x)([v if type(v) in _SCALARS else self._encode(v, mutated, unpinned) for v in x])
        if isinstance(x, dict):  # keyword arguments (an attention mask is keyword-only)
            return {k: self._encode(v, mutated, unpinned) for k, v in x.items()} if x else _NO_KWARGS
        return x

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if not kwargs:
            kwargs = _NO_KWARGS
        if self._written:
            self.settle()
        if self.suspended:
            return func(*args, **kwargs)
        info = OpInfo.of(func)
        rng = _rng_state(func, args, kwargs) if info.random else None
        if self.profile:
            start = time.perf_counter()
            out = func(*args, **kwargs)
            seconds = time.perf_counter() - start
        else:
            out = func(*args, **kwargs)
            seconds = 0.0
        if info.collective:
            self._side_effect()
        if info.written:
            written = self._record_mutation(func, info, args, kwargs, rng, seconds)
            if not func.is_view:
                self._record_outputs(func, info, args, kwargs, out, rng, seconds, written)
        else:
            self._record_outputs(func, info, args, kwargs, out, rng, seconds)
        return out

    def _record_outputs(self, func: Any, info: OpInfo, args: tuple, kwargs: dict, out: Any,
                        rng: Any, seconds: float, written: Optional[Set[int]] = None) -> None:
        """Give each fresh output storage of an op a node. ``written``: the storages the op
        wrote (an op with ``written`` is not replayed, so its fresh outputs can be kept or
        offloaded but not rebuilt)."""
        if func.is_view:
            return  # views alias a storage that has a node already, or a leaf
        outs = out if isinstance(out, (tuple, list)) else (out,)
        encoded: Optional[Tuple[tuple, dict]] = None
        replayable = info.replayable and written is None
        why_not = info.why_not or ("" if replayable else f"{info.name} also writes its arguments: a replay would "
                                                          f"write them again")
        several = len(outs) > 1
        siblings: List[Any] = []
        for index, o in enumerate(outs):
            if not is_plain(o):  # also false for what is not a tensor
                continue
            storage = o.untyped_storage()
            if storage._cdata in self.nodes or (written is not None and storage._cdata in written):
                continue  # an op returning one of its inputs, or what it wrote
            if encoded is None:
                # What is never replayed keeps no references to its inputs.
                self._owners = set()
                encoded = (self._encode(args, None), self._encode(kwargs, None)) if replayable else ((), {})
                owners = frozenset(self._owners) if self._owners else None
                path, counts, _ = self._calls[-1]
                n = counts.get(info.name, 0)
                counts[info.name] = n + 1
                key = f"{path}:{info.name}:{n}"
            step = Step(func, encoded[0], encoded[1], rng if replayable else None, index, seconds,
                        siblings if several else ())
            node = StorageNode(
                key if index == 0 else f"{key}.{index}", len(self.nodes), storage, step, replayable,
                why_not, self.cache,
            )
            node.version = o._version
            node.made_in = self._segment
            node.owners = owners
            self.nodes[storage._cdata] = node
            if several:
                siblings.append(weakref.ref(node))

    def _record_mutation(self, func: Any, info: OpInfo, args: tuple, kwargs: dict, rng: Any,
                         seconds: float) -> Set[int]:
        """Record an in-place op on every traced storage it writes; returns the addresses of
        every storage it wrote, traced or not. A write to a storage from outside the traced
        forward (a parameter an FSDP2 unshard fills, a buffer) is remembered in
        ``written_outside``: what reads such a storage is not replayed (``_encode``)."""
        schema_args = func._schema.arguments
        targets: List[Tuple[StorageNode, torch.Tensor]] = []
        written: Set[int] = set()
        foreign = False
        for i in info.written:
            for t in written_tensors(args[i] if i < len(args) else kwargs.get(schema_args[i].name)):
                if not is_plain(t):
                    foreign = True
                    continue
                cdata = t.untyped_storage()._cdata
                written.add(cdata)
                node = self.nodes.get(cdata)
                if node is None:
                    foreign = True
                    self._side_effect()
                    # Held weakly: the address stays a sound key while the entry lives.
                    self.written_outside[cdata] = (StorageWeakRef(t.untyped_storage()), self.module_path())
                elif all(node is not n for n, _ in targets):
                    targets.append((node, t))
        for node, t in targets:
            if t._version != node.version:  # written unseen before this write
                self.seen(node, t)
            for path, _, start in self._calls[1:]:
                if node.position < start:
                    self.side_effect_modules.add(path.partition("#")[0])
            if node.read_in != -1 and not node.read_in == node.made_in == self._segment:
                self.writes_across_blocks = True
            if node.replayable == len(node.mutations):
                self._owners = set(node.owners or ())
                # Pinned only if the step is kept: a pin counts as bytes the frame holds, even
                # one the step left unrecorded below would drop at once (FSDP2's first
                # all-gather copies into the parameter buffers it allocates in that forward).
                unpinned: List[Tuple[Leaf, torch.Tensor]] = []
                step = Step(func, self._encode(args, node, unpinned), self._encode(kwargs, node, unpinned), rng, 0,
                            seconds)
                node.owners = frozenset(self._owners) if self._owners else None
                if foreign or len(targets) > 1 or not info.replayable:
                    node.why_not = info.why_not or f"{info.name} also writes storage outside this node"
                elif _reads_newer(step, node.position):
                    node.why_not = f"{info.name} writes it from storages created after it"
                else:
                    node.replayable += 1
                    for leaf, x in unpinned:
                        leaf.pin = self._pin_leaf(x)
            if len(node.mutations) >= node.replayable:
                step = Step(func, (), {}, None, 0, seconds)  # not replayable: keep no references
            node.mutations += (step,)
            self._written.append((node, t))
        # A block an earlier call gave this storage to would be rerun from it as written.
        for cdata in written:
            for path in self._block_args.get(cdata, ()):
                if self._block is None or path != self._block[0]:
                    self.side_effect_modules.add(path)
        return written
