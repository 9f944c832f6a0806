"""The calm save path's bookkeeping: the ledger's checked count, the kept storages found through
the ledger's pins (what ``movable_bytes`` and making room read), the parameter walk and the
footprint's one pass, each against a reference computed the plain way."""
from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Dict, List, Set

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from bagualu2.offload import CopyEngine, HostArena
from bagualu2.plan.cost_model import CostModel
from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.runtime import ledger as ledger_module
from bagualu2.runtime.ledger import CalmPack, Kept, KeptUnpack, Pin, ResidencyLedger
from bagualu2.runtime.parameters import ParameterStorages, storages_of
from bagualu2.shared import Budget


def test_a_checked_count_refuses_what_crosses_the_target_and_counts_nothing() -> None:
    ledger = ResidencyLedger()
    a = torch.empty(1000, dtype=torch.uint8).untyped_storage()
    b = torch.empty(500, dtype=torch.uint8).untyped_storage()
    first = Pin(ledger, a)
    refused = Pin.__new__(Pin)
    refused._ledger, refused._ref = ledger, None
    assert ledger.acquire(b, refused, target=1400) is None  # 1000 + 500 > 1400
    assert refused._ref is None and ledger.resident == 1000 and ledger.pins == 1
    assert ledger.count(b._cdata) is None
    # A storage held already adds no bytes: never refused, and reported as held.
    again = Pin.__new__(Pin)
    again._ledger, again._ref = ledger, None
    assert ledger.acquire(a, again, target=0) is True
    assert ledger.count(a._cdata) == (2, 1000) and ledger.resident == 1000
    fits = Pin.__new__(Pin)
    fits._ledger, fits._ref = ledger, None
    assert ledger.acquire(b, fits, target=1500) is False  # 1500 exactly fits
    assert ledger.resident == 1500 and ledger.peak == 1500
    del first, again, fits
    assert ledger.resident == 0 and ledger.pins == 0


def test_live_pins_are_those_holding_counts_in_acquisition_order() -> None:
    class Other(Pin):
        __slots__ = ()

    ledger = ResidencyLedger()
    storages = [torch.empty(10 * (i + 1), dtype=torch.uint8).untyped_storage() for i in range(4)]
    pins = [Pin(ledger, s) for s in storages[:3]] + [Other(ledger, storages[3])]
    assert ledger.live(Pin) == [(p, s._cdata) for p, s in zip(pins[:3], storages)]
    assert ledger.live(Other) == [(pins[3], storages[3]._cdata)]
    pins[0].drop()
    del pins[1]
    assert [p for p, _ in ledger.live(Pin)] == [pins[1]]  # the third, now second in the list


def test_a_kept_record_is_its_own_count_and_gives_it_back_when_it_dies() -> None:
    """``Ledger.keep``: the record counts its storage once however many records share it, says
    whether it was held already, holds an op's output detached (no reference cycle through its
    grad_fn), and gives its count back when dropped or when it dies, with no read in between."""
    ledger = ResidencyLedger()
    x = torch.randn(16, requires_grad=True)
    y = x.sigmoid()
    first = ledger.keep(y, None, 0, 7, None)
    assert (first.shared, first.nbytes, first.frame, first.version) == (False, 64, 7, y._version)
    assert first.tensor.grad_fn is None and first.tensor.data_ptr() == y.data_ptr() and first.pin is first
    second = ledger.keep(y[2:], None, 0, 8, 0)  # held already: adds no bytes, so never refused
    assert second.shared and ledger.count(y.untyped_storage()._cdata) == (2, 64) and ledger.resident == 64
    assert [k for k, _ in ledger.live(Kept)] == [first, second]
    first.drop()
    first.drop()  # once only
    assert first.pin is None and ledger.count(y.untyped_storage()._cdata) == (1, 64)
    del second
    assert ledger.resident == 0 and ledger.pins == 0 and ledger.live(Kept) == []
    assert ledger.keep(torch.zeros(100), None, 0, 0, 399) is None and ledger.pins == 0  # 400 > 399: refused
    uncounted = Kept(y)
    assert uncounted.pin is None and uncounted.nbytes == 0 and uncounted.tensor.grad_fn is None
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        ledger.keep(object(), None, 0, 0, None)
    assert ledger.peak == 64


