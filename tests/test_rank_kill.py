"""A rank dies: one rank of a 2-rank expert-parallel run is killed (SIGKILL) mid-step.

Each launch starts two rank processes (``subprocess``, so the test holds their pids and nothing
else of the run is a child of the test) that train the reference model of
tests/test_resume_ep.py with real expert parallelism over gloo, under a bagualu2 budget that the
routing spikes cross, checkpointing every ``CHECKPOINT_EVERY`` steps (each rank its own file:
model, optimizer, RNG, provisioner). Rank 1 stops at a chosen point and tells the test, rank 0
tells the test it reached the collective that needs rank 1, and the test kills rank 1:

- ``forward``: both inside step 8's forward (a spike), at the last MoE layer's count exchange
  (rank 1 holds that forward's saved activations, offloaded ones included; rank 0 waits for it);
- ``backward``: both inside step 8's backward, before the last layer's all-to-alls;
- ``checkpoint``: rank 1 halfway through writing its checkpoint before step 8 (its temporary
  file holds half the bytes, nothing is renamed), while rank 0, which wrote its own, waits in
  step 8's forward, at the first layer's count exchange;
- ``stuck``: as ``forward``, but rank 1 is not killed until rank 0 ended: a peer that hangs
  alive, its sockets open, which only the process group's timeout tells from a slow one.

The survivor must end on its own, with the collective's error (gloo fails it once it sees the
peer's connection closed, or at the process group's timeout), within a bound derived from that
timeout; the training script lets the error end the process, as any script does;
nothing of the run may remain: no process that carries the run's marker in its environment, no
/dev/shm entry the run held when the kill landed, none named after a run pid (torch's
shared-memory files are), none that appeared during the run and that no live process holds
(``_shm_left``), no System V segment a run process created. bagualu2's host arena is process-private memory
(``aligned_alloc`` on cpu, pinned ``cuMemHostAlloc``/``hipHostMalloc`` on GPUs), never shared
memory, and its copy workers are threads: both end with their process.

A new launch then resumes both ranks from the last complete checkpoint. A checkpoint file is
written to ``<path>.tmp`` and renamed over ``<path>`` (``save_checkpoint``), so a file under its
final name is whole whenever the kill lands; a checkpoint step is complete when every rank's file
is there (``last_complete``). In ``checkpoint`` rank 0's newer file exists and rank 1's does not,
so both resume from the one before. The resumed ranks are bit-exact (losses and gradients) with
a launch that never stopped, calibrate and profile nothing, and trace and plan the first spike
after the resume on the rank it lands on (rank 1), as the launch that never stopped did (the
checkpoints fall inside runs of spikes: a spike after a calm step is met untraced in any run).
"""
from __future__ import annotations

import datetime
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import pytest
import torch
import torch.distributed as dist

import bagualu2

sys.path.insert(0, str(Path(__file__).parent))  # the rank processes import this module by name

import pipeline_harness as harness  # noqa: E402
import test_resume_ep as ep  # noqa: E402

WORLD = 2
VICTIM = 1  # rank 0's tokens spike onto rank 1's experts: rank 1 offloads when it dies
CHECKPOINT_EVERY = 4
PG_TIMEOUT_S = 30  # the process group's timeout: the longest a collective waits for a silent peer
# The survivor's bound: its collective's timeout, then unwinding and interpreter exit on a busy
# machine. Only a hang crosses it.
EXIT_BOUND_S = 2 * PG_TIMEOUT_S + 60
LAUNCH_TIMEOUT_S = 300
MARKER = "BAGUALU2_RANK_KILL_RUN"  # set in the ranks' environment; their children inherit it
# Per scenario and rank: (step, point) where the rank tells the test it got there; points:
# "dispatch<i>" (layer i's count exchange), "backward" (before the last layer's backward),
# "checkpoint" (halfway through writing its checkpoint).
STOPS: Dict[str, Dict[int, Tuple[int, str]]] = {
    "forward": {0: (8, "dispatch1"), 1: (8, "dispatch1")},
    "backward": {0: (8, "backward"), 1: (8, "backward")},
    "checkpoint": {0: (8, "dispatch0"), 1: (8, "checkpoint")},
    "stuck": {0: (8, "dispatch1"), 1: (8, "dispatch1")},  # not killed until the survivor ended
}


