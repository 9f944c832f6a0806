"""Step time of the reference MoE model: bagualu2's static plans against torch's own tools.

Compares, in one run and on the same model and batches:

* adaptive with an ample budget (its plan is all-keep, and it skips tracing) against plain
  PyTorch: what bagualu2 costs in stable phases;
* all-keep (``policy="keep_all"``: nothing can be released, so it is not traced either) against
  plain PyTorch;
* an all-keep plan that is traced (``policy={}``, a fixed plan with no entries) against plain
  PyTorch: the price of tracing, which a micro-batch pays when a release may be needed;
* all-offload (``policy="offload_all"``) against ``torch.autograd.graph.save_on_cpu``, twice:
  as a user calls it on this machine (``pin_memory=False``: on cpu tensors it copies nothing,
  so it is plain PyTorch plus the hooks) and with ``pin_memory=True`` (the setting for GPUs,
  which on cpu copies every saved tensor in the forward and hands the copy back in backward:
  one copy per save, against the engine's one copy per storage, read in place in backward);
* all-recompute (``policy="recompute_all"``) against ``torch.utils.checkpoint`` on every block.
  All-recompute releases every activation, those outside the blocks too (the final norm's, the
  log-softmax's), so it holds less than checkpoint and recomputes more in backward; the plan
  that recomputes what checkpoint recomputes (every operator inside the blocks, the rest kept)
  is the comparison at equal memory.

bagualu2's variants also report their activation high-water mark (``report()["peak_bytes"]``).

Each variant runs ``--steps`` forward+backward steps after ``--warmup``; variants are
interleaved round-robin (the order rotating every round) so machine noise hits all of them
alike; reported: the median over
rounds of the ratio within a round (paired), and the ratios of medians and of bests.

    python benchmarks/step_overhead.py --config bench --steps 7 --out step_overhead.json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.utils.checkpoint

import bagualu2
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches


def build(config: str) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(getattr(MoEConfig, config)())


def checkpointed(model: MoETransformer) -> Callable[[], None]:
    originals = [layer.forward for layer in model.layers]
    for layer, forward in zip(model.layers, originals):
        layer.forward = (lambda f: lambda x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False))(forward)

    def restore() -> None:
        for layer in model.layers:
            del layer.forward

    return restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="bench", choices=["tiny", "small", "bench"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="step_overhead.json")
    args = parser.parse_args()

    model = build(args.config)
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

    def provisioned(name: str, policy: Union[str, dict], budget: Optional[int] = None) -> Callable[[], None]:
        own = copy.deepcopy(model)  # enabled once, outside the timed steps
        provisioners[name] = bagualu2.enable(own, budget=budget, policy=policy)

        def run() -> None:
            own.zero_grad(set_to_none=True)
            own(batch).backward()
        return run

    def checkpoint_set() -> Dict[str, bagualu2.Choice]:
        """RECOMPUTE for every operator inside the blocks checkpoint wraps, KEEP for the rest
        (the operator keys are those a profiled forward saves)."""
        probe = copy.deepcopy(model)
        prov = bagualu2.enable(probe, budget=1 << 40)
        for _ in range(prov.profile_frames):
            probe(batch).backward()
        prov.disable()
        return {key: bagualu2.Choice.RECOMPUTE if key.startswith("layers.") else bagualu2.Choice.KEEP
                for key in prov.cost.ops}

    variants: Dict[str, Callable[[], None]] = {
        "plain pytorch": plain,
        "bagualu2 adaptive, ample": provisioned("bagualu2 adaptive, ample", "adaptive", budget=1 << 40),
        "bagualu2 keep_all": provisioned("bagualu2 keep_all", "keep_all"),
        "bagualu2 all-keep, traced": provisioned("bagualu2 all-keep, traced", {}),
        "torch save_on_cpu": save_on_cpu(torch.cuda.is_available()),
        **({} if torch.cuda.is_available() else {"torch save_on_cpu, pinned": save_on_cpu(True)}),
        "bagualu2 offload_all": provisioned("bagualu2 offload_all", "offload_all"),
        "torch checkpoint": torch_checkpoint,
        "bagualu2 recompute_all": provisioned("bagualu2 recompute_all", "recompute_all"),
        "bagualu2 checkpoint's set": provisioned("bagualu2 checkpoint's set", checkpoint_set()),
    }
    times: Dict[str, List[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(args.warmup + args.steps):
        # The order rotates every round: a variant then does not always run right after the
        # same one (whose freed memory the allocator may or may not still hold).
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = variants[name]
            model.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                times[name].append(elapsed)
            print(f"step {i} {name:<28} {elapsed * 1000:8.1f} ms", flush=True)

    peaks = {name: prov.report()["peak_bytes"] for name, prov in provisioners.items()}
    median = {name: statistics.median(v) for name, v in times.items()}
    best = {name: min(v) for name, v in times.items()}
    pairs = [("bagualu2 adaptive, ample", "plain pytorch"), ("bagualu2 keep_all", "plain pytorch"),
             ("bagualu2 all-keep, traced", "plain pytorch"),
             ("bagualu2 offload_all", "torch save_on_cpu"), ("bagualu2 offload_all", "torch save_on_cpu, pinned"),
             ("bagualu2 recompute_all", "torch checkpoint"), ("bagualu2 checkpoint's set", "torch checkpoint")]
    pairs = [(ours, baseline) for ours, baseline in pairs if baseline in variants]
    # Paired: the ratio within each round (the two ran seconds apart), then the median.
    paired = {(ours, baseline): statistics.median(a / b for a, b in zip(times[ours], times[baseline]))
              for ours, baseline in pairs}
    print()
    print(f"{'variant':<28}{'median ms':>11}{'best ms':>10}{'paired ratio':>14}{'median ratio':>14}{'best ratio':>12}"
          f"{'peak act. MB':>14}")
    for ours, baseline in pairs:
        print(f"{baseline:<28}{median[baseline] * 1000:>11.1f}{best[baseline] * 1000:>10.1f}")
        print(f"{ours:<28}{median[ours] * 1000:>11.1f}{best[ours] * 1000:>10.1f}"
              f"{paired[(ours, baseline)]:>13.3f}x{median[ours] / median[baseline]:>13.3f}x"
              f"{best[ours] / best[baseline]:>11.3f}x{peaks[ours] / 2**20:>14.1f}")
    result = {
        "config": args.config, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "threads": torch.get_num_threads(), "median_s": median, "best_s": best, "all_s": times,
        "peak_activation_bytes": peaks,
        "ratios": {f"{ours} / {baseline}": median[ours] / median[baseline] for ours, baseline in pairs},
        "paired_ratios": {f"{ours} / {baseline}": r for (ours, baseline), r in paired.items()},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