def test_the_calm_keep_takes_plain_tensors_and_leaves_the_rest_to_the_full_way() -> None:
    """``Ledger.keep_plain``: a parameter, or a tensor over a parameter's storage, is held
    uncounted; a plain tensor is kept and counted; a subclass, a view of a Parameter the set
    does not know, a save under another dispatch mode and one over the target go the full way
    (None), counting nothing."""
    ledger = ResidencyLedger()
    weight = torch.nn.Parameter(torch.randn(4, 4))
    known = torch.nn.Parameter(torch.randn(4, 4))
    params = {known.untyped_storage()._cdata}
    for held in (weight, known.detach(), known.t()):  # a Parameter; a plain tensor over a known storage
        kept = ledger.keep_plain(held, params, 0, None)
        assert kept is not None and kept.pin is None
    assert ledger.keep_plain(weight.t(), params, 0, None) is None  # a view of a Parameter not in the set

    class Sub(torch.Tensor):
        pass

    assert ledger.keep_plain(torch.randn(3).as_subclass(Sub), params, 0, None) is None
    assert ledger.keep_plain(torch.randn(100), params, 0, 399) is None
    with OpCounter():
        assert ledger.keep_plain(torch.randn(3), params, 0, None) is None
    assert ledger.pins == 0 and ledger.resident == 0
    kept = ledger.keep_plain(torch.randn(100), params, 3, 400)
    assert kept.pin is kept and kept.frame == 3 and ledger.resident == 400


def test_the_unpack_hook_serves_kept_records_and_hands_the_rest_over() -> None:
    """``KeptUnpack``: an unchanged kept record's tensor comes back from C++; a changed one, a
    moved one, any other record, and the first unpack of each backward pass go to the fallback
    (which raises autograd's error for a changed one, follows a moved one, counts passes)."""
    ledger = ResidencyLedger()
    handed: List[object] = []
    unpack = KeptUnpack(lambda packed: handed.append(packed) or "fallback")
    t = torch.randn(8)
    kept = ledger.keep(t, None, 0, 0, None)
    assert unpack(kept) == "fallback" and handed == [kept]  # the first call: a new pass to count
    assert unpack(kept) is kept.tensor and len(handed) == 1
    assert unpack("other") == "fallback"
    t.add_(1)
    assert unpack(kept) == "fallback"
    moved = ledger.keep(torch.randn(8), None, 0, 0, None)
    moved.moved = "elsewhere"
    assert unpack(moved) == "fallback" and handed[-1] is moved


def test_the_hooks_take_one_argument_and_a_cycle_through_one_is_collected() -> None:
    """The per-save types are written against the C API: a hook called wrongly raises (no
    crash), a record's fields cannot be deleted, and a hook in a reference cycle (its fallback
    holds what holds it, as a runtime's bound method does) is freed by the garbage collector."""
    ledger, runtime = ResidencyLedger(), ActivationRuntime(None)
    unpack = KeptUnpack(lambda packed: packed)
    with pytest.raises(TypeError, match="one positional argument"):
        unpack(1, 2)
    with pytest.raises(TypeError, match="one positional argument"):
        unpack(packed=1)
    with pytest.raises(ValueError, match="must be callable"):
        KeptUnpack(3)
    with pytest.raises(ValueError, match=r"must be a bagualu2\.[\w.]*Ledger"):
        CalmPack(object(), runtime.residency, Frame(), print)
    kept = ledger.keep(torch.randn(4), None, 0, 0, None)
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del kept.node
    with pytest.raises(ValueError, match="only be cleared"):
        kept.tensor = torch.randn(4)
    with pytest.raises(TypeError):
        type("Sub", (Kept,), {})  # final: the hooks check the exact type

    class Owner:
        def fallback(self, x: object) -> object:
            return x

    for make in (lambda o: KeptUnpack(o.fallback), lambda o: CalmPack(ledger, runtime.residency, Frame(), o.fallback)):
        owner = Owner()
        owner.hook = make(owner)  # type: ignore[attr-defined]
        alive = weakref.ref(owner)
        del owner
        gc.collect()
        assert alive() is None


