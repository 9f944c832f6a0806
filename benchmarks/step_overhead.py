"""Step time of the reference MoE model: bagualu2's static plans against torch's own tools.

Compares, in one run and on the same model and batches:

* adaptive with an ample budget (its plan is all-keep, and it skips tracing) against plain
  PyTorch: what bagualu2 costs in stable phases;
* all-keep (``policy="keep_all"``: nothing can be released, so it is not traced either) against
  plain PyTorch;
* a traced plan that releases next to nothing (a fixed plan recomputing the smallest saved
  operator of each layer, so that every layer is traced; a plan that keeps everything is not
  traced at all) against plain PyTorch: the price of tracing, which a micro-batch pays when a
  release may be needed;
* all-offload (``policy="offload_all"``) against ``torch.autograd.graph.save_on_cpu``, twice:
  as a user calls it on this machine (``pin_memory=False``: on cpu tensors it copies nothing,
  so it is plain PyTorch plus the hooks) and with ``pin_memory=True`` (the setting for GPUs,
  which on cpu copies every saved tensor in the forward and hands the copy back in backward:
  one copy per save, against the engine's one copy per storage, read in place in backward);
* all-recompute (``policy="recompute_all"``) against ``torch.utils.checkpoint`` on every block.
  All-recompute reruns every block whole in backward, as checkpoint does (the blocks run
  untraced), and keeps what the model saves after its last block (the final norm's, the
  log-softmax's), which backward reads first; it also releases what is saved before the first
  block (the embedding's dropout mask), which checkpoint keeps. Beside it, recomputed op by op
  from traced recipes (fixed plans): the plan that recomputes exactly what checkpoint
  recomputes (every operator inside the blocks but their outputs, the rest kept), and the plan
  that recomputes every operator, the head's too.

The exactness check (``enable(verify=...)``) is priced against the same policy without it:
all-offload with ``verify="sample"`` and ``"all"``, all-recompute with ``"sample"``.

The row pairing checkpoint with itself says how far from 1.000x the machine's noise alone puts a
ratio in this run.

bagualu2's variants also report their activation high-water mark (``report()["peak_bytes"]``,
held by the runtime during the forward). After the timed rounds every variant runs
``--peak-repeats`` more steps in which the process's resident-memory high-water mark is read
(``/proc/self``, with glibc told to map every block of 64 KiB or more on its own, so freed
tensors leave the resident set): the median of the steps' peaks above what was resident before
each, backward's rebuilds and gradients included (one variant's steps differ by up to about
20 MB on the bench size). On this CPU machine host copies are in that figure too
(``save_on_cpu``'s), except those in bagualu2's host arena, which is reserved before the step.

Each variant runs ``--steps`` forward+backward steps after ``--warmup``; variants are
interleaved, one step of each per round in an order shuffled every round (seeded), so machine
noise hits all of them alike and no variant runs after the same one every time (a rotating
order kept neighbours in the same order: checkpoint paired with itself measured 0.968x, the
second run profiting from the first); reported: the median over rounds of the ratio within a
round (paired), and the ratios of medians and of bests.

    python benchmarks/step_overhead.py --config bench --steps 7 --out step_overhead.json

``--host-cost`` measures instead what each way of handling saved tensors adds to the host per
aten op, where host time is all there is: a chain of ``--links`` tiny links (a matmul with a
weight, a sigmoid gate, a residual add: four aten ops and five saved tensors each, on a
4 x 8 tensor), forward and backward, under plain autograd, ``torch.autograd.graph.save_on_cpu``
(``pin_memory=False``: the hook pair alone), torch's selective checkpointing over the whole
chain (matmul outputs saved, the rest recomputed), an empty Python dispatch mode (one that
only counts and calls each op: what any tracing written as a ``TorchDispatchMode`` pays before
it records anything), bagualu2 ``keep_all``, bagualu2 traced twice (fixed plans: one
recomputing the last link's sigmoid, so that only the last link is traced and the others run
untraced, as blocks a plan releases nothing from do; one recomputing every link's sigmoid, so
that every op is traced; a plan that keeps everything is not traced at all) and bagualu2
adaptive with an ample budget (calm: untraced). The same runs on a chain of ``--short-links`` links, and each round times ``--reps`` steps of every variant on each chain,
in an order shuffled every round. Times are the calling thread's CPU time (on cpu tensors this
small, forward and backward run on it alone): on a shared machine the other processes' load
stretches wall time many times over, and thread time far less. Reported per variant: the median over rounds of (its step
time - plain's in the same round) / the long chain forward's aten ops (counted by a dispatch
mode, not estimated), with the quartiles over rounds; the marginal cost per aten op (the slope
between the two chains: what a save costs, without what a step costs once) and the fixed cost
per step that is left; each per-op cost also as the median of its per-round ratios to
``save_on_cpu``'s.

    python benchmarks/step_overhead.py --host-cost --rounds 30 --out host_cost.json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import random
import re
import statistics
import time
import warnings
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import bagualu2
from bagualu2.runtime import Frame
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches


def build(config: str, ep_size: int) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(getattr(MoEConfig, config)(ep_size=ep_size))


def checkpointed(model: MoETransformer) -> Callable[[], None]:
    originals = [layer.forward for layer in model.layers]
    for layer, forward in zip(model.layers, originals):
        layer.forward = (lambda f: lambda x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False))(forward)

    def restore() -> None:
        for layer in model.layers:
            del layer.forward

    return restore


class StepPeak:
    """The process's resident-memory high-water mark over a call, above its resident memory
    before it (Linux). Every malloc block of 64 KiB or more is then mapped on its own and
    unmapped when freed, so the resident set follows the live tensors."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD (fixed: no dynamic raising)
        self.libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024

    def __call__(self, fn: Callable[[], None]) -> int:
        gc.collect()
        self.libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the resident set
        before = self._status("VmRSS")
        fn()
        return self._status("VmHWM") - before


