"""Block reruns: the blocks an adaptive micro-batch reruns whole instead of being traced.

Design note
-----------
A micro-batch whose saves would not fit must release some. Planning operator by operator
(``GateDecisions``) needs recipes, so a traced forward, and tracing costs every aten op a
Python call whether or not the plan releases it. A block rerun whole in backward needs no
trace (``bagualu2.runtime.rerun.BlockRerun``, what ``torch.utils.checkpoint`` does): a layer,
or, where a layer issues collectives (expert parallelism's token exchange, which backward must
not issue again), each of its experts. So where reruns free what the budget needs for less
than offloading it would cost, the micro-batch is not traced at all (``Frame.rerun_chosen``):
the blocks chosen rerun, everything else saves as a calm forward does, and what the runtime
still finds over the budget at a save it offloads (the safety net of every untraced forward).
The provisioner asks ``BlockReruns.choose`` as each forward begins (at the last routing) and
at each gate (at this micro-batch's own, among the blocks not begun: its own layer's experts
and every later block), so a spike's hot expert is rerun from the gate that sees it.

Invariants:

* Only blocks the runtime can rerun are chosen (``ActivationRuntime.rerunnable_blocks``: no
  collective, no other effect a rerun repeats), and at a gate only blocks not yet begun.
* The blocks chosen are the cheapest way the cost model sees to free ``need`` bytes with
  offloads taking the rest: blocks in order of rerun seconds per byte freed (what the
  operators a block runs save, less its output, which what follows saves either way; the input
  its rerun holds is the block before's output), as many as minimise their seconds plus what offloading the
  remainder costs. Where offloads cannot be relied on (no copy engine, copies that do not run
  beside the compute, an offload that failed), blocks cover all they can.
* A block's rerun seconds are its operators' share of the profiled op time, of an untraced
  forward's measured seconds: profiled op times carry tracing's price, which a rerun does not.
* A block is chosen only where its rerun fits (``rerun_peaks``): backward rebuilds all it saves
  at once, beside what the forward kept before it (the operators outside the blocks chosen,
  and the inputs of the reruns before it), so a block larger than the room that leaves would
  cross the budget in backward however little the forward held. The blocks that fit are a
  prefix of the candidates; what they leave is offloaded, as in any untraced forward.
"""

from __future__ import annotations

import itertools
import math

from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple


from bagualu2.plan.cost_model import CostModel
from bagualu2.plan.cost_model.memory import driving_tokens

__all__ = ["BlockReruns", "cheapest"]


