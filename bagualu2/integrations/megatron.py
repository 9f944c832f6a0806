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

Interleaved 1F1B (``forward_backward_pipelining_with_interleaving``, a virtual pipeline: ``v``
model chunks per rank, passed to the schedule as a list) runs ``m * v`` forwards per rank, in
groups of ``microbatch_group_size_per_vp_stage`` micro-batches through chunk 0, then chunk 1, ...
(:func:`interleaved_chunks`), ``(pp_size - pp_rank - 1) * 2 + (v - 1) * group`` of them before
the first backward, then one forward and one backward at a time: the order of 1F1B over more
forwards, whose warm-up stacks more of them (:func:`interleaved_phases`). One provisioner and one
budget serve all the rank's chunks: ``enable_pipeline`` provisions a ``MegatronChunks`` over
them, and each chunk's ``forward`` goes through it, so every chunk forward is one micro-batch of
one ledger. Before each forward the phase of the next forward in the derived order is declared;
a chunk other than the one expected (a schedule this note does not describe) warns and leaves
the rest of the step to the provisioner's own count of what stacks. Megatron's
``overlap_moe_expert_parallel_comm`` (one micro-batch's forward merged with another's backward)
is refused.

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

import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from bagualu2.provision.forward import ProvisionedForward
from bagualu2.api import enable
from bagualu2.runtime.gates import GateSpec, register_gate_finder

__all__ = ["MegatronChunks", "check_options", "enable_pipeline", "find_gates", "interleaved_chunks",
           "interleaved_phases", "is_megatron_model", "one_f_one_b_phases"]

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


def find_gates(model: nn.Module) -> Optional[List[GateSpec]]:
    """The gates of a Megatron-Core model as ``bagualu2.runtime.gates.GateSpec``s (a forward pre-hook on
    each MoE layer's ``experts``), or None when ``model`` holds no Megatron-Core module.

    Raises:
        ValueError: a Megatron option that conflicts with bagualu2 is on (:func:`check_options`).
    """
    if not is_megatron_model(model):
        return None
    check_options(model)
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


def _phases(warmup: int, total: int) -> List[Tuple[str, int]]:
    """(phase, forwards after it before this rank's next backward) of each of ``total`` forwards
    of a 1F1B order: ``warmup`` forwards, then forward and backward alternating, then the
    remaining backwards. A warm-up forward is followed by the rest of the warm-up and the first
    steady forward; a steady forward runs just before a backward."""
    steady = total - warmup
    return ([("warmup", warmup - 1 - i + (1 if steady else 0)) for i in range(warmup)]
            + [("steady", 0)] * steady)


def one_f_one_b_phases(stages: int, stage: int, microbatches: int) -> List[Tuple[str, int]]:
    """(phase, forwards after it before this rank's next backward) of each forward of
    Megatron's non-interleaved 1F1B on ``stage`` of ``stages``: ``stages - stage - 1`` warm-up
    forwards (at most the micro-batches), then one forward and one backward at a time."""
    assert 0 <= stage < stages and microbatches >= 1, f"{stages=}, {stage=}, {microbatches=}"
    return _phases(min(stages - stage - 1, microbatches), microbatches)


def interleaved_chunks(microbatches: int, chunks: int, group: int) -> List[int]:
    """The model chunk of each forward of Megatron's interleaved 1F1B, in the order a rank runs
    them (``get_schedule_table``): groups of ``group`` micro-batches
    (``microbatch_group_size_per_vp_stage``) run through chunk 0, then chunk 1, ...; the last
    group takes the micro-batches left. Backward ``k`` runs chunk ``chunks - 1 - order[k]``."""
    assert microbatches >= 1 and chunks >= 1 and group >= 1, f"{microbatches=}, {chunks=}, {group=}"
    order: List[int] = []
    for first in range(0, microbatches, group):
        size = microbatches - first if first + group >= microbatches else group
        order += [chunk for chunk in range(chunks) for _ in range(size)]
    return order


