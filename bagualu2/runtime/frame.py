"""A frame: one micro-batch's forward through a provisioned module, and what it is held to.

Owns ``Frame`` (the plan a forward runs under and what it reports), ``FrameRun`` (the state the
runtime keeps of it while its activations live, its own) with its parts (``TraceScope``,
``CalmBlock``, ``RegionState``, and ``HostCopy``, what it reads of its host copies), ``FrameStats``
(what the forward did with its saves), ``Budget`` (the bytes
it is held to), ``checked_choices`` (the one check a plan's entries get wherever a plan
enters), and what a forward's traced nodes say about its plan and saves once it ends
(``check_keys``, ``profile_saves``). The runtime (``bagualu2.runtime.activations``) drives a
frame; nothing here touches autograd or the device.

Invariants: a storage's choice is read when it is first saved, so a plan may still change
while the forward runs (the provisioner fills it in at MoE gating); a frame outlives its
forward for as long as its host copies do, because backward prefetches from its list of them.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, NamedTuple, Optional, Protocol, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bagualu2.shared import Budget, Choice, Event, SavedOp, module_of, region_key
from bagualu2.runtime.ledger import ResidencyLedger
from bagualu2.runtime.rerun import BlockRerun
from bagualu2.runtime.recipes import StorageNode, step_inputs

__all__ = ["Budget", "CalmBlock", "Frame", "FrameRun", "FrameStats", "HostCopy", "RegionState", "SavesProfile",
           "TraceScope", "check_keys", "checked_choices", "profile_saves", "released_modules"]


@dataclass
class FrameStats:
    """What one frame (micro-batch forward) did with its saved activations."""

    packed: int = 0
    bytes_by_choice: Dict[str, int] = field(default_factory=lambda: {"keep": 0, "offload": 0, "recompute": 0})
    offloaded_storages: int = 0
    offload_failures: int = 0   # offloads the copy engine refused or had no arena room for
    shared_bytes: int = 0       # re-saves of a storage already held: stored once
    regenerated_bytes: int = 0  # casts/copies of a stored activation, rebuilt from it
    fallbacks: List[str] = field(default_factory=list)
    violations: int = 0
    leaf_bytes: int = 0         # storages recipes pin as they are (inputs, storages written in place)
    outside_bytes: int = 0      # storages from outside the forward it holds, saved or pinned
    traced_pin_bytes: int = 0   # storages made inside the forward that recipes pin (tracing's own)
    room_made_bytes: int = 0    # kept storages (of it or earlier frames) offloaded to make room
    peak_resident: int = 0      # ledger high-water mark while this frame's forward ran
    rerun_blocks: int = 0       # block calls run untraced, to be rerun whole in backward
    traced_blocks: int = 0      # outermost block calls traced
    start_resident: int = 0


class TraceScope(NamedTuple):
    """What a frame with ``released_modules`` traces (``bagualu2.runtime.calm_blocks``' note)."""

    blocks: FrozenSet[str]
    """The outermost blocks holding a module it may release from: traced."""
    whole: bool
    """An operator outside every such block may be released, or one in a block not yet seen
    called inside a frame: the forward is traced but for the other outermost blocks (calm
    blocks); else only ``blocks`` are."""


class CalmBlock:
    """One call of an outermost block running untraced in a forward traced otherwise."""

    __slots__ = ("module", "name")

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module = module
        self.name = name


class RegionState:
    """One compiled region call of a frame while it runs (``bagualu2.runtime.compiled``): its key,
    the rerun record that may recompute it, whether the tracing mode was on the stack at its
    entry, and what it saved."""

    __slots__ = ("key", "rerun", "tracing", "choice", "storages", "start")

    def __init__(self, key: str, rerun: Optional[BlockRerun], tracing: bool) -> None:
        self.key = key
        self.rerun = rerun
        self.tracing = tracing
        self.choice: Optional[Choice] = None  # read at its first save
        self.storages: Dict[int, int] = {}  # address -> bytes, counted saves
        self.start = time.perf_counter()


class HostCopy(Protocol):
    """What a frame and its readers read of one of its host copies: the runtime's
    ``bagualu2.runtime.stores.OffloadStore``, which holds its frame (for its list of copies, its
    fallbacks and its prefetched bytes). The frame names what it reads, not the class, so that
    this module needs nothing of the module that imports it."""

    key: str  # the operator key it was saved under
    nbytes: int  # the storage's bytes
    index: int  # its place in the frame's list of copies (pack order)

    def prefetch(self, ledger: ResidencyLedger) -> bool:
        """Start reloading it now (charged to ``ledger`` until backward uses it); False when one
        is pending already."""


ROOT_REGION = region_key("")  # torch.compile(model): the whole forward is one region


def checked_choices(choices: Mapping[str, Choice]) -> Dict[str, Choice]:
    """A copy of ``choices`` (operator key -> ``Choice``); TypeError naming any entry that is not
    a ``Choice``."""
    out = dict(choices)
    for key, choice in out.items():
        if not isinstance(choice, Choice):
            raise TypeError(f"plan entry {key!r}: {choice!r} is not a bagualu2.Choice")
    return out


class FrameRun:
    """The runtime's own state of one frame: where its forward is (the block or compiled region
    running untraced now, whether it is past its last block), and what backward needs of it
    for as long as its host copies live (their list and the prefetch cursor over it, the
    storages released by recompute). Written and read by ``bagualu2.runtime`` only; the
    provisioner asks through ``Frame``'s fields and reads what the forward reports."""

    __slots__ = ("past_blocks", "scope", "calm", "calm_block", "rerun", "region", "offloads",
                 "prefetch_cursor", "prefetch_task", "prefetch_pending", "recomputes", "untraced_offloads",
                 "recomputed", "outer_mode")

    def __init__(self) -> None:
        self.past_blocks = False  # an outermost block ended, and none has begun since
        # What a traced frame with ``released_modules`` traces (``calm_blocks``); None: all of it.
        self.scope: Optional[TraceScope] = None
        # Saves are kept now as an untraced frame keeps them (no node, no plan): all of an
        # untraced frame's, what a traced one runs untraced (``scope``). The C++ pack hook reads it.
        self.calm = False  # set as the frame starts
        self.calm_block: Optional[CalmBlock] = None  # the block of a traced frame running calm now
        self.rerun: Optional[BlockRerun] = None  # the block running untraced now, to be rerun
        self.region: Optional[RegionState] = None  # the compiled region call running now
        self.offloads: List["weakref.ref[HostCopy]"] = []  # in pack (forward) order
        self.prefetch_cursor = 1 << 62  # next store index backward may prefetch (lazy issue)
        self.prefetch_task = -1  # the backward pass the cursor belongs to
        self.prefetch_pending = 0  # bytes prefetched and not used yet
        # released by recompute; recorded only while an overlap driver observes frames
        self.recomputes: List[Tuple[str, "weakref.ref[StorageNode]", int]] = []
        # Calm saves (``calm``), while the forward runs: storages offloaded without a node
        # (address -> the storage's weak ref, its version, the store's weak ref)
        self.untraced_offloads: Dict[int, Tuple[StorageWeakRef, int, "weakref.ref[HostCopy]"]] = {}
        self.recomputed: Set[Tuple[int, int]] = set()  # (id(node), state) of storages released by recompute
        # The dispatch mode on top as the forward began (a frame that traces nothing: another
        # mode on top when a block begins was entered inside the forward, and must see its ops)
        self.outer_mode: Any = None

    def offloaded(self, storage: "torch.UntypedStorage", version: int) -> Optional[HostCopy]:
        """The host copy this untraced forward made of ``storage`` while it is unchanged (at
        ``version``), for another saved view of it; else None."""
        found = self.untraced_offloads.get(storage._cdata) if self.untraced_offloads else None
        return found[2]() if found is not None and not found[0].expired() and found[1] == version else None

    def note_offload(self, storage: "torch.UntypedStorage", version: int, store: HostCopy) -> None:
        """``storage`` (at ``version``) was offloaded to ``store`` without a node: ``offloaded``
        finds it."""
        self.untraced_offloads[storage._cdata] = (StorageWeakRef(storage), version, weakref.ref(store))


class Frame:
    """One micro-batch's forward through a provisioned module, in three parts by owner: what
    its caller asks of it (the plan, the budget, the flags below ``__init__``'s arguments; a
    gate installs a plan through ``replan``), what the forward reports (``stats``,
    ``keys_seen``, the profile, ``anchors``: written by the runtime, read by everyone else),
    and the runtime's own state (``runtime_state``, a ``FrameRun``).

    ``choices`` maps operator keys to a ``Choice``; keys not in it get ``default``. The
    provisioner may update ``choices`` while the forward runs (at MoE gating): a storage's
    choice is taken when it is first saved.
    """

    def __init__(self, choices: Optional[Mapping[str, Choice]] = None, default: Choice = Choice.KEEP,
                 index: int = 0, strict: bool = False) -> None:
        self.choices: Dict[str, Choice] = checked_choices(choices or {})
        self.default = default
        # The choice for operators first saved after an outermost block has run, outside every
        # block (a transformer's final norm, output layer and loss); None: ``default`` there too.
        # The runtime enters it in ``choices`` as each such key is saved.
        self.after_blocks: Optional[Choice] = None
        # True: every outermost block recomputes all it saves, by rerunning the block in
        # backward (``BlockRerun``, as torch.utils.checkpoint does); the blocks run untraced, so
        # ``choices`` and ``keys_seen`` hold only the operators outside them. Blocks holding
        # running statistics (batch norm), which a rerun would update twice, are traced and
        # recomputed op by op (``default``) instead, and so are block calls with an argument
        # that is neither a tensor nor a plain value (a KV cache the forward appends to).
        self.rerun_blocks = False
        # Not None: an adaptive forward that releases only by rerunning the outermost blocks
        # named here whole (``BlockRerun``) and is traced nowhere: every other block and the
        # code between them save as an untraced frame does. A gate may add blocks that have not
        # begun yet; a block is rerun if it is named when it begins.
        self.rerun_chosen: Optional[Set[str]] = None
        # None: a traced forward is traced whole. Otherwise the module paths of the operators
        # the plan may release (``released_modules``): the forward is traced only as far as
        # they need (``bagualu2.runtime.calm_blocks``), the rest saving as an untraced frame
        # does, its operators in neither ``keys_seen`` nor the recipes. Only for a plan that no
        # gate changes while the forward runs; profiled and ``strict`` frames, and those whose
        # first saves an overlap driver follows (``on_saved``), are traced whole regardless.
        self.released_modules: Optional[FrozenSet[str]] = None
        self.strict = strict  # a key in ``choices`` that names no op of the forward is an error
        # What the forward is held to; None: the runtime's ``budget_bytes``, all of it.
        self.budget: Optional[Budget] = None
        # False: no tracing, saved tensors are only counted and kept. For forwards that cannot
        # need a release (an ample budget): they then cost about what the saved-tensor hooks cost.
        self.traced = True
        self.index = index
        self.profile = False  # time every op, and fill ``saved_profile`` when the forward ends
        # set by the provisioner: this micro-batch releases all it can, to measure what releases
        # cost, and decides nothing at its gates (``provision/calibration.py``)
        self.calibrating = False
        # Overlap scheduling (bagualu2.integrations.pipeline.overlap_driver.OverlapDriver):
        # ``on_saved`` calls ``fn(key)`` once per operator key of a traced forward, right after
        # the first activation of that key is packed (the op has run); with ``scheduled`` set,
        # backward issues no reloads of its own beyond the one it is waiting for: the schedule
        # issues them.
        self.on_saved = Event("saved")
        self.scheduled = False

        # -- what the forward reports: written by the runtime, read by everyone else ----------
        self.stats = FrameStats()
        self.keys_seen: Dict[str, int] = {}  # operator key -> storage bytes, first save
        self.saved_profile: Dict[str, SavedOp] = {}  # key -> what the profiled forward measured of it
        self.unsaved_seconds: Dict[str, float] = {}  # those unsaved inputs' own seconds
        # Profiled frames: compiled region key -> (saved bytes, forward seconds) of its call
        self.region_profile: Dict[str, Tuple[int, float]] = {}
        # The storages this forward holds as anchors: inputs that rebuilds start from, kept
        # whatever the plan says (the planner is told: ``CostModel.candidates``' ``fixed``).
        self.anchors: List[StorageNode] = []

        # -- the runtime's own: nothing outside ``bagualu2.runtime`` reads or writes it --------
        self.runtime_state = FrameRun()

    def choice(self, key: str) -> Choice:
        return self.choices.get(key, self.default)

    def replan(self, choices: Mapping[str, Choice], keys: Iterable[str] = ()) -> None:
        """Install a plan made for this micro-batch: ``keys`` drop the choices they had (they
        take ``default`` unless ``choices`` names them), then ``choices`` are set (checked as at
        construction). A gate replans the operators still to run while the forward runs; a
        storage's choice is taken when it is first saved, so only later saves follow."""
        checked = checked_choices(choices)
        for key in keys:
            self.choices.pop(key, None)
        self.choices.update(checked)

    @property
    def past_blocks(self) -> bool:
        """Whether the forward is past its outermost blocks: one has ended and none has begun
        since (what it saves now is saved after every block, unless another block follows)."""
        return self.runtime_state.past_blocks

    @property
    def prefetch_pending_bytes(self) -> int:
        """Bytes backward has prefetched for this frame's host copies and not used yet
        (charged to the ledger meanwhile; at most the runtime's ``prefetch_bytes``)."""
        return self.runtime_state.prefetch_pending

    def offload_stores(self) -> List[HostCopy]:
        """This frame's host copies still alive, in pack (forward) order."""
        return [s for s in (ref() for ref in self.runtime_state.offloads) if s is not None]

    def recompute_nodes(self) -> List[Tuple[str, StorageNode, int]]:
        """``(key, node, state)`` of the storages this frame released by recompute and that
        are still needed (their packed objects alive), in forward order."""
        refs = self.runtime_state.recomputes
        return [(k, n, st) for k, n, st in ((k, ref(), st) for k, ref, st in refs) if n is not None]


def check_keys(frame: Frame, nodes: Iterable[StorageNode]) -> None:
    """ValueError naming the keys of ``frame.choices`` that no traced op of its forward has (what a
    ``strict`` frame checks as its forward ends), with the nearest known key of each."""
    known = {node.key for node in nodes} | set(frame.region_profile) | set(frame.keys_seen)
    unknown = sorted(set(frame.choices) - known)
    if unknown:
        import difflib

        hints = [difflib.get_close_matches(k, known, n=1) for k in unknown[:3]]
        raise ValueError(
            f"the plan names {len(unknown)} operator key(s) that no op of this forward has, e.g. "
            + ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in zip(unknown, hints))
            + "; keys look like '<module path>:<aten op>:<occurrence>', see Frame.keys_seen"
        )


