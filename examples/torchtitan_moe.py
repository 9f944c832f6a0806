"""A torchtitan MoE model trained with bagualu2: FSDP2 + expert parallelism, 2 processes.

torchtitan builds and parallelizes a tiny Qwen3-MoE with its own functions (FSDP2 over the
ranks, experts split over them by EP=2); the training loop is unchanged except for one call,
``bagualu2.enable(model, budget=...)``, which finds the MoE layers by itself and decides, per
micro-batch, from the tokens each rank's experts receive after torchtitan's count exchange,
what to keep, offload or recompute. Midway, every token of rank 0 is routed to expert 3
(which lives on rank 1) for a few steps: rank 1's experts receive a spike they did not route.

Run it on CPU (gloo), nothing else needed:

    torchrun --nproc-per-node 2 examples/torchtitan_moe.py

torchtitan assumes a GPU in places that have nothing to do with bagualu2; on a CPU-only
torch this example applies the test shims of tests/torchtitan_shims.py (SDPA attention in
place of FlexAttention, which has no CPU backward; device meshes on cpu; FSDP2 reductions gloo
can do). Turn off torchtitan's own activation checkpointing (``activation_checkpoint=None``),
compile and ``training.enable_cpu_offload``: bagualu2 refuses them at enable, naming them.
"""
from __future__ import annotations

import argparse
import os
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--policy", default="adaptive", choices=bagualu2.POLICIES)
    parser.add_argument("--headroom", type=float, default=1.05,
                        help="budget as a multiple of the calm peak of the first steps")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's fp32 router autocast
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = build_model(ep=dist.get_world_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(step: int) -> float:
        spike = 8 <= step < 11 and rank == 0
        for layer in model.layers.values():  # torchtitan's own load-balancing bias routes the spike
            layer.moe.expert_bias_E.zero_()
            if spike:
                layer.moe.expert_bias_E[3] = 1.0
        g = torch.Generator().manual_seed(1000 * rank + step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    # Measure the calm peak with keep_all, then hold each rank to its own budget above it.
    probe = bagualu2.enable(model, budget=None, policy="keep_all")
    for step in range(3):
        train_step(step)
    calm = probe.report()["peak_bytes_with_backward"]
    probe.disable()
    prov = bagualu2.enable(model, budget=int(calm * args.headroom), policy=args.policy)
    for step in range(3, args.steps):
        loss = train_step(step)
        prov.step()
        print(f"rank {rank} step {step:2d} loss {loss:.4f} activation peak so far "
              f"{prov.report()['peak_bytes_with_backward']:,} B", flush=True)
    report = prov.report()
    print(f"rank {rank}: gates {len(report['gates'])}, budget {report['budget_bytes']:,} B, "
          f"peak {report['peak_bytes_with_backward']:,} B, violations {report['violations']}, "
          f"saved bytes by choice {report['saved_bytes_by_choice']}", flush=True)
    prov.disable()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