class BlockReruns:
    """Chooses the blocks a micro-batch reruns whole (see the module note)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._owner: Dict[str, Optional[str]] = {}  # operator key -> its outermost block (or None)
        self._blocks: Tuple[str, ...] = ()  # the blocks ``_owner`` was made for
        # Seconds of an untraced forward (what a rerun repeats, without tracing's price, which
        # profiled op times carry): the last ones', smoothed; None before one ran.
        self.forward_s: Optional[float] = None

    def observe_forward(self, seconds: float) -> None:
        """An untraced forward took ``seconds``."""
        self.forward_s = seconds if self.forward_s is None else 0.8 * self.forward_s + 0.2 * seconds

    def _block_of(self, blocks: Sequence[str]) -> Dict[str, Optional[str]]:
        if tuple(blocks) != self._blocks or len(self._owner) != len(self.cost.order):
            self._blocks = tuple(blocks)
            self._owner = {}
            for key in self.cost.order:
                path = key.partition(":")[0]
                self._owner[key] = next((b for b in blocks if path == b or path.startswith(b + ".")), None)
        return self._owner

    def sizes(self, blocks: Sequence[str], counts: Mapping[int, Sequence[int]],
              outputs: Mapping[str, int]) -> Dict[str, Tuple[int, float]]:
        """Each of ``blocks``' predicted bytes freed by rerunning it (what it saves, less the
        output, ``outputs``, which what follows it saves either way: its input is the block
        before's output) and rerun seconds, at ``counts``: its operators'
        share of the profiled op time, of an untraced forward's seconds."""
        owner = self._block_of(blocks)
        out: Dict[str, List[float]] = {b: [0, 0.0] for b in blocks}
        cost = self.cost
        total = 0.0
        for key in cost.order:
            op = cost.ops[key]
            seconds = max(0.0, op.seconds(driving_tokens(op, counts)))
            total += seconds
            block = owner.get(key)
            if block is not None:
                out[block][0] += cost.predict_bytes(key, counts)
                out[block][1] += seconds
        forward = cost.forward_seconds if self.forward_s is None else self.forward_s
        scale = forward / total if total > 0 else 0.0
        return {b: (max(0, int(v[0]) - outputs.get(b, 0)), v[1] * scale) for b, v in out.items()}

    def rerun_peaks(self, blocks: Sequence[str], chosen: Sequence[str], counts: Mapping[int, Sequence[int]],
                    outputs: Mapping[str, int]) -> Dict[str, int]:
        """Each of ``blocks``' predicted bytes held while backward reruns it, at ``counts``, were it
        and those of ``blocks`` before it rerun beside ``chosen``: all it saves, what the
        operators before it that no rerun covers saved, and the outputs of the reruns before
        it (each one's input, which its rerun holds)."""
        rerun = set(blocks) | set(chosen)
        owner = self._block_of(list(rerun))
        held, outs = 0, 0
        full: Dict[str, int] = {}
        before: Dict[str, int] = {}
        for key in self.cost.order:
            block = owner.get(key)
            nbytes = self.cost.predict_bytes(key, counts)
            if block is None:
                held += nbytes
                continue
            if block not in before:
                before[block] = held + outs
                outs += outputs.get(block, 0)
            full[block] = full.get(block, 0) + nbytes
        return {b: before.get(b, held + outs) + full.get(b, 0) for b in blocks}

    def choose(self, need: int, blocks: Sequence[str], counts: Mapping[int, Sequence[int]],
               outputs: Mapping[str, int], offload_seconds: Callable[[int], float], room: int,
               chosen: Sequence[str] = ()) -> FrozenSet[str]:
        """The blocks of ``blocks`` (in model order) to rerun so that they and offloads free
        ``need`` bytes at ``counts`` (``outputs``: the bytes each one returns) at the least
        predicted cost (``cheapest``), among those whose rerun fits ``room`` (the bytes this
        micro-batch may hold; ``chosen``: blocks it reruns already)."""
        if need <= 0:
            return frozenset()
        peaks = self.rerun_peaks(blocks, chosen, counts, outputs)
        fitting = list(itertools.takewhile(lambda b: peaks[b] <= room, blocks))
        return cheapest(need, self.sizes(fitting, counts, outputs), fitting, offload_seconds)


def cheapest(need: int, sizes: Mapping[str, Tuple[int, float]], blocks: Sequence[str],
             offload_seconds: Callable[[int], float]) -> FrozenSet[str]:
    """The blocks to rerun, of ``blocks`` (in the order the forward runs them; ``sizes``: bytes
    freed and rerun seconds of each), so that they and offloads free ``need`` bytes: the first
    ones, as many as make the least sum of their seconds and what offloading the rest costs
    (``offload_seconds(bytes)``, 0 for 0 bytes); where the rest cannot be offloaded (infinite
    seconds), as many as leave the least of it. The first ones, because backward rebuilds a
    rerun block while the blocks before it still hold what they saved: a block rerun after kept
    ones would bring its saves back beside theirs, and free little at backward's peak."""
    order = [b for b in blocks if sizes[b][0] > 0]

    def cost(rest: int, seconds: float) -> Tuple[int, float]:
        # Where the rest cannot be offloaded, less of it left over comes first.
        offload = offload_seconds(rest)
        return (rest, seconds) if math.isinf(offload) else (0, seconds + offload)

    best, best_cost = 0, cost(need, 0.0)
    freed, seconds = 0, 0.0
    for k, b in enumerate(order, 1):
        if freed >= need:
            break
        freed += sizes[b][0]
        seconds += sizes[b][1]
        total = cost(max(0, need - freed), seconds)
        if total < best_cost:
            best, best_cost = k, total
    return frozenset(order[:best])