class Link(torch.nn.Module):
    """One link of the host-cost chain: ``h = x @ w; h * sigmoid(h) + x``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight
        return h * torch.sigmoid(h) + x


class Chain(torch.nn.Module):
    def __init__(self, links: int, width: int) -> None:
        super().__init__()
        self.links = torch.nn.ModuleList(Link(width) for _ in range(links))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for link in self.links:
            x = link(x)
        return x.sum()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run under it, and does nothing else: also the floor of a tracing
    written as a dispatch mode."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as bagualu2's tracing mode: no Dynamo-disabling shim per op

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _quartiles(values: List[float]) -> Tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def host_variants(links: int, x: torch.Tensor, provisioners: Dict[str, bagualu2.Provisioner]
                  ) -> Tuple[Dict[str, Callable[[], None]], int, int]:
    """The ``--host-cost`` variants on a chain of ``links`` links, and the aten ops (counted by
    a dispatch mode) and saved tensors of its forward."""
    torch.manual_seed(0)
    model = Chain(links, 8)
    counter = OpCounter()
    with counter:
        model(x)
    saves: List[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saves.append(1) or t, lambda t: t):
        model(x)

    def plain() -> None:
        model(x).backward()

    def save_on_cpu() -> None:
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            loss = model(x)
        loss.backward()

    mm = {torch.ops.aten.mm.default}

    def sac_policy(ctx, op, *a, **k):  # type: ignore[no-untyped-def]
        return (torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if op in mm
                else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)

    context = partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, sac_policy)

    def selective() -> None:
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False, context_fn=context).backward()

    def empty_mode() -> None:
        with OpCounter():
            loss = model(x)
        loss.backward()

    def provisioned(name: str, policy: Union[str, dict], budget: Optional[int] = None) -> Callable[[], None]:
        own = copy.deepcopy(model)
        with warnings.catch_warnings():  # the chain has no MoE gate: the budget check alone decides
            warnings.filterwarnings("ignore", message="bagualu2.enable: no MoE gate found")
            provisioners[f"{name} ({links} links)"] = bagualu2.enable(own, budget=budget, policy=policy)

        def run() -> None:
            own(x).backward()
        return run

    variants: Dict[str, Callable[[], None]] = {
        "plain pytorch": plain,
        "torch save_on_cpu": save_on_cpu,
        "torch selective checkpoint": selective,
        "empty python dispatch mode": empty_mode,
        "bagualu2 keep_all": provisioned("bagualu2 keep_all", "keep_all"),
        # A plan that releases one op (the last sigmoid, recomputed) traces the link holding it
        # and runs the others untraced; one that releases an op of every link traces them all.
        # An all-keep plan is not traced at all (its recipes would never be used).
        "bagualu2 traced, last link": provisioned(
            "bagualu2 traced, last link", {f"links.{links - 1}:aten.sigmoid.default:0": bagualu2.Choice.RECOMPUTE}),
        "bagualu2 traced, every link": provisioned(
            "bagualu2 traced, every link",
            {f"links.{i}:aten.sigmoid.default:0": bagualu2.Choice.RECOMPUTE for i in range(links)}),
        "bagualu2 adaptive, calm": provisioned("bagualu2 adaptive, calm", "adaptive", budget=1 << 40),
    }
    return variants, counter.ops, len(saves)


def host_cost(args: argparse.Namespace) -> None:
    """The ``--host-cost`` mode (see the module's docstring)."""
    x = torch.randn(4, 8, requires_grad=True)
    provisioners: Dict[str, bagualu2.Provisioner] = {}
    lengths = (args.short_links, args.links)
    chains = {n: host_variants(n, x, provisioners) for n in lengths}
    names = list(chains[args.links][0])
    runs = [(name, n) for name in names for n in lengths]
    times: Dict[Tuple[str, int], List[float]] = {run: [] for run in runs}
    order = random.Random(0)
    for i in range(args.warmup + args.rounds):
        order.shuffle(runs)
        for name, n in runs:
            fn = chains[n][0][name]
            start = time.thread_time()
            for _ in range(args.reps):
                fn()
            elapsed = (time.thread_time() - start) / args.reps
            if i >= args.warmup:
                times[(name, n)].append(elapsed)
    (_, short_ops, _), (_, ops, saves) = chains[lengths[0]], chains[lengths[1]]
    # Per round, above plain in the same round: microseconds per aten op of the long chain; the
    # marginal cost per op (the slope between the two chains) and what is left per step.
    above = {name: {n: [(t - p) * 1e6 for t, p in zip(times[(name, n)], times[("plain pytorch", n)])]
                    for n in lengths} for name in names if name != "plain pytorch"}
    per_op = {name: [a / ops for a in v[args.links]] for name, v in above.items()}
    marginal = {name: [(a - b) / (ops - short_ops) for a, b in zip(v[args.links], v[args.short_links])]
                for name, v in above.items()}
    fixed = {name: [a - m * ops for a, m in zip(above[name][args.links], marginal[name])] for name in above}

    def versus(values: Dict[str, List[float]]) -> Dict[str, float]:
        return {name: statistics.median(a / b for a, b in zip(v, values["torch save_on_cpu"]))
                for name, v in values.items()}

    per_op_ratio, marginal_ratio = versus(per_op), versus(marginal)
    print(f"chains: {lengths[0]} and {lengths[1]} links ({short_ops} and {ops} aten ops, the long one saving "
          f"{saves} tensors per forward); {args.rounds} rounds of {args.reps} steps per variant and chain")
    print(f"{'variant':<30}{'step us':>9}{'us/op above plain':>19}{'quartiles':>16}{'x soc':>8}"
          f"{'marginal us/op':>16}{'x soc':>8}{'fixed us/step':>15}")
    for name in names:
        step = statistics.median(times[(name, args.links)]) * 1e6
        if name == "plain pytorch":
            print(f"{name:<30}{step:>9.0f}")
            continue
        q1, med, q3 = _quartiles(per_op[name])
        print(f"{name:<30}{step:>9.0f}{med:>19.2f}{f'{q1:.2f}..{q3:.2f}':>16}{per_op_ratio[name]:>7.2f}x"
              f"{statistics.median(marginal[name]):>16.2f}{marginal_ratio[name]:>7.2f}x"
              f"{statistics.median(fixed[name]):>15.0f}")
    traced = {name: prov.report()["traced_micro_batches"] for name, prov in provisioners.items()}
    print(f"traced micro-batches: {traced}")
    result = {
        "mode": "host_cost", "links": lengths, "aten_ops_per_forward": [short_ops, ops], "saves_per_forward": saves,
        "rounds": args.rounds, "reps": args.reps, "threads": torch.get_num_threads(),
        "step_s": {f"{name} ({n} links)": v for (name, n), v in times.items()},
        "us_per_op_above_plain": {n: _quartiles(v) for n, v in per_op.items()},
        "ratio_to_save_on_cpu": per_op_ratio,
        "marginal_us_per_op": {n: _quartiles(v) for n, v in marginal.items()},
        "marginal_ratio_to_save_on_cpu": marginal_ratio,
        "fixed_us_per_step": {n: _quartiles(v) for n, v in fixed.items()},
        "traced_micro_batches": traced,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="bench", choices=["tiny", "small", "bench"])
    parser.add_argument("--ep-size", type=int, default=1,
                        help="expert-parallel ranks the model is one of (the demo's model: --config small "
                             "--ep-size 4 --batch 4 --seq 64)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-repeats", type=int, default=3,
                        help="steps per variant whose memory high-water mark is read (the median is shown)")
    parser.add_argument("--out", default="step_overhead.json")
    parser.add_argument("--only", default="",
                        help="comma-separated words: run only the variants whose names contain one of them "
                             "(and the baselines they are paired with), e.g. --only verify")
    parser.add_argument("--host-cost", action="store_true",
                        help="measure the host cost per aten op on a chain of tiny ops instead (see above)")
    parser.add_argument("--links", type=int, default=50, help="--host-cost: links in the chain (4 aten ops each)")
    parser.add_argument("--short-links", type=int, default=10,
                        help="--host-cost: links in the short chain (the marginal cost per op is the slope)")
    parser.add_argument("--rounds", type=int, default=30, help="--host-cost: timed rounds")
    parser.add_argument("--reps", type=int, default=20, help="--host-cost: steps per variant per round")
    args = parser.parse_args()
    if args.host_cost:
        host_cost(args)
        return

    model = build(args.config, args.ep_size)
    batch = next(synthetic_batches(model.cfg.vocab_size, args.batch, args.seq, seed=0))

    def plain() -> None:
        model(batch).backward()

    def save_on_cpu(pin_memory: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
                loss = model(batch)
            loss.backward()
        return run

    def torch_checkpoint() -> None:
        restore = checkpointed(model)
        try:
            model(batch).backward()
        finally:
            restore()

    provisioners: Dict[str, bagualu2.Provisioner] = {}

    def provisioned(name: str, policy: Union[str, dict], budget: Optional[int] = None,
                    verify: str = "off") -> Callable[[], None]:
        own = copy.deepcopy(model)  # enabled once, outside the timed steps
        provisioners[name] = bagualu2.enable(own, budget=budget, policy=policy, verify=verify)

        def run() -> None:
            own.zero_grad(set_to_none=True)
            own(batch).backward()
        return run

    def saved_keys() -> Tuple[Dict[str, int], List[str]]:
        """The operator keys a forward saves, with their storages' bytes, and those it first
        saves after its last block (which recompute_all keeps; the last block's output is one of
        them)."""
        probe = copy.deepcopy(model)
        prov = bagualu2.enable(probe, budget=None, policy={})  # its first forward is profiled: traced
        frames: List[Frame] = []
        after: List[str] = []

        def observe(frame: Frame) -> None:
            frames.append(frame)
            frame.on_saved.subscribe(lambda key: after.append(key) if frame.past_blocks else None)

        prov.runtime.on_frame_start.subscribe(observe)
        probe(batch).backward()
        prov.disable()
        (frame,) = frames
        return dict(frame.keys_seen), after

    keys, after_blocks = saved_keys()
    RECOMPUTE, KEEP = bagualu2.Choice.RECOMPUTE, bagualu2.Choice.KEEP
    # checkpoint's set: every operator inside the blocks checkpoint wraps, but their outputs
    checkpoint_set = {key: RECOMPUTE if key.startswith("layers.") and key not in after_blocks else KEEP
                      for key in keys}
    smallest: Dict[str, str] = {}  # layer -> its smallest saved operator's key
    for key, nbytes in keys.items():
        layer = ".".join(key.split(":")[0].split(".")[:2])
        if key.startswith("layers.") and (layer not in smallest or nbytes < keys[smallest[layer]]):
            smallest[layer] = key

    variants: Dict[str, Callable[[], None]] = {
        "plain pytorch": plain,
        "bagualu2 adaptive, ample": provisioned("bagualu2 adaptive, ample", "adaptive", budget=1 << 40),
        "bagualu2 keep_all": provisioned("bagualu2 keep_all", "keep_all"),
        "bagualu2 traced, tiny release": provisioned("bagualu2 traced, tiny release",
                                                     dict.fromkeys(smallest.values(), RECOMPUTE)),
        "torch save_on_cpu": save_on_cpu(torch.cuda.is_available()),
        **({} if torch.cuda.is_available() else {"torch save_on_cpu, pinned": save_on_cpu(True)}),
        "bagualu2 offload_all": provisioned("bagualu2 offload_all", "offload_all"),
        "bagualu2 offload_all, verify sample": provisioned("bagualu2 offload_all, verify sample", "offload_all",
                                                           verify="sample"),
        "bagualu2 offload_all, verify all": provisioned("bagualu2 offload_all, verify all", "offload_all",
                                                        verify="all"),
        "torch checkpoint": torch_checkpoint,
        "torch checkpoint, again": torch_checkpoint,
        "bagualu2 recompute_all": provisioned("bagualu2 recompute_all", "recompute_all"),
        "bagualu2 recompute_all, verify sample": provisioned("bagualu2 recompute_all, verify sample",
                                                             "recompute_all", verify="sample"),
        "bagualu2 checkpoint's set": provisioned("bagualu2 checkpoint's set", checkpoint_set),
        "bagualu2 every op recomputed": provisioned("bagualu2 every op recomputed", dict.fromkeys(keys, RECOMPUTE)),
    }
    pairs = [("bagualu2 adaptive, ample", "plain pytorch"), ("bagualu2 keep_all", "plain pytorch"),
             ("bagualu2 traced, tiny release", "plain pytorch"),
             ("bagualu2 offload_all", "torch save_on_cpu"), ("bagualu2 offload_all", "torch save_on_cpu, pinned"),
             ("bagualu2 recompute_all", "torch checkpoint"), ("bagualu2 checkpoint's set", "torch checkpoint"),
             ("bagualu2 every op recomputed", "torch checkpoint"), ("torch checkpoint, again", "torch checkpoint"),
             ("bagualu2 offload_all, verify sample", "bagualu2 offload_all"),
             ("bagualu2 offload_all, verify all", "bagualu2 offload_all"),
             ("bagualu2 recompute_all, verify sample", "bagualu2 recompute_all")]
    if args.only:
        words = [w for w in args.only.split(",") if w]
        wanted = {n for n in variants if any(w in n for w in words)}
        wanted |= {baseline for ours, baseline in pairs if ours in wanted}
        variants = {n: fn for n, fn in variants.items() if n in wanted}
    pairs = [(ours, baseline) for ours, baseline in pairs if ours in variants and baseline in variants]
    times: Dict[str, List[float]] = {name: [] for name in variants}
    names = list(variants)
    order = random.Random(0)
    for i in range(args.warmup + args.steps):
        # A new order every round: a variant then does not always run right after the same one
        # (whose freed memory the allocator may or may not still hold).
        order.shuffle(names)
        for name in names:
            fn = variants[name]
            model.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                times[name].append(elapsed)
            print(f"step {i} {name:<28} {elapsed * 1000:8.1f} ms", flush=True)

    peaks = {name: prov.report()["peak_bytes"] for name, prov in provisioners.items() if name in variants}
    traced = {name: prov.report()["traced_micro_batches"] for name, prov in provisioners.items() if name in variants}
    step_peak = StepPeak()
    measured: Dict[str, List[int]] = {name: [] for name in variants}
    for _ in range(args.peak_repeats):
        for name, fn in variants.items():
            model.zero_grad(set_to_none=True)
            measured[name].append(step_peak(fn))
    step_peaks = {name: statistics.median(v) for name, v in measured.items()}

    median = {name: statistics.median(v) for name, v in times.items()}
    best = {name: min(v) for name, v in times.items()}
    # Paired: the ratio within each round (the two ran seconds apart), then the median.
    paired = {(ours, baseline): statistics.median(a / b for a, b in zip(times[ours], times[baseline]))
              for ours, baseline in pairs}
    print()
    print(f"{'variant':<30}{'median ms':>11}{'best ms':>10}{'paired ratio':>14}{'median ratio':>14}{'best ratio':>12}"
          f"{'peak act. MB':>14}{'step peak MB':>14}")
    for ours, baseline in pairs:
        print(f"{baseline:<30}{median[baseline] * 1000:>11.1f}{best[baseline] * 1000:>10.1f}{'':>54}"
              f"{step_peaks[baseline] / 2**20:>14.1f}")
        print(f"{ours:<30}{median[ours] * 1000:>11.1f}{best[ours] * 1000:>10.1f}"
              f"{paired[(ours, baseline)]:>13.3f}x{median[ours] / median[baseline]:>13.3f}x"
              f"{best[ours] / best[baseline]:>11.3f}x"
              + (f"{peaks[ours] / 2**20:>14.1f}" if ours in peaks else f"{'':>14}")
              + f"{step_peaks[ours] / 2**20:>14.1f}")
    print(f"traced micro-batches: {traced}")
    result = {
        "config": args.config, "ep_size": args.ep_size, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "threads": torch.get_num_threads(), "median_s": median, "best_s": best, "all_s": times,
        "peak_activation_bytes": peaks, "step_peak_bytes": step_peaks, "traced_micro_batches": traced,
        "ratios": {f"{ours} / {baseline}": median[ours] / median[baseline] for ours, baseline in pairs},
        "paired_ratios": {f"{ours} / {baseline}": r for (ours, baseline), r in paired.items()},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
