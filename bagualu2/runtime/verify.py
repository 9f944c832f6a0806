"""Run-time exactness check: what a forward released comes back to backward as it was saved.

Design note
-----------
bagualu2 promises that a released activation (offloaded to the host, or recomputed: replayed
op by op or rerun with its block) reaches backward bit for bit as autograd saved it. What can
break that is outside what bagualu2 sees cheaply (a write through ``.data`` or a NumPy alias,
Python-side state a rerun block reads, RNG outside torch's generators) or a defect of its own
(a reload read before its copy ended, a host block reused too early). ``enable(verify=...)``
checks it while training runs, at a cost a user can leave on:

* At the save (``Verifier.saved``), a released tensor's *fingerprint* is taken: the wrapping
  integer sum of its bits (one read of the tensor) and a sample of four of its elements, evenly
  spaced. ``"all"`` takes one of every released save, ``"sample"`` one of every
  ``SAMPLE_EVERY`` (counted over the runtime's life, so every key is reached in turn).
* When backward gets the tensor back (``Verifier.unpacked``), the same is taken of what it got.
  The two are compared once the backward pass ends (a callback queued on torch's engine): on a
  device, the fingerprints are device tensors and the one comparison is the pass's only host
  synchronization. Outside a backward pass (a saved tensor read from Python) it is compared at
  once.
* A mismatch raises ``bagualu2.ExactnessError`` (``on_mismatch="raise"``) naming the operator
  key, the micro-batch, how it was released and the first sampled element that differs; with
  ``on_mismatch="fallback"`` it is counted (``report()["verify"]``), warned of once, and the key
  is released no more: its later saves are kept (``distrusted``).

Invariants (tests/test_verify.py):

* Off costs nothing: no fingerprint, no wrapper on the hooks (the runtime installs the plain ones).
* A fingerprint is taken outside the tracing mode and autograd: it records no op and saves nothing.
* Every check taken is compared exactly once, in the pass that unpacked it, or at once outside one.
"""

from __future__ import annotations

import warnings
from typing import Any, List, NamedTuple, Optional, Set, Tuple

import torch

from bagualu2.errors import ExactnessError

__all__ = ["MODES", "ON_MISMATCH", "SAMPLE_EVERY", "Fingerprint", "Verifier", "fingerprint"]

MODES = ("off", "sample", "all")
ON_MISMATCH = ("raise", "fallback")
SAMPLE_EVERY = 32  # "sample": one released save in this many is fingerprinted

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SAMPLES = 4


class Fingerprint(NamedTuple):
    """What a released save looked like: its bits' sum and sampled bits (device tensors), where
    the sample lies (flat indices), and what names it in an error."""

    checksum: torch.Tensor
    sample: torch.Tensor
    where: Tuple[int, ...]
    dtype: torch.dtype
    key: str
    micro_batch: int
    how: str