def test_a_kept_output_runs_no_dispatch_mode_and_a_python_error_inside_keeps_its_type() -> None:
    """The record of an op's output is made without a Python call, even with a dispatch mode on
    the stack (torch would copy its metadata through the mode's ``detach``: Python code, where an
    interrupt can land); a Python error raised inside the record's making (here an interrupt in
    an ``isinstance`` check) comes out as itself, not as torch's empty ``RuntimeError``."""
    y = torch.randn(4, requires_grad=True) * 2
    with OpCounter() as mode:
        kept = Kept(y)
    assert mode.ops == 0 and kept.tensor.grad_fn is None and kept.tensor.data_ptr() == y.data_ptr()

    class Interrupting:
        @property  # type: ignore[misc]
        def __class__(self) -> type:  # what isinstance reads
            raise KeyboardInterrupt("inside the record")

    with pytest.raises(KeyboardInterrupt, match="inside the record"):
        Kept(Interrupting())


class OpCounter(TorchDispatchMode):
    """A dispatch mode on the stack (what the calm keep leaves to the full way), counting the ops
    it sees."""

    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _Save(torch.autograd.Function):
    """Saves exactly the tensors it is given: each one packed by the runtime's hook."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *saved: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(*saved)
        return anchor * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.saved_tensors
        return (grad * 2,) + (None,) * len(ctx.saved_tensors)


_ACTION = st.one_of(
    st.tuples(st.just("save"), st.lists(st.integers(0, 5), min_size=1, max_size=4)),
    st.tuples(st.just("drop"), st.integers(0, 7)),
    st.tuples(st.just("pin"), st.integers(0, 5)),
    st.tuples(st.just("unpin"), st.integers(0, 7)),
    st.tuples(st.just("bump"), st.integers(0, 5)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 64), min_size=6, max_size=6), actions=st.lists(_ACTION, max_size=25))
def test_movable_bytes_are_the_storages_only_unchanged_kept_saves_hold(sizes: List[int], actions: list) -> None:
    """Untraced frames keep what they save; the kept storages ``_make_room`` may move are found
    through the ledger's pins. Against a reference kept here: a storage is movable while live
    kept saves hold it, nothing else pins it, and none of them changed since; the ledger holds
    exactly the storages live graphs or pins hold, one count per holder, each given back once
    (so the resident bytes and the pins count return to zero at the end)."""
    tensors = [torch.zeros(n) for n in sizes]
    tensors.append(tensors[0][1:])  # a view: its saves hold tensor 0's storage
    runtime = ActivationRuntime(CopyEngine(HostArena(1 << 20)), budget_bytes=1 << 30)
    anchor = torch.ones(1, requires_grad=True)
    graphs: List[tuple] = []  # (output, [(storage cdata, tensor, its version) of each save])
    pins: List[tuple] = []  # (pin, cdata)
    frames = 0
    for action, arg in actions:
        if action == "save":
            frame = Frame(index=frames)
            frame.traced = False
            frame.budget = Budget(1 << 30)
            frames += 1
            chosen = [tensors[i] if i < 5 else tensors[6] for i in arg]
            with runtime.frame(frame):
                graphs.append((_Save.apply(anchor, *chosen), [(t.untyped_storage()._cdata, t, t._version)
                                                               for t in chosen]))
        elif action == "drop" and graphs:
            del graphs[arg % len(graphs)]
        elif action == "pin":
            storage = tensors[arg].untyped_storage()
            pins.append((Pin(runtime.ledger, storage), storage._cdata))
        elif action == "unpin" and pins:
            pin, _ = pins.pop(arg % len(pins))
            if arg % 2:
                pin.drop()
            del pin
        elif action == "bump":
            tensors[arg].add_(1)
        saves: Dict[int, int] = {}
        changed: Set[int] = set()
        for entries in [entries for _, entries in graphs]:  # no output held past the loop
            for cdata, t, version in entries:
                saves[cdata] = saves.get(cdata, 0) + 1
                if t._version != version:
                    changed.add(cdata)
        pinned = {cdata for _, cdata in pins}
        nbytes = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
        movable = sum(nbytes[c] for c in saves if c not in pinned and c not in changed)
        assert runtime.residency.movable_bytes() == movable
        assert runtime.ledger.resident == sum(nbytes[c] for c in set(saves) | pinned)
        assert runtime.ledger.pins == sum(saves.values()) + len(pins)
        for cdata, count in saves.items():
            assert runtime.ledger.count(cdata)[0] == count + sum(1 for _, c in pins if c == cdata)
    graphs.clear()
    pins.clear()
    assert runtime.ledger.resident == 0 and runtime.ledger.pins == 0 and runtime.residency.movable_bytes() == 0


def test_the_parameter_walk_finds_what_parameters_and_buffers_yield() -> None:
    """``set_parameters_of(model)`` knows the storages ``model.parameters()`` and
    ``model.buffers()`` hold (shared modules and parameters, ``None`` entries, buffers, a
    parameter whose data was replaced since, a wrapper subclass known by the tensors it holds)
    as ``set_parameters`` does: a tensor over any of them that is saved is held uncounted, an
    activation is counted."""
    from torch.testing._internal.two_tensor import TwoTensor

    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.BatchNorm1d(3), torch.nn.Sequential(shared, torch.nn.Linear(3, 2)))
    model[2][1].bias = None
    model.register_buffer("nothing", None)
    model[1].weight.data = torch.ones(3)  # a new storage under the same parameter
    model.register_parameter("pair", torch.nn.Parameter(TwoTensor(torch.zeros(2), torch.ones(2))))
    held = [t for p in itertools.chain(model.parameters(), model.buffers())
            for t in ((p.a, p.b) if isinstance(p, TwoTensor) else (p,))]
    assert len({t.untyped_storage()._cdata for t in held}) == 10
    # Plain tensors over those storages: neither parameters nor views of one.
    over = [torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()) for t in held]
    activation = torch.zeros(5)
    anchor = torch.ones(1, requires_grad=True)
    for set_parameters in ("walked", "listed"):
        runtime = ActivationRuntime()
        if set_parameters == "walked":
            runtime.residency.set_parameters_of(model)
        else:
            runtime.residency.set_parameters(itertools.chain(model.parameters(), model.buffers()))
        frame = Frame()
        frame.traced = False
        with runtime.frame(frame):
            out = _Save.apply(anchor, *over, activation)
        assert runtime.ledger.resident == activation.untyped_storage().nbytes(), set_parameters
        del out
        assert runtime.ledger.resident == 0


def _fresh_walk(model: torch.nn.Module) -> Set[int]:
    return {s._cdata for t in itertools.chain(model.parameters(), model.buffers()) for s in storages_of(t)}


_CHANGES = ("nothing", "setattr", "data", "table", "buffer", "append", "replace", "apply")


def _change(model: torch.nn.Sequential, change: str, at: int) -> None:
    """One way a model's parameter storages change after ``enable``, none holding the old ones."""
    layer = model[at % len(model)]
    if change == "setattr":
        layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
    elif change == "data":
        layer.weight.data = torch.randn_like(layer.weight)
    elif change == "table":  # written directly, as FSDP2 swaps its parameters: no registration hook runs
        layer._parameters["bias"] = torch.nn.Parameter(torch.randn_like(layer.bias))
    elif change == "buffer":
        layer.register_buffer("scale", torch.ones(2))
    elif change == "append":
        model.append(torch.nn.Linear(3, 3))
    elif change == "replace":
        model[at % len(model)] = torch.nn.Linear(3, 3)
    elif change == "apply":
        model.double() if model[0].weight.dtype == torch.float32 else model.float()