def interleaved_phases(stages: int, stage: int, microbatches: int, chunks: int,
                       group: int) -> List[Tuple[int, str, int]]:
    """(model chunk, phase, forwards after it before this rank's next backward) of each forward
    of Megatron's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``) on
    ``stage`` of ``stages`` with ``chunks`` model chunks per rank.

    A rank runs ``microbatches * chunks`` forwards, ``(stages - stage - 1) * 2 + (chunks - 1) *
    group`` of them (at most all) before its first backward, then one forward and one backward
    at a time: the order of 1F1B over more forwards, with a warm-up that stacks more of them
    than 1F1B's ``stages - stage - 1``.
    """
    assert 0 <= stage < stages and chunks >= 1, f"{stages=}, {stage=}, {chunks=}"
    order = interleaved_chunks(microbatches, chunks, group)
    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * group, len(order))
    return [(chunk, phase, stacked) for chunk, (phase, stacked) in zip(order, _phases(warmup, len(order)))]


class MegatronChunks(nn.Module):
    """This rank's model chunks (virtual pipeline) behind one forward, so that one provisioner,
    one ledger and one budget serve them all.

    ``bagualu2.enable`` makes each call of a module's forward one micro-batch. Megatron's
    interleaved schedule calls each chunk itself (``forward_step_func(data_iterator,
    model[chunk])``); provisioning each chunk on its own would split the rank's budget into
    fixed parts. ``enable_pipeline`` provisions this container instead, and each chunk's
    ``forward`` goes through it (``chunk(...)`` runs the chunk's own hooks, then
    ``MegatronChunks(i, ...)``, whose forward is the chunk's own): every chunk forward is still
    its own micro-batch, and the chunks' parameters are the container's.
    """

    def __init__(self, chunks: List[nn.Module]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        # The chunks' own forwards: a chunk's ``forward`` attribute goes through this container
        # while it is provisioned.
        self._forwards = [chunk.forward for chunk in chunks]

    def forward(self, chunk: int, *args: Any, **kwargs: Any) -> Any:
        """Chunk ``chunk``'s own forward on the rest of the arguments."""
        return self._forwards[chunk](*args, **kwargs)


def _chunk_config(chunks: List[nn.Module]) -> Any:
    from megatron.core.utils import get_model_config

    return get_model_config(chunks[0])


_SCHEDULES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
              "forward_backward_pipelining_with_interleaving")