def _taken(t: torch.Tensor, where: Optional[Tuple[int, ...]] = None) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...]]:
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        t = t.detach()
        bits = t.view(_BITS[t.element_size()]) if t.dtype is not torch.bool else t.view(torch.uint8)
        # Integer sums wrap, so any order of summation gives the same bits, and one element
        # changed by any amount changes them. Summed at their own width (a widening sum is many
        # times slower), whatever the layout: the sum of what backward got back must be taken
        # the same way as that of what was saved.
        checksum = bits.sum(dtype=bits.dtype)
        n = t.numel()
        if where is None:
            where = tuple(sorted({(n - 1) * i // (_SAMPLES - 1) for i in range(_SAMPLES)})) if n else ()
        if where:
            index = torch.unravel_index(torch.tensor(where, device=t.device), t.shape) if t.dim() else ()
            sample = bits[index] if t.dim() else bits.reshape(1)
        else:
            sample = bits.reshape(0)
        return checksum, sample, where


def fingerprint(t: torch.Tensor, key: str, micro_batch: int, how: str) -> Fingerprint:
    """The fingerprint of ``t`` (see the module note), named for an error."""
    checksum, sample, where = _taken(t)
    return Fingerprint(checksum, sample, where, t.dtype, key, micro_batch, how)


def _mismatch(fp: Fingerprint, checksum: torch.Tensor, sample: torch.Tensor) -> Optional[ExactnessError]:
    if torch.equal(checksum, fp.checksum) and torch.equal(sample, fp.sample):
        return None
    differs = (sample != fp.sample).nonzero().flatten().tolist()
    if differs:
        i = differs[0]
        value = lambda bits: bits[i:i + 1].view(fp.dtype).item() if fp.dtype is not torch.bool else bool(bits[i])
        return ExactnessError(fp.key, fp.micro_batch, fp.how, fp.where[i], value(fp.sample), value(sample))
    return ExactnessError(fp.key, fp.micro_batch, fp.how, None, None, None)


class Verifier:
    """A runtime's exactness check (see the module note): ``saved`` at release, ``unpacked``
    when backward gets it back; ``mismatches`` and ``checked`` count, ``distrusted`` lists the
    keys released no more after a mismatch under ``on_mismatch="fallback"``."""

    def __init__(self, mode: str = "off", on_mismatch: str = "raise") -> None:
        if mode not in MODES:
            raise ValueError(f"verify={mode!r}: use one of {', '.join(map(repr, MODES))}")
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch={on_mismatch!r}: use one of {', '.join(map(repr, ON_MISMATCH))}")
        self.mode = mode
        self.on_mismatch = on_mismatch
        self.every = {"off": 0, "sample": SAMPLE_EVERY, "all": 1}[mode]
        self.micro_batch = 0  # the runtime's frames so far: names the micro-batch in an error
        self.checked = 0
        self.mismatches = 0
        self.distrusted: Set[str] = set()
        self._released = 0
        self._pending: List[Tuple[Fingerprint, torch.Tensor, torch.Tensor]] = []
        self._task = -1  # the backward pass whose checks are pending
        self._told = False

    def saved(self, t: torch.Tensor, key: str, how: str) -> Optional[Fingerprint]:
        """A released save of ``t`` (``how``: offloaded, recomputed, rerun): its fingerprint
        when this one is checked, else None."""
        self._released += 1
        if self._released % self.every:
            return None
        return fingerprint(t, key, self.micro_batch, how)

    def unpacked(self, fp: Fingerprint, out: torch.Tensor) -> None:
        """Backward got ``out`` back for the save ``fp`` was taken of: compared as the pass ends."""
        checksum, sample, _ = _taken(out, fp.where)
        task = torch._C._current_graph_task_id()
        if task == -1:  # not inside a backward pass: nothing to queue behind
            self._settle([(fp, checksum, sample)])
            return
        if task != self._task or not self._pending:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._settle_pending)
        self._pending.append((fp, checksum, sample))

    def _settle_pending(self) -> None:
        pending, self._pending = self._pending, []
        self._settle(pending)

    def _settle(self, pending: List[Tuple[Fingerprint, torch.Tensor, torch.Tensor]]) -> None:
        first: Optional[ExactnessError] = None
        for fp, checksum, sample in pending:
            self.checked += 1
            error = _mismatch(fp, checksum, sample)
            if error is None:
                continue
            self.mismatches += 1
            self.distrusted.add(fp.key)
            first = first or error
        if first is None:
            return
        if self.on_mismatch == "raise":
            raise first
        if not self._told:
            self._told = True
            warnings.warn(f"{first} Counted (on_mismatch='fallback'): report()['verify'] counts mismatches; "
                          f"{first.key} is kept from now on. This warning is shown once per provisioner",
                          stacklevel=2)

    def report(self) -> Any:
        """``{"mode", "checked", "mismatches", "distrusted"}``: what ``report()["verify"]`` holds."""
        return {"mode": self.mode, "checked": self.checked, "mismatches": self.mismatches,
                "distrusted": sorted(self.distrusted)}
