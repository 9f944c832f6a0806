"""torchtitan 0.3.0: MoE gates, the per-local-expert counts after the EP count exchange, and the
options that conflict with bagualu2.

Contract
--------
``bagualu2.enable(model)`` on a torchtitan model (or a pipeline stage of one), after
torchtitan's own ``parallelize_*`` / ``pipeline_llm``, provisions it with no registration:
:func:`find_gates` is what ``bagualu2.runtime.gates.find_gates`` returns for it.

Where the load is read. torchtitan 0.3.0's ``MoE`` (``layers.<i>.moe``) routes in
``router`` (``TokenChoiceTopKRouter``: top-k scores, expert ids, all scores), then calls
``routed_experts`` (``RoutedExperts``), whose token dispatcher reorders the tokens and, under
expert parallelism (``AllToAllTokenDispatcher``), exchanges the per-expert counts with the
other EP ranks (an ``all_to_all_single`` of counts, waited on) and then the tokens, before it
calls ``routed_experts.inner_experts`` (``GroupedExperts``) with ``(routed tokens,
tokens per local expert)``. The router sees only this rank's routing; the experts' activations
follow the tokens this rank *receives*. So the gate bagualu2 hooks is a forward pre-hook on
``inner_experts``: its second argument is the per-local-expert count after the exchange (the
whole count per expert without EP), and the pre-hook runs after the token exchange and before
any expert computes. The dense ops before it (routing, the local reorder) have sizes fixed by
the micro-batch, not by the routing.

The experts of a layer are one module (grouped matmuls over all local experts), not one
module per expert, so the cost model drives their ops by the micro-batch size (the first MoE
layer's received tokens on this rank), not expert by expert.

Refused at ``enable`` (``ValueError`` naming the torchtitan option to turn off):

- activation checkpointing, ``activation_checkpoint`` = ``full`` or ``selective`` (blocks
  wrapped in ``CheckpointWrapper``): checkpointed blocks save almost nothing through autograd's
  saved-tensor hooks, and selective checkpointing keeps its saved outputs in a private cache
  those hooks never see; bagualu2 makes the keep / offload / recompute choice itself;
- ``memory-budget`` activation checkpointing (``torch._functorch.config.
  activation_memory_budget`` below 1): the compiler's partitioner then decides what is saved;
- ``training.enable_cpu_offload`` (FSDP2's ``CPUOffloadPolicy``): parameters copied in and out
  around every module, which rebuilds in backward would read.

Compile. torchtitan's ``compile.enable`` with ``"model"`` in ``compile.components`` calls
``block.compile(backend=..., fullgraph=True)`` on every transformer block before FSDP2 wraps
it: each block is a compiled region, one unit of the plan (``"layers.<i>:compiled"``,
docs/CONTRACTS.md "torch.compile"). FSDP2's hooks and the EP token exchange run inside the
compiled call, so such a block issues collectives: it is kept or offloaded, never rerun in
backward (``bagualu2.runtime.regions.holds_collectives`` sees the FSDP2 state, the DTensor
expert weights and the EP dispatcher's device mesh). The gate's pre-hook on ``inner_experts``
runs inside the compiled block and reports through ``report_gate``.

Checkpoints: :func:`add_to_checkpoint` puts the provisioner among the states torchtitan's
``CheckpointManager`` saves and loads through DCP, beside the model, the optimizers, the
learning-rate schedulers and the train state; each rank saves and loads its own entry
(``Provisioner.state_dict``), so a resumed run decides as the one that never stopped would.

Nothing here changes torchtitan; CPU-only test shims (attention, device type, gloo reductions)
live in the tests and are listed in docs/engines.md.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor, nn

from bagualu2.api import enable
from bagualu2.runtime.gates import GateSpec, register_gate_finder

__all__ = ["add_to_checkpoint", "check_options", "enable_pipeline", "find_gates", "is_torchtitan_model"]


def _from_torchtitan(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torchtitan.")


def is_torchtitan_model(model: nn.Module) -> bool:
    """Whether ``model`` holds torchtitan modules (itself, or below an FSDP / checkpoint
    wrapper)."""
    return any(_from_torchtitan(m) for m in model.modules())


def _moe_blocks(model: nn.Module) -> List[tuple]:
    """(path, MoE module) of every torchtitan MoE layer, in model order: a module with a
    ``router`` that has ``top_k`` and ``num_experts`` and a ``routed_experts`` with
    ``inner_experts``."""
    found = []
    for name, module in model.named_modules():
        if not _from_torchtitan(module):
            continue
        router = getattr(module, "router", None)
        routed = getattr(module, "routed_experts", None)
        if (isinstance(router, nn.Module) and isinstance(routed, nn.Module)
                and isinstance(getattr(routed, "inner_experts", None), nn.Module)
                and isinstance(getattr(router, "top_k", None), int)
                and isinstance(getattr(router, "num_experts", None), int)):
            found.append((name, module))
    return found


def _received_counts(module: nn.Module, args: tuple, output: Any = None) -> Tensor:
    """``GroupedExperts.forward(x, num_tokens_per_expert)``: the tokens each local expert will
    compute (after the EP count exchange when there is one)."""
    if len(args) < 2 or not isinstance(args[1], Tensor):
        raise TypeError(
            f"{type(module).__name__} was called with {len(args)} positional argument(s); "
            f"torchtitan 0.3.0's GroupedExperts takes (tokens, num_tokens_per_expert) "
            f"positionally: this torchtitan version is not the one bagualu2 supports (0.3.0)")
    counts = args[1]
    to_local = getattr(counts, "to_local", None)  # a DTensor under tensor parallelism
    if callable(to_local):
        counts = to_local()
    return counts.detach().reshape(-1).to(torch.int64).clone()


def _ep_size(moe: nn.Module) -> int:
    """Ranks this MoE layer's experts are spread over (its dispatcher's EP mesh; 1 without)."""
    mesh = getattr(getattr(moe.routed_experts, "token_dispatcher", None), "ep_mesh", None)
    return mesh.size() if mesh is not None else 1


def find_gates(model: nn.Module) -> Optional[List[GateSpec]]:
    """The gates of a torchtitan model as ``bagualu2.runtime.gates.GateSpec``s (a forward pre-hook on each
    MoE layer's ``routed_experts.inner_experts``), or None when ``model`` is not a torchtitan
    model (other discovery applies then).

    Raises:
        ValueError: a torchtitan option that conflicts with bagualu2 is on
            (:func:`check_options`).
    """
    if not is_torchtitan_model(model):
        return None
    check_options(model)
    specs = []
    for name, moe in _moe_blocks(model):
        ep = _ep_size(moe)
        # No size_fn: the grouped experts are sized by the micro-batch size (module note), and
        # the tokens this rank's experts receive are what sizes them.
        specs.append(GateSpec(
            module=moe.routed_experts.inner_experts, name=f"{name}.routed_experts.inner_experts",
            layer=len(specs), num_experts=moe.router.num_experts // ep, counts_fn=_received_counts,
            top_k=moe.router.top_k, block_name=name, experts=f"{name}.routed_experts.inner_experts", ep_size=ep,
            pre_hook=True))
    return specs


def check_options(model: nn.Module) -> None:
    """Refuse torchtitan options that make their own activation decisions.

    Raises:
        ValueError: naming the option to turn off.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for name, module in model.named_modules():
        if isinstance(module, CheckpointWrapper):
            raise ValueError(
                f"{name or type(model).__name__} is wrapped by torchtitan's activation "
                f"checkpointing (CheckpointWrapper): bagualu2 decides what each block keeps, "
                f"offloads or recomputes itself, and checkpointed blocks hide their activations "
                f"from it. Turn it off: activation_checkpoint=None in the Trainer config "
                f"(command line: activation-checkpoint:none), or pass ac_config=None to "
                f"parallelize_fn / pipelining_fn")
        state = module._get_fsdp_state() if callable(getattr(module, "_get_fsdp_state", None)) else None
        groups = getattr(state, "_fsdp_param_groups", None) or []
        if any(type(getattr(g, "offload_policy", None)).__name__ == "CPUOffloadPolicy" for g in groups):
            raise ValueError(
                f"{name or type(model).__name__} is sharded with FSDP2's CPUOffloadPolicy "
                f"(torchtitan's training.enable_cpu_offload=True): parameters move between "
                f"host and device around each module, and bagualu2's rebuilds in backward "
                f"read them. Turn off training.enable_cpu_offload; bagualu2 offloads "
                f"activations itself")
    budget = getattr(torch._functorch.config, "activation_memory_budget", 1.0)
    if budget < 1.0:
        raise ValueError(
            f"torch._functorch.config.activation_memory_budget={budget} (torchtitan's "
            f"memory-budget activation checkpointing): the compiler's partitioner then decides "
            f"what is saved. Turn it off: activation_checkpoint=None in the Trainer config "
            f"(command line: activation-checkpoint:none), and reset "
            f"torch._functorch.config.activation_memory_budget to 1.0 in this process")


def enable_pipeline(schedule: Any, model_parts: List[nn.Module], **options: Any) -> Any:
    """``bagualu2.enable`` on this rank's stage of a torchtitan pipeline (``pipeline_llm``'s
    schedule and model parts), told the schedule's phase before every forward.

    Args:
        schedule: the ``torch.distributed.pipelining`` schedule torchtitan built.
        model_parts: this rank's stage modules; one per rank (``1F1B``, ``GPipe``).
        **options: passed to ``bagualu2.enable`` (budget, policy, ...).

    Returns:
        The stage's ``Provisioner``; its ``disable()`` also stops following the schedule.

    Raises:
        ValueError: more than one stage on this rank (interleaved and V schedules).
    """
    from bagualu2.integrations.pipeline import PipelinePhaseTracker, phase_follower

    if len(model_parts) != 1:
        raise ValueError(
            f"enable_pipeline provisions one stage per rank, and this rank holds {len(model_parts)} "
            f"(an interleaved or V schedule): use a single-stage schedule "
            f"(parallelism.pipeline_parallel_schedule='1F1B' or 'GPipe')")
    prov = enable(model_parts[0], **options)
    tracker = PipelinePhaseTracker(schedule)
    tracker.subscribe(phase_follower(prov))
    prov.on_disable(tracker.close)  # its wrappers and subscribers go with the provisioner
    return prov


def add_to_checkpoint(checkpointer: Any, prov: Any, key: str = "bagualu2") -> None:
    """Save ``prov`` in torchtitan's checkpoints and load it with them on resume.

    torchtitan's ``CheckpointManager`` (``trainer.checkpointer``) saves and loads every
    ``Stateful`` in its ``states`` through ``torch.distributed.checkpoint``; this adds the
    provisioner there under ``key``. Its state holds each rank's entry under that rank's own key
    (expert-parallel ranks see different loads), so every rank writes its own and reads its own
    back. Call it after ``bagualu2.enable`` and before ``checkpointer.load()`` (torchtitan's
    ``Trainer.train()`` loads first thing). To resume without the provisioner's state (it
    profiles again), list ``key`` in ``checkpoint.exclude_from_loading``.

    Args:
        checkpointer: torchtitan's ``CheckpointManager``; a disabled one (``checkpoint.enable``
            false) saves and loads nothing, and is left as it is.
        prov: the ``Provisioner`` (from ``bagualu2.enable`` or :func:`enable_pipeline`).
        key: its name in the checkpoint, beside ``model``, ``optimizer``, ``lr_scheduler``,
            ``dataloader`` and ``train_state``.

    Raises:
        ValueError: ``key`` already names another state of ``checkpointer``.
    """
    if not getattr(checkpointer, "enable", False):
        return
    held = checkpointer.states.get(key)
    if held is not None and held is not prov:
        raise ValueError(
            f"the checkpointer already saves {type(held).__name__} as {key!r}: pass another "
            f"key=... to add_to_checkpoint")
    checkpointer.states[key] = prov


register_gate_finder(find_gates)  # what bagualu2.enable finds on a torchtitan model
