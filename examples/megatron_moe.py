"""A Megatron-Core MoE GPTModel trained with bagualu2 through Megatron's own schedule, 2 processes.

Megatron-Core builds a tiny MoE GPTModel (local spec, a shared expert) with its experts split
over the ranks (expert parallelism, alltoall token dispatcher), or, with ``--pp 2``, split into
two pipeline stages trained by Megatron's 1F1B schedule. The training loop is Megatron's
``forward_backward`` with one call in front, ``enable_pipeline(model, get_forward_backward_func(),
budget=...)``: bagualu2 finds the MoE layers by itself, follows the schedule's phase, and decides
per micro-batch, from the tokens each rank's experts receive (the token dispatcher's counts),
what to keep, offload or recompute. At steps 7 to 9 every token of data-parallel rank 0 is
routed to experts 2 and 3 (top-2; on rank 1 under EP).

The same training runs three times from the same weights on the same batches: Megatron alone
(plain), bagualu2 keep_all and bagualu2 adaptive, both under one budget per rank, 5% above the
peak keep_all's first calm steps showed. Rank 0 prints every rank's losses and peaks side by
side: keep_all goes over the budget at the spike (on a device, an out-of-memory crash), adaptive
stays within it, and every loss equals plain Megatron's.

Run it on CPU (gloo) with megatron-core 0.16.1 installed (docs/engines.md), from the
repository root:

    torchrun --nproc-per-node 2 examples/megatron_moe.py            # EP=2
    torchrun --nproc-per-node 2 examples/megatron_moe.py --pp 2     # PP=2, 1F1B

Megatron-Core assumes a GPU in places that have nothing to do with bagualu2; on a CPU-only torch
this example applies the test shims of tests/megatron_shims.py (listed in docs/engines.md). Turn
off Megatron's own ``recompute_granularity``, ``fine_grained_activation_offloading`` and
``cpu_offloading``: bagualu2 refuses them at enable, naming them.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

# Megatron's jit_fuser is torch.compile; compiling inside a provisioned forward is slow on a
# CPU (docs/engines.md), so the example runs those functions eagerly.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bagualu2.integrations.megatron import enable_pipeline  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import megatron_shims as shims  # noqa: E402  (CPU-only stand-ins, see the note above)
from side_by_side import Run, report  # noqa: E402  (beside this file)

VOCAB, HIDDEN, SEQ, MICRO_BATCH, MICRO_BATCHES = 256, 64, 32, 2, 4


def build_model(pp: int, ep: int):
    """A tiny MoE GPTModel (this rank's stage of it), built by Megatron-Core's own classes."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    shims.use_cpu(seed=1234)
    config = TransformerConfig(
        num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=2 * HIDDEN,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=HIDDEN,
        moe_shared_expert_intermediate_size=HIDDEN, moe_token_dispatcher_type="alltoall",
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, add_bias_linear=False,
        hidden_dropout=0.1, attention_dropout=0.0, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, **shims.cpu_config_options())
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4),
                     vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    return model.train()


SPIKES = range(7, 10)  # steps at which data-parallel rank 0 routes every token to experts 2 and 3
CALM_STEPS = 3  # keep_all's first steps, whose peak sets the budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps of each run (default 12)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages, the rest is EP (default 1)")
    parser.add_argument("--headroom", type=float, default=1.05,
                        help="budget as a multiple of keep_all's calm peak (default 1.05)")
    args = parser.parse_args()
    if args.steps <= SPIKES.stop:
        parser.error(f"--steps {args.steps} must be above {SPIKES.stop}: the spike runs at steps 7 to 9")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    # keep_all going over the budget is what this example shows: the table counts it.
    warnings.filterwarnings("ignore", message="bagualu2: micro-batch .* went over the activation budget")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)
        output = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])

        def loss_func(output):
            loss = output.float().sum()
            return loss, torch.tensor(output.numel(), dtype=torch.int), {"loss": loss.detach()}
        return output, loss_func

    def train(model, optimizer, step: int, forward_backward) -> Optional[float]:
        dp_group = parallel_state.get_data_parallel_group()
        dp_rank = parallel_state.get_data_parallel_rank()
        for router in (m for m in model.modules() if hasattr(m, "topk") and hasattr(m, "expert_bias")):
            router.expert_bias.zero_()  # Megatron's own expert bias routes the spike (between steps)
            if step in SPIKES and dp_rank == 0:
                router.expert_bias[2:] = 10.0
        g = torch.Generator().manual_seed(1000 * dp_rank + step)
        data = iter([torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g) for _ in range(MICRO_BATCHES)])
        losses = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[model],
                                  num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        for p in model.parameters():  # data-parallel gradients; expert weights are per EP rank
            if p.grad is not None and getattr(p, "allreduce", True) and dp_group.size() > 1:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp_group.size()
        optimizer.step()
        optimizer.zero_grad()
        # Only the last pipeline stage computes the loss.
        return float(sum(d["loss"] for d in losses)) if losses else None

    def fresh():  # the same weights every time: Megatron's init under one seed
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        model = build_model(args.pp, dist.get_world_size() // args.pp)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    plain = Run("plain")
    model, optimizer = fresh()
    for step in range(args.steps):
        plain.record(train(model, optimizer, step, get_forward_backward_func()))

    # min_bytes=0: this tiny model's activations are all under the default 64 KiB, which are
    # kept whatever the budget; a real model's are far larger.
    keep_all = Run("keep_all")
    model, optimizer = fresh()
    prov, forward_backward = enable_pipeline(model, get_forward_backward_func(), budget=None,
                                             policy="keep_all", min_bytes=0)
    for step in range(args.steps):
        if step == CALM_STEPS:  # each rank its own budget, above its own calm peak
            prov.budget = int(keep_all.calm_peak() * args.headroom)
        keep_all.record(train(model, optimizer, step, forward_backward), prov)
    budget = prov.budget
    prov.disable()

    adaptive = Run("adaptive")
    model, optimizer = fresh()
    prov, forward_backward = enable_pipeline(model, get_forward_backward_func(), budget=budget,
                                             policy="adaptive", min_bytes=0)
    for step in range(args.steps):
        adaptive.record(train(model, optimizer, step, forward_backward), prov)
    prov.disable()

    report([plain, keep_all, adaptive], SPIKES, first_step=0)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