def _checkpoint_path(out_dir: str, step: int, rank: int) -> str:
    return os.path.join(out_dir, "checkpoints", f"step{step}", f"rank{rank}.pt")


def last_complete(out_dir: str, world: int) -> Optional[int]:
    """The last checkpoint step for which every rank's file exists (each is whole: it was renamed
    into place after being written), None when there is none."""
    root = os.path.join(out_dir, "checkpoints")
    steps = [int(name[len("step"):]) for name in os.listdir(root)] if os.path.isdir(root) else []
    complete = [s for s in steps if all(os.path.exists(_checkpoint_path(out_dir, s, r)) for r in range(world))]
    return max(complete, default=None)


# ---------------------------------------------------------------------------------------------
# The rank processes
# ---------------------------------------------------------------------------------------------


class _Stops:
    """Where this rank tells the test it is (a file, renamed into place); the victim then waits
    there to be killed."""

    def __init__(self, rank: int, scenario: str, out_dir: str) -> None:
        self.rank, self.out_dir = rank, out_dir
        self.at = STOPS.get(scenario, {}).get(rank)
        self.step = -1

    def reached(self, point: str) -> None:
        if self.at != (self.step, point):
            return
        path = os.path.join(self.out_dir, f"at{self.rank}")
        with open(f"{path}.tmp", "w") as f:
            json.dump({"step": self.step, "point": point}, f)
        os.replace(f"{path}.tmp", path)
        if self.rank == VICTIM:
            time.sleep(LAUNCH_TIMEOUT_S)
            raise RuntimeError(f"rank {self.rank} was not killed at step {self.step}, {point}")


def _arm(model: Any, stops: _Stops) -> None:
    for i, layer in enumerate(model.layers):
        layer.moe.dispatcher.register_forward_pre_hook(lambda *_, i=i: stops.reached(f"dispatch{i}"))

    def grad_hook(grad: torch.Tensor) -> None:
        stops.reached("backward")

    def block_hook(module: Any, args: Any, out: Any) -> None:
        if torch.is_grad_enabled() and not bagualu2.is_recomputing():
            out[0].register_hook(grad_hook)

    model.layers[-1].register_forward_hook(block_hook)


