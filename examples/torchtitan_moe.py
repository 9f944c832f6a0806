"""A torchtitan MoE model trained with bagualu2: FSDP2 + expert parallelism, 2 processes.

torchtitan builds and parallelizes a tiny Qwen3-MoE with its own functions (FSDP2 over the
ranks, experts split over them by EP=2); the training loop is unchanged except for one call,
``bagualu2.enable(model, budget=...)``, which finds the MoE layers by itself and decides, per
micro-batch, from the tokens each rank's experts receive after torchtitan's count exchange,
what to keep, offload or recompute. At steps 8 to 10 every token of rank 0 is routed to experts
2 and 3 (top-2; they live on rank 1): rank 1's experts receive a spike they did not route.

The same training runs three times from the same weights on the same batches: torchtitan alone
(plain), bagualu2 keep_all and bagualu2 adaptive, both under one budget per rank, 5% above
the peak keep_all's first calm steps showed. Rank 0 prints every rank's losses and peaks side by
side: on rank 1 keep_all goes over the budget at the spike (on a device, an out-of-memory crash),
adaptive stays within it, and every loss equals plain torchtitan's.

Run it on CPU (gloo) with torchtitan 0.3.0 installed (docs/engines.md), from the repository root:

    torchrun --nproc-per-node 2 examples/torchtitan_moe.py

torchtitan assumes a GPU in places that have nothing to do with bagualu2; on a CPU-only
torch this example applies the test shims of tests/torchtitan_shims.py (SDPA attention in
place of FlexAttention, which has no CPU backward; device meshes on cpu; FSDP2 reductions gloo
can do). Turn off torchtitan's own activation checkpointing (``activation_checkpoint=None``),
compile and ``training.enable_cpu_offload``: bagualu2 refuses them at enable, naming them.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagualu2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import torchtitan_shims as shims  # noqa: E402  (CPU-only stand-ins, see the note above)
from side_by_side import Run, report  # noqa: E402  (beside this file)

VOCAB, DIM, HEAD_DIM, SEQ, BATCH = 256, 64, 16, 32, 2


def build_model(ep: int):
    """A tiny Qwen3-MoE, parallelized by torchtitan's parallelize_qwen3 (FSDP2 + EP)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (Qwen3Model, _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers,
                                         _qwen3_norm, parallelize_qwen3)

    shims.use_cpu()
    dist_utils.set_spmd_backend("partial_dtensor")
    parallelism = ParallelismConfig(expert_parallel_degree=ep, spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    config = shims.with_sdpa(Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=4, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM, moe_hidden_dim=64,
            num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1e6))))
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    model = parallelize_qwen3(
        model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism, compile_config=CompileConfig(), ac_config=None, dump_folder="")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    shims.force_sum_reduction(model)
    return model.train()


SPIKES = range(8, 11)  # steps at which rank 0 routes every token to experts 2 and 3 (on rank 1)
CALM_STEPS = 3  # keep_all's first steps, whose peak sets the budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=14, help="training steps of each run (default 14)")
    parser.add_argument("--headroom", type=float, default=1.05,
                        help="budget as a multiple of keep_all's calm peak (default 1.05)")
    args = parser.parse_args()
    if args.steps <= SPIKES.stop:
        parser.error(f"--steps {args.steps} must be above {SPIKES.stop}: the spike runs at steps 8 to 10")
    warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's fp32 router autocast
    # keep_all going over the budget is what this example shows: the table counts it.
    warnings.filterwarnings("ignore", message="bagualu2: micro-batch .* went over the activation budget")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    def train(model, optimizer, step: int) -> float:
        for layer in model.layers.values():  # torchtitan's own load-balancing bias routes the spike
            layer.moe.expert_bias_E.zero_()
            if step in SPIKES and rank == 0:
                layer.moe.expert_bias_E[2:] = 1.0
        g = torch.Generator().manual_seed(1000 * rank + step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    def fresh():  # the same weights every time: torchtitan's init under one seed
        model = build_model(ep=dist.get_world_size())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    plain = Run("plain")
    model, optimizer = fresh()
    for step in range(args.steps):
        plain.record(train(model, optimizer, step))

    # min_bytes=0: this tiny model's activations are all under the default 64 KiB, which are
    # kept whatever the budget; a real model's are far larger.
    keep_all = Run("keep_all")
    model, optimizer = fresh()
    prov = bagualu2.enable(model, budget=None, policy="keep_all", min_bytes=0)
    for step in range(args.steps):
        if step == CALM_STEPS:  # each rank its own budget, above its own calm peak
            prov.budget = int(keep_all.calm_peak() * args.headroom)
        keep_all.record(train(model, optimizer, step), prov)
    budget = prov.budget
    prov.disable()

    adaptive = Run("adaptive")
    model, optimizer = fresh()
    prov = bagualu2.enable(model, budget=budget, policy="adaptive", min_bytes=0)
    for step in range(args.steps):
        adaptive.record(train(model, optimizer, step), prov)
    prov.disable()

    report([plain, keep_all, adaptive], SPIKES, first_step=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