@settings(max_examples=60, deadline=None)
@given(changes=st.lists(st.tuples(st.sampled_from(_CHANGES), st.integers(0, 7)), min_size=1, max_size=12))
def test_parameter_storages_are_walked_again_whenever_the_model_may_have_changed(changes: List) -> None:
    """``ParameterStorages``: what the last walk found is vouched for (``current``) only while it
    is still every parameter and buffer storage of the model, whichever way they changed since
    (a registration, a storage replaced under a parameter, a table written directly, a module
    added or replaced, a conversion); with nothing changed the walk is reused."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    storages = ParameterStorages()
    found = storages.walk(model)
    assert found == _fresh_walk(model) and storages.current(model)
    for change, at in changes:
        _change(model, change, at)
        assert storages.current(model) == (change == "nothing"), change  # reused only where nothing changed
        if change != "nothing":
            found = storages.walk(model)
        assert found == _fresh_walk(model), change
    assert not storages.current(torch.nn.Linear(3, 3))  # another model is walked anew
    storages.forget()
    assert not storages.current(model)


def test_a_storage_kept_alive_elsewhere_and_replaced_without_registration_is_missed_on_the_budgets_side() -> None:
    """The one change a reused walk misses: a parameter's storage replaced without a registration
    while something else still holds the old one. The old address stays that storage's (it cannot
    go to an activation), and a save of the new one is counted: the set errs on the budget's side."""
    model = torch.nn.Linear(3, 3)
    runtime = ActivationRuntime()
    runtime.residency.set_parameters_of(model)
    old = model.weight.data  # held here: its storage lives on
    model.weight.data = torch.randn(3, 3)
    runtime.residency.set_parameters_of(model)
    anchor = torch.ones(1, requires_grad=True)
    frame = Frame()
    frame.traced = False
    with runtime.frame(frame):
        out = _Save.apply(anchor, torch.empty(0).set_(model.weight.untyped_storage()))
    assert runtime.ledger.resident == model.weight.untyped_storage().nbytes()
    del out, old
    runtime.residency.set_parameters_of(model)  # the old storage died: walked again, the new one known
    with runtime.frame(Frame()):
        out = _Save.apply(anchor, torch.empty(0).set_(model.weight.untyped_storage()))
    assert runtime.ledger.resident == 0


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["a", "b", "experts.0", "experts.1", "experts"]),
                              st.integers(0, 5000), st.booleans()), min_size=1, max_size=8, unique_by=lambda o: o[0]),
       routed=st.lists(st.integers(0, 40), min_size=2, max_size=2), profiled=st.lists(st.integers(1, 40), min_size=2,
                                                                                          max_size=2),
       min_bytes=st.integers(0, 3000), can_offload=st.booleans(), no_counts=st.booleans())
