"""Megatron-Core (megatron-core 0.16.1): MoE gates, the per-local-expert counts its token
dispatcher computes, its pipeline schedules, and the options that conflict with bagualu2.

Contract
--------
``bagualu2.enable(model)`` on a Megatron-Core ``GPTModel`` (or this rank's pipeline stage of one,
or Megatron's ``DistributedDataParallel`` around it) provisions it with no registration:
:func:`find_gates` is what ``bagualu2.runtime.gates.find_gates`` returns for it. With Megatron's pipeline
schedules, :func:`enable_pipeline` provisions the stage and returns the schedule function to
call instead of ``get_forward_backward_func()``'s, which tells the planner where this rank is.

Where the load is read. Megatron's ``MoELayer`` (``decoder.layers.<i>.mlp``) runs its shared
experts, then ``router`` (``TopKRouter``: ``topk``, returns ``(probs, routing_map)`` with a
boolean ``[tokens, experts]`` map), then its token dispatcher: ``dispatch_preprocess`` counts the
tokens per expert and, under expert parallelism, exchanges the counts (the alltoall
dispatcher's gather of counts over the EP group; the allgather dispatcher gathers the whole
routing map), ``token_dispatch`` moves the tokens, ``dispatch_postprocess`` sorts them by local
expert, and then it calls ``mlp.experts`` (``SequentialMLP`` with the local spec, grouped MLPs
with Transformer Engine) as ``experts(tokens, tokens_per_expert, probs)``. That second argument
is the dispatcher's own count of the tokens each *local* expert computes, from every EP rank
(all tokens without EP). The gate bagualu2 hooks is a forward pre-hook on ``mlp.experts``: the
first module boundary after the dispatcher computed the counts, before any expert computes.
Between the count exchange and that hook only the token exchange and the sort by expert run,
which save nothing whose size the routing decides; the received tokens are first saved by
the experts, after the decision. The count exchange is Megatron's: bagualu2 adds no collective.

The shared experts (``mlp.shared_experts``) run on every token before routing: they are dense
operators sized by the micro-batch, like attention. The experts' path is ``<layer>.experts``
(``GateSpec.experts`` left at its default): the cost model drives each of
``experts.local_experts.<e>`` (``SequentialMLP``) by its own expert's tokens, and a grouped MLP's
ops by the layer's tokens.

Pipeline. Megatron's non-interleaved 1F1B (``forward_backward_pipelining_without_interleaving``)
runs ``pp_size - pp_rank - 1`` warm-up forwards (at most the micro-batches), then one forward
and one backward at a time, then the remaining backwards. Before each forward of the stage
:func:`enable_pipeline`'s schedule tells the provisioner the phase and how many more forwards
this rank runs before its next backward (``Provisioner.set_pipeline_phase``), and after the step
calls ``Provisioner.step()``. The first stage stacks the most. Without pipelining
(``forward_backward_no_pipelining``: forward then backward per micro-batch) nothing stacks.
Interleaved (virtual) pipelines put several model chunks on a rank: refused, one stage per rank.

Refused at ``enable`` (``ValueError`` naming the Megatron option to turn off), because each
makes its own activation decision that bagualu2 cannot see or that would hide activations from
it:

- ``recompute_granularity='full'`` (whole layers checkpointed: ``recompute_method``,
  ``recompute_num_layers``) and ``'selective'`` (``recompute_modules``: ``core_attn``, ``moe``,
  ``moe_act``, ``shared_experts``, ``layernorm``, ``mla_up_proj``, ``mlp``): Megatron's
  checkpoint runs the forward without grad and keeps only its inputs, so the checkpointed
  modules' activations never reach the saved-tensor hooks; bagualu2 makes that choice per
  operator itself;
- ``fine_grained_activation_offloading`` (``offload_modules``) and ``cpu_offloading``
  (``cpu_offloading_activations`` / ``cpu_offloading_weights``): Megatron's offloaders install
  their own saved-tensor hooks, and only the innermost pair applies;
- ``cuda_graph_impl`` other than ``'none'``: captured graphs replay fixed allocations that no
  per-micro-batch plan can change;
- a paged stash of MoE activations (``moe_paged_stash`` and related fields), when a version
  has one: a fixed buffer whose overflow reruns the step. megatron-core 0.16.1 has none.

Nothing here changes Megatron; the CPU-only test shims (its CUDA calls, its RNG tracker) live in
tests/megatron_shims.py and are listed in docs/engines.md.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

__all__ = ["check_options", "enable_pipeline", "find_gates", "is_megatron_model", "one_f_one_b_phases"]

SUPPORTED_VERSIONS = ("0.16.1",)
"""megatron-core versions the tests ran against."""


def _from_megatron(module: nn.Module) -> bool:
    return type(module).__module__.startswith("megatron.core.")


def is_megatron_model(model: nn.Module) -> bool:
    """Whether ``model`` holds Megatron-Core modules (itself or below a wrapper)."""
    return any(_from_megatron(m) for m in model.modules())


def _moe_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, MoE layer) of every Megatron MoE layer, in model order: a Megatron module with a
    ``router`` that has an integer ``topk``, an ``experts`` module and a ``token_dispatcher``."""
    found = []
    for name, module in model.named_modules():
        if not _from_megatron(module):
            continue
        router = getattr(module, "router", None)
        experts = getattr(module, "experts", None)
        if (isinstance(router, nn.Module) and isinstance(experts, nn.Module)
                and isinstance(getattr(router, "topk", None), int)
                and getattr(module, "token_dispatcher", None) is not None
                and isinstance(getattr(module, "num_local_experts", None), int)):
            found.append((name, module))
    return found


