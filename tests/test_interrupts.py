"""An interrupt stays itself, at every line of the frame and rerun scopes (docs/CONTRACTS.md invariant 7).

A line tracer (``sys.settrace``) raises KeyboardInterrupt at a line of the functions that enter
and leave a frame's scopes (the saved-tensor hooks, the tracing mode, a rerun block's untraced
stretch, and torch's own ``TorchDispatchMode`` entry and exit they call), the first time it runs
from a given caller, for every such line in turn (lines of instructions that run no Python code and check for
no signal excepted: no real interrupt lands there). Each time, what the step raised must be that KeyboardInterrupt, not an
error of a cleanup it cut short carrying it as ``__context__`` (a training loop's ``except
KeyboardInterrupt:`` would miss it); afterwards nothing is held, no scope is left on the thread,
and the next step is bit-exact against plain PyTorch. The timer storms of tests/test_faults.py
land at random; this lands everywhere, deterministically.
"""
from __future__ import annotations

import copy
import dis
import functools
import sys
from types import CodeType
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

import bagualu2
from bagualu2.runtime import ActivationRuntime, recipes
from bagualu2.runtime.recipes import is_recomputing
from bagualu2.runtime.rerun import BlockRerun
from bagualu2.runtime.tracing import TracingMode
from test_faults import assert_exact, assert_no_scope_left, assert_nothing_held, keep_all_peak, make_model, step

# The entries and exits of a block rerun's untraced stretch in the forward, and of the mode.
RERUN_SCOPE = [ActivationRuntime._open_rerun, ActivationRuntime._close_rerun, TracingMode.place,
               TorchDispatchMode.__enter__, TorchDispatchMode.__exit__]
# ... and of the frame, and the rerun in backward.
FRAME_SCOPE = RERUN_SCOPE + [
    ActivationRuntime._frame_scope.__wrapped__, ActivationRuntime._close_frame, ActivationRuntime._clear_left_scopes,
    ActivationRuntime._close_left_frame, ActivationRuntime.collect, BlockRerun.take, BlockRerun._rerun,
    recipes.ReplayDepth.__enter__, recipes.ReplayDepth.__exit__,
]


# Instructions that run no Python code and at which the interpreter does not check for signals:
# a line made only of them cannot be where a real interrupt lands.
_QUIET = frozenset({"NOP", "CACHE", "POP_EXCEPT", "JUMP_FORWARD", "POP_TOP", "LOAD_CONST", "LOAD_FAST",
                    "STORE_FAST", "RETURN_VALUE", "PUSH_EXC_INFO", "COPY", "SWAP", "RERAISE"})


@functools.lru_cache(maxsize=None)
def _quiet_lines(code: CodeType) -> FrozenSet[int]:
    """The lines of ``code`` made only of quiet instructions (``try:``, ``pass`` closing an
    ``except``). A tracer's exception raised there is not one a signal could raise: in CPython
    3.11 one at a ``try:`` NOP even skips the ``with`` exits around it."""
    ops: Dict[int, Set[str]] = {}
    for ins in dis.get_instructions(code):
        if ins.positions is not None and ins.positions.lineno is not None:
            ops.setdefault(ins.positions.lineno, set()).add(ins.opname)
    return frozenset(line for line, names in ops.items() if names <= _QUIET)


class LineInterrupt:
    """A tracer that raises KeyboardInterrupt the first time the line labelled ``at`` runs in
    ``functions`` (``at`` None: records the labels, and raises nowhere). A line's label names its
    function, its number and its caller's function (``place`` runs from five places)."""

    def __init__(self, functions: Sequence[Callable[..., Any]], at: Optional[str] = None) -> None:
        self.codes = {f.__code__ for f in functions}
        self.at = at
        self.lines: List[str] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self._line if frame.f_code in self.codes else None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        code: CodeType = frame.f_code
        if event == "line" and frame.f_lineno not in _quiet_lines(code):
            label = f"{code.co_name}:{frame.f_lineno} from {frame.f_back.f_code.co_name}"
            self.lines.append(label)
            if label == self.at:
                self.at = None  # once
                raise KeyboardInterrupt(f"at {label}")
        return self._line


def every_line(policy: str, functions: Sequence[Callable[..., Any]]) -> int:
    """Interrupt a spiking step at each line of ``functions`` in turn, where it first runs from
    each of its callers (each later block's rerun goes the same way as the first's); see the
    module note. Returns how many lines were interrupted."""
    model = make_model()
    plain = copy.deepcopy(model)
    budget = int(keep_all_peak(model) * 0.7) if policy == "adaptive" else None
    prov = bagualu2.enable(model, budget=budget, policy=policy, min_bytes=0)
    step(model, 0)
    step(model, 1, spike=2.6)
    counter = LineInterrupt(functions)
    sys.settrace(counter)
    try:
        step(model, 2, spike=2.6)
    finally:
        sys.settrace(None)
    assert counter.lines, "the tracer saw no line of the scopes: the step took another path"
    labels = list(dict.fromkeys(counter.lines))
    missed = []
    for k, label in enumerate(labels):
        tracer = LineInterrupt(functions, at=label)
        sys.settrace(tracer)
        raised = None
        try:
            step(model, 3, spike=2.6)
        except BaseException as e:  # noqa: B036 - what the step raised is what is checked
            # Only its description is kept: its traceback holds the interrupted frames' locals.
            raised = f"{e!r} (context {e.__context__!r})" if type(e) is not KeyboardInterrupt else str(e)
        finally:
            sys.settrace(None)
        where = f"interrupted at {label} ({policy})"
        if raised is None:
            # Adaptive plans from measured times: this step took another path than the first.
            missed.append(label)
        else:
            assert raised == f"at {label}", f"{where}: the step raised {raised}"
        try:
            assert_nothing_held(prov)
            assert_no_scope_left()
            # An interrupt delivered as a replay's exit is entered (where a function call checks
            # for signals) leaves the replay depth raised: the next provisioned forward clears it
            # (reset_replay_depth), before any gate could read it.
            assert_exact(model, plain, 10 + k % 3, spike=2.6 if k % 2 else 0.0)
            assert not is_recomputing()
            assert_nothing_held(prov)
            assert prov.runtime.mode.suspended == 0
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
    assert len(missed) <= len(labels) // 10, f"{len(missed)} of {len(labels)} lines did not run again: {missed}"
    return len(labels) - len(missed)


def test_an_interrupt_at_every_line_of_a_block_rerun_s_exit_stays_itself() -> None:
    """The reported case: under ``recompute_all``, an interrupt in ``_close_rerun`` after the
    rerun ended and before the tracing mode was back surfaced as ``IndexError: pop from an
    empty deque`` from the frame's exit."""
    assert every_line("recompute_all", [ActivationRuntime._close_rerun]) >= 4


@pytest.mark.slow
def test_an_interrupt_at_every_line_of_a_block_rerun_s_entry_and_exit_and_the_mode_s_stays_itself() -> None:
    assert every_line("recompute_all", RERUN_SCOPE) >= 30


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute_all", "adaptive"])
def test_an_interrupt_at_every_line_of_the_frame_and_rerun_scopes_stays_itself(policy: str) -> None:
    assert every_line(policy, FRAME_SCOPE) >= 60
