"""Local multi-process harness for the gloo tests and benchmarks (not part of bagualu2).

``launch(fn, world_size, ...)`` starts ``world_size`` spawned processes joined in one process
group through a file store (``store_init_method``), gloo by default; when a rank fails the others get a grace
period to notice (gloo fails their next operation at once) and exit on their own; whatever is
left at the timeout is killed. ``gather_step_result(pipeline, losses)`` collects a pipeline
step's per-micro-batch losses and every parameter gradient (keyed ``"stage{i}.{name}"``) on
rank 0 as a ``StepResult``, so two runs can be compared bit for bit; ``check_engine_rank`` is
what every engine layout (torchtitan, Megatron-Core) asserts of one rank's result. ``CollectiveCounter`` counts the collectives dispatched
inside it (what bagualu2 must never issue from backward).

Tests import it as a sibling module (``import pipeline_harness``; the spawned ranks find it on
the sys.path they inherit); benchmarks put this directory on ``sys.path`` first. Programs
outside the repository launch their ranks with torchrun instead (examples/pipeline_1f1b.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from bagualu2.integrations.pipeline import Pipeline

__all__ = ["CollectiveCounter", "StepResult", "check_engine_rank", "gather_step_result", "launch", "store_init_method"]

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


class CollectiveCounter(TorchDispatchMode):
    """Counts the collective ops (c10d, functional collectives) dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.count += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# Gathering one step's results
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepResult:
    """Everything one step produced across ranks, gathered on rank 0."""

    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    extra: dict[int, Any]


def gather_step_result(
    pipeline: Pipeline, losses: Sequence[torch.Tensor], extra: Any = None, dst: int = 0
) -> StepResult | None:
    """Collect losses and every local parameter gradient on rank ``dst`` (None elsewhere)."""
    grads = {}
    for m in pipeline.modules:
        for name, p in m.named_parameters():
            if p.grad is not None:
                grads[f"stage{m.stage_index}.{name}"] = p.grad.detach().clone()
    payload = {
        "losses": [l.detach().clone() for l in losses],
        "grads": grads,
        "extra": extra,
    }
    out: list[Any] | None = [None] * pipeline.world_size if pipeline.rank == dst else None
    dist.gather_object(payload, out, dst=dst)
    if pipeline.rank != dst:
        return None
    result = StepResult([], {}, {})
    for r, p in enumerate(out):
        result.losses.extend(p["losses"])
        result.grads.update(p["grads"])
        result.extra[r] = p["extra"]
    return result


def check_engine_rank(rank: int, result: Dict[str, Any], policies: Sequence[str], engine: str) -> None:
    """What every engine layout asserts of one rank's result (``run_case`` of
    ``torchtitan_ranks`` / ``megatron_ranks``): gates found; each policy bit for bit against the
    run without bagualu2 and nothing left resident or in the arena after each step; adaptive
    within its budget."""
    assert result["gates"], f"rank {rank}: no {engine} MoE gate found"
    for policy in policies:
        got = result["policies"][policy]
        bad = [(i, m[:3]) for i, m in enumerate(got["mismatches"]) if m]
        assert not bad, f"rank {rank} {policy}: differs from the run without bagualu2 at micro-batch(es) {bad}"
        assert set(got["resident_after_steps"]) == {0}, f"rank {rank} {policy}: {got['resident_after_steps']}"
        assert set(got["arena_after_steps"]) == {0}, f"rank {rank} {policy}: {got['arena_after_steps']}"
    adaptive = result["policies"]["adaptive"]
    assert adaptive["violations"] == 0, f"rank {rank}: adaptive crossed its budget: {adaptive}"
    assert adaptive["peak"] <= adaptive["budget"], f"rank {rank}: {adaptive['peak']=} {adaptive['budget']=}"


# ---------------------------------------------------------------------------------------------
# Local multi-process launcher
# ---------------------------------------------------------------------------------------------


def store_init_method(directory: str) -> str:
    """An ``init_method`` for ranks on this machine: a ``FileStore`` in ``directory`` (empty,
    fresh for each group).

    Not a ``TCPStore``: its libuv server on rank 0 can destroy its thread unjoined when the
    group is torn down (``c10d::detail::BackgroundThread``'s destructor is defaulted and the
    daemon's joins only while its loop still runs), which aborts rank 0 at exit with
    "terminate called without an active exception", rarely and only under load. A file store
    has no thread, and no port to race another process for.
    """
    return "file://" + os.path.join(directory, "store")


def _launch_entry(rank, fn, world_size, store_dir, backend, timeout_s, threads, args):
    # A rank that dies of a signal (a native abort) prints every thread's Python stack on its
    # way out: the parent sees only the signal.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(threads)
    dist.init_process_group(
        backend,
        init_method=store_init_method(store_dir),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The rank's work is done, its results written and its group destroyed: it leaves without
    # the interpreter's teardown. Gloo's worker thread (``ProcessGroupGloo::runLoop``) may still
    # drop the last reference to a collective's tensor then, whose Python object it must free:
    # it takes the GIL while the interpreter finalizes, Python ends the thread with
    # ``pthread_exit``, and that unwinding through torch's ``noexcept`` frames aborts the rank
    # ("terminate called without an active exception"; caught with a terminate handler printing
    # the aborting thread's stack, about one launch in five of the short head-to-head). A rank
    # that fails still raises above, and its traceback reaches the parent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads: int = 1,
    grace_s: float = 15.0,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in one group.

    Processes are spawned (not forked) and meet through a file store in a fresh temporary
    directory (``store_init_method``), removed when they are done. When one rank
    fails, the others get ``grace_s`` seconds to notice (gloo fails their next operation with
    the broken peer) and exit on their own; whatever is still alive then, or at ``timeout_s``,
    is killed, and the first failure is raised here. ``fn`` must be importable (module
    level). Results travel back however ``fn`` chooses (a file is simplest).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bagualu2-ranks-") as store_dir:
        _run_ranks(mp.start_processes(
            _launch_entry,
            args=(fn, world_size, store_dir, backend, timeout_s, threads, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        ), timeout_s, grace_s)


def _run_ranks(ctx: Any, timeout_s: float, grace_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        # Poll instead of ctx.join(), which kills every peer as soon as one rank fails.
        while any(p.is_alive() for p in ctx.processes):
            if any(p.exitcode not in (None, 0) for p in ctx.processes):
                deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    failed = any(p.exitcode != 0 for p in ctx.processes)
    if failed:
        ctx.join(timeout=1)  # raises the first rank's exception (with its traceback) or exit code
    if timed_out:
        raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s")
