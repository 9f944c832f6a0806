"""The reference model's gates, found by bagualu2's gate discovery (``register_module_gate``).

A ``TopKRouter`` is the gate of its layer (its output's ``tokens_per_expert``), unless the layer
is expert-parallel: then the layer's ``ExpertDispatcher`` is, as its hook runs after the count
exchange and before any token moves, and reads what this rank's experts will receive from every
rank (``num_experts`` = local experts) and, for the operators outside the experts, how many
slots this rank's own tokens routed (``GateSpec.size_fn``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

from torch import Tensor, nn

from bagualu2.models.moe_layer import ExpertDispatcher, MoELayer, RouterOutput, TopKRouter
from bagualu2.runtime.gates import GateSpec, register_module_gate

__all__ = ["find_gate"]


def _router_counts(module: nn.Module, args: tuple, output: Any) -> Tensor:
    # inside a compiled region the output arrives as a plain tuple (``regions.report_gate``)
    return RouterOutput(*output).tokens_per_expert.detach().clone()


def _received_counts(module: nn.Module, args: tuple, output: Any) -> Tensor:
    return output.sum(dim=0)  # [source rank, local expert] -> per local expert


def _routed_slots(module: nn.Module, args: tuple, output: Any) -> int:
    return int(args[0].sum())  # the dispatcher's argument: this rank's slots per expert


def find_gate(name: str, module: nn.Module, modules: Mapping[str, nn.Module]) -> Optional[Tuple[GateSpec, ...]]:
    """The gate at ``module`` (path ``name``) of a reference model: None when ``module`` is not
    one of its routing modules, ``()`` for an expert-parallel layer's router (its dispatcher is
    the gate)."""
    parent = name.rpartition(".")[0]
    layer = modules.get(parent)
    if isinstance(module, TopKRouter):
        if isinstance(layer, MoELayer) and layer.dispatcher is not None:
            return ()  # the layer's dispatcher is its gate: it knows what this rank's experts receive
        return (GateSpec(module, name, 0, module.num_experts, _router_counts, module.top_k, parent),)
    if isinstance(module, ExpertDispatcher):
        top_k = layer.top_k if isinstance(layer, MoELayer) else None
        return (GateSpec(module, name, 0, module.num_local_experts, _received_counts, top_k, parent,
                         _routed_slots, module.ep_size),)
    return None


register_module_gate(find_gate)