def released_modules(choices: Mapping[str, Choice], default: Choice = Choice.KEEP) -> Optional[FrozenSet[str]]:
    """The paths of the modules whose operators a plan (``choices``, ``default`` for the rest)
    may release: a frame's ``released_modules``. None when ``default`` releases (every
    module's may)."""
    if default != Choice.KEEP:
        return None
    return frozenset(module_of(key) for key, choice in choices.items() if choice != Choice.KEEP)


class SavesProfile(NamedTuple):
    """What a profiled forward's traced nodes say of its saves (``profile_saves``)."""

    saved: Dict[str, SavedOp]
    """Per saved key: bytes, seconds of its own ops, whether it can be rebuilt, the storages
    nothing saved (freed after the forward) that rebuilding it must rebuild first, up to saved
    storages and block inputs, and the saved storages that rebuild reads."""
    unsaved_seconds: Dict[str, float]
    """Those unsaved storages' own seconds, by key."""


def profile_saves(frame: Frame, nodes: Iterable[StorageNode]) -> SavesProfile:
    """What ``frame``'s forward saved, from its traced ``nodes`` (``SavesProfile``)."""
    by_key = {node.key: node for node in nodes}
    saved = frame.keys_seen
    unsaved: Dict[str, float] = {}
    chains: Dict[int, Tuple[str, ...]] = {}

    def own_seconds(node: StorageNode) -> float:
        return node.creator.seconds + sum(m.seconds for m in node.mutations)

    def chain(root: StorageNode) -> Tuple[str, ...]:
        # Depth-first, inputs before the storages that read them, without recursion: a
        # chain of unsaved storages can be as long as the forward.
        inputs: Dict[int, List[StorageNode]] = {}
        stack: List[StorageNode] = [root]
        while stack:
            node = stack[-1]
            if id(node) in chains:
                stack.pop()
                continue
            if id(node) not in inputs:
                inputs[id(node)] = [n for step in (node.creator,) + node.mutations for n in step_inputs(step)
                                    if n is not node and n.key not in saved and n.anchor is None]
                stack.extend(n for n in inputs[id(node)] if id(n) not in chains)
                continue
            stack.pop()
            keys: Dict[str, None] = {}
            for n in inputs[id(node)]:
                unsaved[n.key] = own_seconds(n)
                keys[n.key] = None
                keys.update(dict.fromkeys(chains[id(n)]))
            chains[id(node)] = tuple(keys)
        return chains[id(root)]

    def reads(root: StorageNode, unsaved_inputs: Tuple[str, ...]) -> Tuple[str, ...]:
        keys: Dict[str, None] = {}
        for node in [root] + [by_key[k] for k in unsaved_inputs]:
            for step in (node.creator,) + node.mutations:
                keys.update((n.key, None) for n in step_inputs(step) if n.key in saved and n is not root)
        return tuple(keys)

    out: Dict[str, SavedOp] = {}
    for key, nbytes in saved.items():
        node = by_key.get(key)
        if node is not None:
            inputs = chain(node)
            out[key] = SavedOp(nbytes, own_seconds(node), node.rebuildable(node.state), inputs, reads(node, inputs))
        elif key in frame.region_profile:  # a compiled region: one unit, rebuilt by rerunning it whole
            nbytes, seconds = frame.region_profile[key]
            # The whole compiled model's rerun brings back every save of the forward at once:
            # it can only move the peak into backward, so no plan is offered it (recompute_all
            # still reruns it, as asked).
            out[key] = SavedOp(nbytes, seconds, key != ROOT_REGION)
    return SavesProfile(out, unsaved)
