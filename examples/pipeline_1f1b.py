"""Pipeline-parallel MoE training with bagualu2 on torch.distributed.pipelining (1F1B schedule).

Each rank holds a contiguous slice of the reference MoE transformer (a pipeline *stage*);
micro-batches flow through the stages under torch's 1F1B schedule, and bagualu2 decides, for
every micro-batch on every rank, which saved activations to keep, offload or recompute so the
rank stays under its activation budget even when a routing spike hits during the 1F1B
warm-up, when stage s already holds (stages - s) micro-batches.

Each rank is one process launched by torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; the script only calls ``torch.distributed.init_process_group``. On CPU, two
local processes talking over gloo (nothing else needed):

    torchrun --standalone --nproc-per-node 2 examples/pipeline_1f1b.py

or ``python examples/pipeline_1f1b.py --nproc 2``, which runs that same torchrun command for
you. On GPUs, one process per device; "nccl" is NCCL on NVIDIA and RCCL on AMD/Hygon (ROCm
builds of torch use the same name):

    torchrun --nproc-per-node 4 examples/pipeline_1f1b.py --backend nccl --budget auto

Options worth knowing: --schedule (gpipe, 1f1b, interleaved1f1b, zbv, dualpipev), --policy
(adaptive, keep_all, recompute_all, offload_all), --budget (bytes, or a fraction of device
memory on GPUs, or "auto"), --no-bagualu2 (the same pipeline without it, for comparison).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from bagualu2.integrations import pipeline as pp
from bagualu2.models import MoEConfig, MoETransformer, synthetic_batches


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2,
                   help="without torchrun: run under torchrun --standalone with this many local processes")
    p.add_argument("--backend", default="gloo", help="gloo (CPU), nccl (NVIDIA NCCL / AMD RCCL)")
    p.add_argument("--schedule", default="1f1b", choices=sorted(pp.SCHEDULES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--policy", default="adaptive", help="bagualu2 policy")
    # On CPU there is no device limit to derive a budget from, so the default is an explicit
    # byte budget sized for the default model: between what stage 0 needs when it releases
    # everything (~3 MB) and when it keeps everything (~8 MB). On GPUs pass "auto" or a fraction.
    p.add_argument("--budget", default="6e6",
                   help='activation budget per rank: bytes ("6e6"), a fraction of device memory ("0.8"), or "auto"')
    p.add_argument("--spike-every", type=int, default=7, help="force a 2.6x routing spike every N steps (0: never)")
    p.add_argument("--no-bagualu2", action="store_true", help="train the same pipeline without bagualu2")
    p.add_argument("--overlap", action="store_true",
                   help="overlap scheduler: prefetch the next backward's reloads during the forward "
                        "before it, recompute in the bubble")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def parse_budget(text: str):
    """'auto' stays a string; '0.8' is a fraction of device memory; '5e7' or '50000000' is bytes."""
    if text == "auto":
        return "auto"
    value = float(text)
    return value if value < 1 else int(value)


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    # 1. One device per rank. On CPU everything stays on the host; with NCCL/RCCL each process
    #    drives the GPU of its local rank (torchrun sets LOCAL_RANK).
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    if args.backend == "gloo":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)

    # 2. Every rank builds the whole model from the same seed, so all ranks agree on the
    #    weights without a broadcast; build_pipeline keeps this rank's stages and moves them
    #    to the device. (For models too large for host memory, build each stage directly.)
    spec = pp.SCHEDULES[args.schedule]
    num_stages = spec.num_stages(world_size)
    cfg = MoEConfig.small(num_layers=max(2, num_stages), max_seq_len=max(128, args.seq))
    torch.manual_seed(args.seed)
    model = MoETransformer(cfg)

    # 3. The data stream is identical on every rank (same seed): the first stage reads the
    #    tokens, the last stage the next-token targets, the others neither.
    batch_size = args.microbatch_size * args.microbatches
    data = synthetic_batches(cfg.vocab_size, batch_size, args.seq + 1, seed=args.seed)
    example = torch.zeros(args.microbatch_size, args.seq, dtype=torch.long)

    # 4. This rank's stages and the schedule. The loss is next-token cross-entropy per
    #    micro-batch; each block's MoE load-balancing loss is added to the backward on the
    #    stage that computed it (see StageModule), so the objective is the whole model's.
    pipe = pp.build_pipeline(model, args.schedule, n_microbatches=args.microbatches,
                             microbatch_example=example, device=device)

    # 5. bagualu2 on this rank's stage modules: one provisioner per rank, one budget per rank.
    #    The pipeline's phase tracker tells it which micro-batch is running and how many more
    #    forwards will stack before the next backward (the warm-up depth). With --overlap the
    #    overlap scheduler also plans each forward with the backward that follows it.
    prov = None
    if not args.no_bagualu2:
        prov = pp.enable_bagualu2(pipe, budget=parse_budget(args.budget), policy=args.policy,
                                  overlap=args.overlap)

    # 6. An ordinary optimizer over the local parameters only.
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)

    for step in range(args.steps):
        batch = next(data).to(device)
        tokens, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        spike = args.spike_every and step % args.spike_every == args.spike_every - 1
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        # A routing spike: every router on this rank sends ~2.6x the mean load to one expert
        # for the whole step (what an unlucky batch does in real training).
        with model.routing_spike(2.6) if spike else contextlib.nullcontext():
            losses = pipe.train_step(tokens, targets)
        opt.step()
        dt = time.perf_counter() - t0
        if pipe.has_last_stage:
            loss = torch.stack(losses).mean().item()
            print(f"[rank {rank}] step {step:3d}  loss {loss:.4f}  {dt * 1e3:7.1f} ms"
                  f"{'  (routing spike)' if spike else ''}", flush=True)

    # 7. What bagualu2 did on this rank: peak against budget, plan mix, decision latency.
    if prov is not None:
        report = prov.report()
        keys = ("steps", "micro_batches", "peak_bytes", "budget_bytes", "violations", "saved_bytes_by_choice",
                "decisions", "decision_latency_us")
        print(f"[rank {rank}] bagualu2: " + ", ".join(f"{k}={report[k]}" for k in keys if k in report), flush=True)
        prov.disable()
    pipe.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        # Not under torchrun: rerun this script under it, --nproc local processes on one node
        # (--standalone: a local rendezvous on a free port).
        from torch.distributed.run import main as torchrun

        argv = sys.argv[1:] if argv is None else list(argv)
        # "--": everything after it is the script and its arguments, not torchrun's options.
        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", "--", os.path.abspath(__file__), *argv])
        return
    # Under torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment.
    dist.init_process_group(args.backend)
    try:
        train(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