def _local_expert_counts(module: nn.Module, args: tuple, output: Any = None) -> Tensor:
    """``experts(tokens, tokens_per_expert, probs)``: the tokens each local expert computes, as
    the token dispatcher counted them (after the EP count exchange when there is one)."""
    if len(args) < 2:
        raise TypeError(
            f"{type(module).__name__} was called with {len(args)} positional argument(s); "
            f"megatron-core's MoELayer calls its experts as (tokens, tokens_per_expert, probs): "
            f"this version is not one bagualu2 supports ({', '.join(SUPPORTED_VERSIONS)})")
    counts = args[1]
    if not isinstance(counts, Tensor):
        counts = torch.as_tensor(counts)
    return counts.detach().reshape(-1).to(device="cpu", dtype=torch.int64).clone()


def _ep_size(moe: nn.Module) -> int:
    group = getattr(moe, "ep_group", None)
    return group.size() if group is not None else 1


def find_gates(model: nn.Module) -> Optional[list]:
    """The gates of a Megatron-Core model as ``bagualu2.runtime.gates.GateSpec``s (a forward pre-hook on
    each MoE layer's ``experts``), or None when ``model`` holds no Megatron-Core module.

    Raises:
        ValueError: a Megatron option that conflicts with bagualu2 is on (:func:`check_options`).
    """
    if not is_megatron_model(model):
        return None
    check_options(model)
    from bagualu2.runtime.gates import GateSpec

    specs = []
    for name, moe in _moe_layers(model):
        specs.append(GateSpec(
            module=moe.experts, name=f"{name}.experts", layer=len(specs),
            num_experts=moe.num_local_experts, counts_fn=_local_expert_counts,
            top_k=moe.router.topk, block_name=name, ep_size=_ep_size(moe), pre_hook=True))
    return specs


_PAGED_STASH_FIELDS = ("moe_paged_stash", "paged_stash", "moe_enable_paged_stash")


def _configs(model: nn.Module) -> List[Tuple[str, Any]]:
    """(module path, TransformerConfig) of every Megatron module, one per distinct config."""
    seen, out = set(), []
    for name, module in model.named_modules():
        config = getattr(module, "config", None) if _from_megatron(module) else None
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            out.append((name or type(model).__name__, config))
    return out