def _half_then_stop(stops: _Stops) -> Callable[[Dict[str, Any], str], None]:
    """A checkpoint writer that writes half of the file and stops there (the kill lands inside
    the write)."""

    def write(state: Dict[str, Any], tmp: str) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            stops.reached("checkpoint")
            f.write(data[len(data) // 2:])

    return write


def rank_main(rank_s: str, store_dir: str, out_dir: str, scenario: str) -> None:
    """One rank's training script: ``scenario`` is ``whole`` (no stop), ``resume`` (from the last
    complete checkpoint) or a key of ``STOPS``. An error ends it, as it ends any training script."""
    rank = int(rank_s)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=harness.store_init_method(store_dir), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    model = ep.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if scenario == "resume":
        first = last_complete(out_dir, WORLD)
        assert first is not None, f"no complete checkpoint under {out_dir}"
        prov = ep.load_checkpoint(_checkpoint_path(out_dir, first, rank), model, opt)
        budget = prov.budget
    else:
        first, budget = 0, ep.budget_for(rank)
        prov = bagualu2.enable(model, budget=budget, **ep.OPTIONS)
    stops = _Stops(rank, scenario, out_dir)
    _arm(model, stops)
    steps: List[Dict[str, Any]] = []
    for i in range(first, len(ep.TRACE)):
        stops.step = i
        if i > first and i % CHECKPOINT_EVERY == 0:
            path = _checkpoint_path(out_dir, i, rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write = _half_then_stop(stops) if stops.at == (i, "checkpoint") else torch.save
            ep.save_checkpoint(path, model, opt, prov, budget, write=write)
        steps.append(ep.train_step(model, rank, i))
        opt.step()
        prov.step()
    torch.save({**ep.summary(prov, steps), "first": first}, os.path.join(out_dir, f"{scenario}{rank}.pt"))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The test's side: launching, killing, looking for what is left
# ---------------------------------------------------------------------------------------------


def _launch(out_dir: str, scenario: str, marker: str) -> List[subprocess.Popen]:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_rank_kill; "
            f"test_rank_kill.rank_main(*sys.argv[1:])")
    store_dir = tempfile.mkdtemp(prefix=f"store-{scenario}-", dir=out_dir)  # one fresh store per launch
    env = {**os.environ, MARKER: marker}
    procs = []
    for rank in range(WORLD):
        log = open(os.path.join(out_dir, f"{scenario}{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(rank), store_dir, out_dir, scenario],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def _log(out_dir: str, scenario: str, rank: int) -> str:
    return Path(out_dir, f"{scenario}{rank}.log").read_text()


def _stop_all(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _run_to_end(out_dir: str, scenario: str) -> List[Dict[str, Any]]:
    procs = _launch(out_dir, scenario, uuid.uuid4().hex)
    try:
        for p in procs:
            p.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        _stop_all(procs)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} of {scenario} failed:\n{_log(out_dir, scenario, rank)}"
    return [torch.load(os.path.join(out_dir, f"{scenario}{r}.pt"), weights_only=False) for r in range(WORLD)]


def _processes_with(marker: str) -> List[int]:
    """Pids of the live processes whose environment carries ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path("/proc", entry, "environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:  # gone meanwhile, or another user's
                pass
    return found


def _shm_held(pids: Optional[Set[int]] = None) -> Set[str]:
    """/dev/shm paths that ``pids`` (default: every live process) have open or mapped."""
    held = set()
    for pid in pids if pids is not None else [int(e) for e in os.listdir("/proc") if e.isdigit()]:
        try:
            for line in Path("/proc", str(pid), "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    held.add(line[line.index("/dev/shm/"):].removesuffix(" (deleted)"))
            fds = Path("/proc", str(pid), "fd")
            held.update(t for t in (os.readlink(fds / fd) for fd in os.listdir(fds)) if t.startswith("/dev/shm/"))
        except OSError:  # gone meanwhile
            pass
    return held


def _shm_left(before: Set[str], held_by_run: Set[str], run_pids: Set[int]) -> List[str]:
    """/dev/shm entries the run left: one it held when the kill landed that still exists; one
    named after a run pid (torch's shared-memory files are); one that appeared during the run and
    that no live process holds. Python multiprocessing's named semaphores (``sem.mp-*``) are left
    out of the last kind: every launcher on the machine that spawns makes them (other tests'
    included) and its resource tracker removes them when it ends; the run's own would be in the
    first kind, held while it lives."""
    now = set(os.listdir("/dev/shm"))
    held = _shm_held()
    left = {p.removeprefix("/dev/shm/") for p in held_by_run if os.path.exists(p)}
    left |= {f for f in now if any(f"_{pid}_" in f for pid in run_pids)}
    left |= {f for f in now - before if f"/dev/shm/{f}" not in held and not f.startswith("sem.mp-")}
    return sorted(left)


def _checkpoint_files(out_dir: str) -> Dict[str, bool]:
    """Every file under the checkpoint folder (relative path) and whether it loads whole."""
    root = Path(out_dir, "checkpoints")
    readable = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        try:
            torch.load(path, weights_only=True)
            readable[str(path.relative_to(root))] = True
        except RuntimeError:  # torch's reader refuses a truncated archive
            readable[str(path.relative_to(root))] = False
    return readable


def _sysv_shm_of(pids: Set[int]) -> List[str]:
    """System V shared-memory segments created by ``pids`` that still exist."""
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [line for line in lines if int(line.split()[6]) in pids]  # the creator's pid (cpid)


def _kill_run(out_dir: str, scenario: str) -> Dict[str, Any]:
    """Launch ``scenario``, kill the victim where it stopped (``stuck``: only once the survivor
    ended), and observe the survivor's end and what the run left."""
    marker = uuid.uuid4().hex
    shm_before = set(os.listdir("/dev/shm"))
    procs = _launch(out_dir, scenario, marker)
    survivor, victim = procs[1 - VICTIM], procs[VICTIM]
    try:
        at = {r: Path(out_dir, f"at{r}") for r in range(WORLD)}
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not all(p.exists() for p in at.values()):
            ended = [r for r, p in enumerate(procs) if p.poll() is not None]
            assert not ended, f"rank {ended[0]} ended before its stop:\n{_log(out_dir, scenario, ended[0])}"
            assert time.monotonic() < deadline, f"the ranks did not reach their stops in {LAUNCH_TIMEOUT_S} s"
            time.sleep(0.1)
        reached = {r: json.loads(p.read_text()) for r, p in at.items()}
        run_pids = {p.pid for p in procs} | set(_processes_with(marker))
        held_by_run = _shm_held(run_pids)
        if scenario != "stuck":
            victim.send_signal(signal.SIGKILL)
            victim.wait()
        start = time.monotonic()
        try:
            survivor.wait(timeout=EXIT_BOUND_S)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
        survivor_s = time.monotonic() - start
        victim.send_signal(signal.SIGKILL)  # stuck: what a launcher does once a rank failed
        victim.wait()
        left = _processes_with(marker)
    finally:
        _stop_all(procs)
    return {"scenario": scenario, "out_dir": out_dir, "reached": reached, "victim_rc": victim.returncode,
            "survivor_rc": survivor.returncode, "hung": hung, "survivor_s": survivor_s,
            "survivor_log": _log(out_dir, scenario, 1 - VICTIM), "left": left,
            "shm_left": _shm_left(shm_before, held_by_run, run_pids), "sysv_left": _sysv_shm_of(run_pids),
            "checkpoints": _checkpoint_files(out_dir), "resume_from": last_complete(out_dir, WORLD)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Callable[[str], Any]:
    """``runs(name)``: the launch that never stopped (``whole``: each rank's results), a kill
    launch (a key of ``STOPS``: what it observed) or the resume after one (``resume-<key>``: each
    rank's results); each made once, when first asked for."""
    made: Dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in made:
            if name == "whole":
                made[name] = _run_to_end(str(tmp_path_factory.mktemp("whole")), "whole")
            elif name.startswith("resume-"):
                made[name] = _run_to_end(get(name.removeprefix("resume-"))["out_dir"], "resume")
            else:
                made[name] = _kill_run(str(tmp_path_factory.mktemp(name)), name)
        return made[name]

    return get


# Resumed after: both stops of the same checkpoint are alike (backward, stuck: as forward).
RESUMED = ("forward", "checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(STOPS))
def test_the_survivor_ends_on_its_own_with_the_collectives_error(runs: Callable[[str], Any], scenario: str) -> None:
    killed = runs(scenario)
    log = killed["survivor_log"]
    for rank, (step, point) in STOPS[scenario].items():
        assert (killed["reached"][rank]["step"], killed["reached"][rank]["point"]) == (step, point)
    assert killed["victim_rc"] == -signal.SIGKILL
    assert not killed["hung"], f"the survivor still ran {EXIT_BOUND_S} s after the kill:\n{log}"
    assert killed["survivor_rc"] not in (0, None), log
    # The error that ended it is the collective's (gloo's), as itself: not swallowed, not one
    # bagualu2 raised in its place. Stuck: the peer is alive, so only the timeout ends the wait.
    last = log.strip().splitlines()[-1].removeprefix(f"[rank{1 - VICTIM}]: ")
    assert last.startswith(("RuntimeError: ", "torch.distributed.DistBackendError: ")) and "gloo" in last, log
    if scenario == "stuck":
        assert "Timed out" in last, log
    if scenario == "backward":
        assert "in backward" in log and "loss.backward()" in log, log


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(STOPS))
def test_nothing_of_the_run_is_left_on_the_machine(runs: Callable[[str], Any], scenario: str) -> None:
    killed = runs(scenario)
    assert killed["left"] == [], "processes of the run outlived it"
    assert killed["shm_left"] == [], "shared memory left in /dev/shm"
    assert killed["sysv_left"] == [], "System V shared memory left"


@pytest.mark.slow
@pytest.mark.parametrize("scenario", RESUMED)
def test_the_resume_uses_the_last_complete_checkpoint(runs: Callable[[str], Any], scenario: str) -> None:
    killed, resumed = runs(scenario), runs(f"resume-{scenario}")
    step, _ = STOPS[scenario][VICTIM]
    files = killed["checkpoints"]  # as the kill left them, before the resume wrote its own
    assert all(files[f"step{s}/rank{r}.pt"] for s in range(CHECKPOINT_EVERY, step, CHECKPOINT_EVERY)
               for r in range(WORLD))
    if scenario == "checkpoint":
        # The survivor's checkpoint before step 8 is whole; the victim's is a half-written
        # temporary file, never renamed: step 8 is incomplete, both ranks resume from step 4.
        assert files[f"step{step}/rank{1 - VICTIM}.pt"] and files[f"step{step}/rank{VICTIM}.pt.tmp"] is False
        assert f"step{step}/rank{VICTIM}.pt" not in files
        assert killed["resume_from"] == step - CHECKPOINT_EVERY
    else:
        assert killed["resume_from"] == step
    assert [r["first"] for r in resumed] == [killed["resume_from"]] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("scenario", RESUMED)
def test_the_resumed_ranks_are_bit_exact_with_the_run_that_never_stopped(runs: Callable[[str], Any],
                                                                         scenario: str) -> None:
    first = runs(scenario)["resume_from"]
    for rank in range(WORLD):
        resumed, uninterrupted = runs(f"resume-{scenario}")[rank]["steps"], runs("whole")[rank]["steps"][first:]
        assert len(resumed) == len(uninterrupted) == len(ep.TRACE) - first
        for a, b in zip(uninterrupted, resumed):
            assert torch.equal(a["loss"], b["loss"]), rank
            assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])), rank


@pytest.mark.slow
@pytest.mark.parametrize("scenario", RESUMED)
def test_the_first_spike_after_the_resume_is_planned(runs: Callable[[str], Any], scenario: str) -> None:
    first = runs(scenario)["resume_from"]
    whole, resumed = runs("whole"), runs(f"resume-{scenario}")
    spike = next(i for i in range(first, len(ep.TRACE)) if ep.TRACE[i])
    for rank in range(WORLD):
        assert resumed[rank]["state_keys"] == [f"rank_{rank}"]
        later = [r[:4] for r in whole[rank]["records"] if r[0] >= first]
        assert [r[:4] for r in resumed[rank]["records"]] == later, rank
        assert not any(r[2] for r in resumed[rank]["records"])  # no calibrating micro-batch
        assert resumed[rank]["profiled"] == whole[rank]["profiled"]  # nothing profiled again
        assert not any(r[5] for r in resumed[rank]["records"])  # no violation
    # Where the spike lands: traced (only an untraced forward meets a spike by offloading what it
    # saves, greedily) and planned at its gates, as in the run that never stopped.
    assert {r[0]: r[1] for r in resumed[VICTIM]["records"]}[spike]
    assert spike in resumed[VICTIM]["planned"] and spike in whole[VICTIM]["planned"]