def enable_pipeline(model: Any, forward_backward_func: Optional[Callable[..., Any]] = None,
                    **options: Any) -> Tuple[Any, Callable[..., Any]]:
    """``bagualu2.enable`` on this rank's model chunks of a Megatron-Core model, and the schedule
    function to train them with, which tells the provisioner the pipeline phase before every
    forward and ends the provisioner's step after every call.

    One provisioner and one budget per rank: one chunk is provisioned itself; several (virtual
    pipeline) through one ``MegatronChunks`` over them, whose ledger holds every chunk's
    activations.

    Args:
        model: this rank's model chunk (a ``GPTModel`` or Megatron's DDP around it), or the list
            of them as Megatron passes models to its schedules (several with a virtual pipeline).
        forward_backward_func: Megatron's schedule (``get_forward_backward_func()``, the
            default): ``forward_backward_no_pipelining``, the 1F1B
            ``forward_backward_pipelining_without_interleaving`` or the interleaved 1F1B
            ``forward_backward_pipelining_with_interleaving``.
        **options: passed to ``bagualu2.enable`` (budget, policy, ...). With several chunks
            ``profile_frames`` defaults to enough micro-batches for every chunk to run two of
            them (``chunks * max(2, microbatch_group_size_per_vp_stage)``).

    Returns:
        ``(provisioner, forward_backward)``: call ``forward_backward`` with the arguments
        Megatron's schedule takes (the same chunks, in the same order). ``provisioner.disable()``
        also stops following the schedule and gives each chunk its own forward back (the
        returned function then runs Megatron's schedule as it is).

    Raises:
        ValueError: several chunks with a schedule other than the interleaved one; the
            interleaved schedule with ``overlap_moe_expert_parallel_comm``; a conflicting Megatron
            option (:func:`check_options`).
        RuntimeError: a chunk already has bagualu2 (or another forward wrapper) enabled.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if forward_backward_func is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward_func = get_forward_backward_func()
    name = getattr(forward_backward_func, "__name__", type(forward_backward_func).__name__)
    if name not in _SCHEDULES:
        raise ValueError(f"enable_pipeline follows Megatron's {', '.join(_SCHEDULES)}, not {name}")
    interleaved = name == "forward_backward_pipelining_with_interleaving"
    if len(chunks) > 1 and not interleaved:
        raise ValueError(
            f"this rank has {len(chunks)} model chunks and the schedule is {name}: several chunks per "
            f"rank (a virtual pipeline) run under forward_backward_pipelining_with_interleaving, which "
            f"get_forward_backward_func() returns once virtual_pipeline_model_parallel_size is set")
    wrapped = [i for i, chunk in enumerate(chunks) if "forward" in chunk.__dict__]
    if len(chunks) > 1 and wrapped:
        raise RuntimeError(f"model chunk(s) {wrapped} already have bagualu2 (or another forward wrapper) "
                           f"enabled; call disable() on the existing Provisioner first")
    if interleaved and getattr(_chunk_config(chunks), "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            "TransformerConfig.overlap_moe_expert_parallel_comm=True: Megatron's interleaved schedule then "
            "runs one micro-batch's forward and another's backward as one merged step, which no "
            "per-micro-batch plan can follow. Set overlap_moe_expert_parallel_comm=False (command line: "
            "drop --overlap-moe-expert-parallel-comm)")
    # (model chunk, phase, forwards after it before the next backward) of each forward to come.
    phases: List[Tuple[int, str, int]] = []

    def declare(prov: Any, chunk: int) -> None:
        if not (prov.enabled and phases and torch.is_grad_enabled()):
            return
        expected, phase, stacked = phases.pop(0)
        if expected != chunk:
            phases.clear()  # not the order derived: let the provisioner count what stacks itself
            phase, stacked = "none", 0
            warnings.warn(f"enable_pipeline: Megatron ran model chunk {chunk} where its interleaved "
                          f"schedule was expected to run chunk {expected}; the rest of this step is "
                          f"provisioned without the schedule's phases", RuntimeWarning, stacklevel=3)
        prov.set_pipeline_phase(phase, stacked)

    if len(chunks) == 1:
        prov = enable(chunks[0], **options)
        prov.on_disable(chunks[0].register_forward_pre_hook(lambda module, args: declare(prov, 0)).remove)
    else:
        # The cost model learns each chunk's operators from the micro-batches it profiles: enough
        # of them that every chunk runs at least two (the schedule runs a group of micro-batches
        # through each chunk in turn).
        group = getattr(_chunk_config(chunks), "microbatch_group_size_per_vp_stage", None) or 1
        options.setdefault("profile_frames", len(chunks) * max(2, group))
        root = MegatronChunks(chunks)
        prov = enable(root, **options)

        def entry(i: int) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                declare(prov, i)
                return root(i, *args, **kwargs)
            return run

        for i, chunk in enumerate(chunks):
            chunk.forward = ProvisionedForward(entry(i), root._forwards[i])

        def restore() -> None:
            for chunk in chunks:
                chunk.__dict__.pop("forward", None)

        prov.on_disable(restore)

    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        if not prov.enabled or kwargs.get("forward_only", False):
            return forward_backward_func(*args, **kwargs)
        if name != "forward_backward_no_pipelining":
            stages, rank = _pipeline_group(kwargs)
            micro = int(kwargs["num_microbatches"])
            if interleaved:
                config = _chunk_config(chunks)
                phases[:] = interleaved_phases(stages, rank, micro, len(chunks),
                                               config.microbatch_group_size_per_vp_stage or stages)
            else:
                phases[:] = [(0, phase, stacked) for phase, stacked in one_f_one_b_phases(stages, rank, micro)]
        try:
            return forward_backward_func(*args, **kwargs)
        finally:
            phases.clear()
            prov.set_pipeline_phase("none", 0)
            prov.step()

    forward_backward.__name__ = name
    forward_backward.__wrapped__ = forward_backward_func  # type: ignore[attr-defined]
    return prov, forward_backward


register_gate_finder(find_gates)  # what bagualu2.enable finds on a Megatron-Core model