def check_options(model: nn.Module) -> None:
    """Refuse Megatron options that make their own activation decisions.

    Raises:
        ValueError: naming the option (``TransformerConfig`` field) to turn off.
    """
    for where, config in _configs(model):
        granularity = getattr(config, "recompute_granularity", None)
        if granularity == "full":
            raise ValueError(
                f"{where}: TransformerConfig.recompute_granularity='full' (recompute_method="
                f"{getattr(config, 'recompute_method', None)!r}, recompute_num_layers="
                f"{getattr(config, 'recompute_num_layers', None)!r}): Megatron checkpoints whole layers, "
                f"whose activations then never reach bagualu2, which decides per operator what to "
                f"keep, offload or recompute. Set recompute_granularity=None (command line: drop "
                f"--recompute-granularity)")
        if granularity == "selective":
            raise ValueError(
                f"{where}: TransformerConfig.recompute_granularity='selective' with recompute_modules="
                f"{getattr(config, 'recompute_modules', None)!r}: Megatron checkpoints those modules, whose "
                f"activations then never reach bagualu2, which decides per operator what to keep, offload "
                f"or recompute. Set recompute_granularity=None (command line: drop "
                f"--recompute-granularity and --recompute-modules; --moe-layer-recompute sets it too)")
        if getattr(config, "fine_grained_activation_offloading", False):
            raise ValueError(
                f"{where}: TransformerConfig.fine_grained_activation_offloading=True (offload_modules="
                f"{getattr(config, 'offload_modules', None)!r}): Megatron's offloader installs its own "
                f"saved-tensor hooks, and only the innermost pair applies. Set "
                f"fine_grained_activation_offloading=False (command line: drop "
                f"--fine-grained-activation-offloading); bagualu2 offloads activations itself")
        if getattr(config, "cpu_offloading", False):
            raise ValueError(
                f"{where}: TransformerConfig.cpu_offloading=True (cpu_offloading_activations="
                f"{getattr(config, 'cpu_offloading_activations', None)!r}, cpu_offloading_weights="
                f"{getattr(config, 'cpu_offloading_weights', None)!r}): Megatron's layer offloader installs "
                f"its own saved-tensor hooks, and only the innermost pair applies. Set cpu_offloading=False "
                f"(command line: drop --cpu-offloading); bagualu2 offloads activations itself")
        graphs = getattr(config, "cuda_graph_impl", "none")
        if graphs not in (None, "none"):
            raise ValueError(
                f"{where}: TransformerConfig.cuda_graph_impl={graphs!r}: captured CUDA graphs replay "
                f"fixed allocations that bagualu2's per-micro-batch plans cannot change. Set "
                f"cuda_graph_impl='none' (command line: drop --cuda-graph-impl / --enable-cuda-graph)")
        for field in _PAGED_STASH_FIELDS:
            if getattr(config, field, False):
                raise ValueError(
                    f"{where}: TransformerConfig.{field}={getattr(config, field)!r}: Megatron's paged stash "
                    f"keeps MoE activations in a fixed buffer of its own and reruns the step when it "
                    f"overflows. Turn {field} off; bagualu2 decides per micro-batch what to keep")


# -- pipeline schedules --------------------------------------------------------------------


def _pipeline_group(kwargs: dict) -> Tuple[int, int]:
    """(stages, this rank's stage) of the schedule's pipeline group, as the schedule finds it."""
    p2p = kwargs.get("p2p_communicator")
    group = getattr(p2p, "pp_group", None)
    if group is None:
        group = getattr(kwargs.get("pg_collection"), "pp", None)
    if group is not None:
        return group.size(), group.rank()
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_rank())