def test_floors_and_total_in_one_pass_are_floors_and_predict_total(ops: list, routed: List[int], profiled: List[int],
                                                                     min_bytes: int, can_offload: bool,
                                                                     no_counts: bool) -> None:
    cost = CostModel({0: "experts"})
    saved = {f"{path}:op:0": (nbytes, 1e-3, recomputable, ()) for path, nbytes, recomputable in ops}
    cost.observe(saved, {0: profiled}, forward_seconds=0.01)
    keys = list(saved) + ["unknown:op:0"]
    counts = {} if no_counts else {0: routed}
    soft, hard, total = cost.floors_and_total(keys, counts, min_bytes, can_offload)
    assert (soft, hard) == cost.floors(keys, counts, min_bytes, can_offload)
    assert total == cost.predict_total(keys, counts) == sum(cost.predict_bytes(k, counts) for k in keys)
    # The reference: each key sized on its own (what the planner's candidates read).
    kept = [(op, n) for _, op, n, releasable in cost.memory.sized(keys, counts, min_bytes, can_offload, ())
            if not releasable]
    assert soft == sum(n for _, n in kept) == cost.candidates(keys, counts, min_bytes, can_offload)[1]
    assert hard == sum(n for op, n in kept if not (can_offload or op.recomputable))


def _import_bagualu2(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` run before and after ``import bagualu2`` in a fresh interpreter, every warning
    shown, with ``env`` over this process's environment (BAGUALU2_SAVE_PATH unset unless given)."""
    environ = {k: v for k, v in os.environ.items() if k != "BAGUALU2_SAVE_PATH"}
    environ.update(env)
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300,
                          env=environ)


_STEP = """
import torch, warnings
from bagualu2.runtime import ActivationRuntime, Frame
from bagualu2.runtime import ledger as ledger_module
from bagualu2.runtime import ledger
runtime = ActivationRuntime()
x = torch.randn(8, requires_grad=True)
(x.sigmoid() * x).sum().backward()
plain, x.grad = x.grad, None
with runtime.frame(Frame()):
    y = (x.sigmoid() * x).sum()
assert runtime.ledger.resident > 0
y.backward()
assert runtime.ledger.resident == 0 and torch.equal(x.grad, plain)
print("SAVE_PATH", ledger.SAVE_PATH)
"""


@pytest.mark.skipif(ledger_module.SAVE_PATH != "compiled", reason="bagualu2._saves is not built here")
def test_a_save_path_built_for_another_torch_release_runs_in_python_with_one_warning() -> None:
    """torch's C++ ABI holds within a release: bagualu2._saves, built against one, is not loaded
    under another; the package imports and runs its save path in Python instead, with one
    warning that names the cost and the command that rebuilds it (which never touches torch)."""
    run = _import_bagualu2("import torch; torch.__version__ = '2.99.0'; import bagualu2; import bagualu2" + _STEP)
    assert run.returncode == 0, run.stderr
    assert "SAVE_PATH python" in run.stdout
    assert run.stderr.count("SavePathWarning") == 1, run.stderr
    assert "built against torch 2." in run.stderr and "torch 2.99.0" in run.stderr
    assert "host cost" in run.stderr and "pip install --no-build-isolation --no-deps" in run.stderr
    # Asked for by name, the compiled form is an error that says how to rebuild.
    run = _import_bagualu2("import torch; torch.__version__ = '2.99.0'; import bagualu2", BAGUALU2_SAVE_PATH="compiled")
    assert run.returncode != 0 and "torch 2.99.0" in run.stderr and "--no-build-isolation" in run.stderr


_UNLOADABLE = """
import importlib.abc, importlib.machinery, sys
class Unloadable(importlib.abc.MetaPathFinder, importlib.abc.Loader):  # a _saves of another torch's symbols
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "bagualu2._saves" else None
    def create_module(self, spec):
        raise ImportError("undefined symbol: _ZN3c10 (another torch)")
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Unloadable())
"""


def test_a_save_path_missing_or_unloadable_runs_in_python_with_one_warning() -> None:
    """A build that could not import torch (an isolated ``pip install .``) has no _saves, and a
    _saves of another torch may not load at all: the same warning, the same results."""
    run = _import_bagualu2("import sys; sys.modules['bagualu2._saves'] = None; import bagualu2" + _STEP)
    assert run.returncode == 0, run.stderr
    assert "SAVE_PATH python" in run.stdout and run.stderr.count("SavePathWarning") == 1, run.stderr
    assert "was not built" in run.stderr and "--no-build-isolation" in run.stderr
    run = _import_bagualu2(_UNLOADABLE + "import bagualu2" + _STEP)
    assert run.returncode == 0, run.stderr
    assert "SAVE_PATH python" in run.stdout and run.stderr.count("SavePathWarning") == 1, run.stderr
    assert "does not load with torch" in run.stderr and "another torch" in run.stderr
    run = _import_bagualu2("import bagualu2" + _STEP, BAGUALU2_SAVE_PATH="python")  # asked for: no warning
    assert run.returncode == 0 and "SAVE_PATH python" in run.stdout and "Warning" not in run.stderr, run.stderr


# What the Python form runs in the fast lane: this file's tests, and end-to-end exactness (plans
# keeping, offloading and recomputing per operator; calm blocks in a traced forward; an untraced
# forward offloading to stay within its budget), each against the plain step.
PYTHON_FORM_TESTS = [
    "tests/test_save_path.py",
    "tests/test_activations.py::test_exactness_random_per_operator_plans",
    "tests/test_activations.py::test_exactness_views_casts_shared_storage",
    "tests/test_activations.py::test_untraced_forward_over_budget_offloads_exactly_within_the_budget",
    "tests/test_calm_blocks.py::test_only_the_blocks_a_plan_releases_from_are_traced_and_the_step_is_exact",
]


@pytest.mark.skipif(ledger_module.SAVE_PATH != "compiled", reason="this process runs the Python form already")
def test_the_python_form_passes_the_save_path_tests_and_is_exact_end_to_end() -> None:
    """The save path's Python form (bagualu2.runtime.saves_python) behaves as the compiled one:
    this file's tests, and the steps above, run under it (BAGUALU2_SAVE_PATH=python)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "BAGUALU2_SAVE_PATH": "python"}
    # From this process's directory, so that the same bagualu2 is imported (an installed one, or the checkout's).
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root),
                          "-c", str(root / "pyproject.toml"), *(str(root / test) for test in PYTHON_FORM_TESTS)],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


_LEDGER_ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("keep"), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 400))),
    st.tuples(st.just("plain"), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 400))),
    st.tuples(st.just("pin"), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 400))),
    st.tuples(st.just("drop"), st.integers(0, 30), st.none()),
    st.tuples(st.just("forget"), st.integers(0, 30), st.none()),
    st.tuples(st.just("bump"), st.integers(0, 5), st.none()),
    st.tuples(st.just("peak"), st.integers(0, 1), st.none()),
), max_size=40)


@pytest.mark.skipif(ledger_module.SAVE_PATH != "compiled", reason="bagualu2._saves is not built here")
@settings(max_examples=80, deadline=None)
@given(actions=_LEDGER_ACTIONS)
def test_the_python_ledger_answers_as_the_compiled_one(actions: list) -> None:
    """The two forms side by side on one sequence of keeps (plain and full), pins, drops, deaths
    and in-place writes: every answer the same (what each call returns, the records' fields, the
    counts, resident and peak bytes, the live holders in order, what the unpack hook serves)."""
    import bagualu2._saves as compiled
    from bagualu2.runtime import saves_python as python

    class P:  # a pin, for either ledger
        __slots__ = ("_ref", "__weakref__")

    def run(form) -> list:  # type: ignore[no-untyped-def]
        base = [torch.zeros(8 * (i + 1)) for i in range(4)]  # fresh: each run bumps their versions
        sources = base + [base[0][2:], torch.nn.Parameter(torch.zeros(3))]
        params = {sources[5].untyped_storage()._cdata}
        ledger, out, holders = form.Ledger(), [], []
        ids = {t.untyped_storage()._cdata: i for i, t in reversed(list(enumerate(sources)))}  # a storage by its tensor
        unpack = form.KeptUnpack(lambda packed: "fallback")
        for action, i, target in actions:
            if action in ("keep", "plain"):
                t = sources[i]
                kept = (ledger.keep(t, None, 0, len(holders), target) if action == "keep"
                        else ledger.keep_plain(t, params, len(holders), target))
                out.append(None if kept is None else (kept.shared, kept.nbytes, kept.frame, kept.version,
                                                      kept.pin is kept, kept.tensor.data_ptr() - t.data_ptr()))
                if kept is not None:
                    holders.append(kept)
                    out.append(unpack(kept) is kept.tensor)
                del kept  # the holders list alone holds it
            elif action == "pin":
                pin = P()
                out.append(ledger.acquire(sources[i].untyped_storage(), pin, target))
                if getattr(pin, "_ref", None) is not None:
                    holders.append(pin)
                del pin
            elif action == "drop" and holders:
                h = holders[i % len(holders)]
                h.drop() if hasattr(h, "drop") else ledger.release(h._ref)
                del h
            elif action == "forget" and holders:
                del holders[i % len(holders)]
            elif action == "bump":
                with torch.no_grad():
                    base[i % 4].add_(1)
                out.append([unpack(k) is k.tensor for k in holders if hasattr(k, "drop")])
            elif action == "peak":
                ledger.reset_peak() if i else setattr(ledger, "peak", ledger.resident)
            out.append((ledger.resident, ledger.peak, ledger.pins,
                        [ledger.count(s.untyped_storage()._cdata) for s in sources],
                        [(holders.index(h), ids[cdata]) for h, cdata in ledger.live(form.Kept)],
                        [(holders.index(h), ids[cdata]) for h, cdata in ledger.live(P)]))
        holders.clear()
        out.append((ledger.resident, ledger.pins))
        return out

    assert run(python) == run(compiled)