def one_f_one_b_phases(stages: int, stage: int, microbatches: int) -> List[Tuple[str, int]]:
    """(phase, forwards after it before this rank's next backward) of each forward of
    Megatron's non-interleaved 1F1B on ``stage`` of ``stages``: warm-up forwards first, each
    followed by the rest of the warm-up and the first steady forward; steady forwards run just
    before a backward."""
    assert 0 <= stage < stages and microbatches >= 1, f"{stages=}, {stage=}, {microbatches=}"
    warmup = min(stages - stage - 1, microbatches)
    steady = microbatches - warmup
    return ([("warmup", warmup - 1 - i + (1 if steady else 0)) for i in range(warmup)]
            + [("steady", 0)] * steady)


class _ScheduleHandle:
    """Removes the stage's forward pre-hook with the provisioner's other hooks (``disable``)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def remove(self) -> None:
        self._handle.remove()


def enable_pipeline(model: Any, forward_backward_func: Optional[Callable[..., Any]] = None,
                    **options: Any) -> Tuple[Any, Callable[..., Any]]:
    """``bagualu2.enable`` on this rank's stage of a Megatron-Core model, and the schedule
    function to train it with, which tells the provisioner the pipeline phase before every
    forward and ends the provisioner's step after every call.

    Args:
        model: this rank's model chunk (a ``GPTModel`` or Megatron's DDP around it), or a
            one-element list of it as Megatron passes models to its schedules.
        forward_backward_func: Megatron's schedule (``get_forward_backward_func()``, the
            default): ``forward_backward_no_pipelining`` or the non-interleaved 1F1B
            ``forward_backward_pipelining_without_interleaving``.
        **options: passed to ``bagualu2.enable`` (budget, policy, ...).

    Returns:
        ``(provisioner, forward_backward)``: call ``forward_backward`` with the arguments
        Megatron's schedule takes. ``provisioner.disable()`` also stops following the schedule
        (the returned function then runs Megatron's schedule as it is).

    Raises:
        ValueError: more than one model chunk on this rank, or the interleaved (virtual pipeline)
            schedule; a conflicting Megatron option (:func:`check_options`).
    """
    from bagualu2.provisioner import enable

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if forward_backward_func is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward_func = get_forward_backward_func()
    name = getattr(forward_backward_func, "__name__", type(forward_backward_func).__name__)
    if len(chunks) != 1 or name == "forward_backward_pipelining_with_interleaving":
        raise ValueError(
            f"enable_pipeline provisions one model chunk per rank, and this rank has {len(chunks)} "
            f"with schedule {name}: turn off the virtual pipeline "
            f"(virtual_pipeline_model_parallel_size=None, command line: drop "
            f"--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank)")
    if name not in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving"):
        raise ValueError(
            f"enable_pipeline follows Megatron's forward_backward_no_pipelining and "
            f"forward_backward_pipelining_without_interleaving, not {name}")
    stage = chunks[0]
    prov = enable(stage, **options)
    pipelined = name == "forward_backward_pipelining_without_interleaving"
    phases: List[Tuple[str, int]] = []

    def before_forward(module: nn.Module, args: tuple) -> None:
        if prov.enabled and phases and torch.is_grad_enabled():
            phase, stacked = phases.pop(0)
            prov.set_pipeline_phase(phase, stacked)

    prov._hooks.append(_ScheduleHandle(stage.register_forward_pre_hook(before_forward)))

    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        if not prov.enabled or kwargs.get("forward_only", False):
            return forward_backward_func(*args, **kwargs)
        if pipelined:
            stages, rank = _pipeline_group(kwargs)
            phases[:] = one_f_one_b_phases(stages, rank, int(kwargs["num_microbatches"]))
        try:
            return forward_backward_func(*args, **kwargs)
        finally:
            phases.clear()
            prov.set_pipeline_phase("none", 0)
            prov.step()

    forward_backward.__name__ = name
    forward_backward.__wrapped__ = forward_backward_func  # type: ignore[attr-defined]
    return prov, forward_backward
