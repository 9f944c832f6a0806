"""Finding MoE gates in a model and reading tokens per expert from their outputs.

A gate is the module whose forward decides the routing of a MoE layer. The provisioner puts a
forward hook on it: the hook runs after routing and before the experts, and turns the gate's
output into the number of token slots per expert (``GateSpec.counts_fn``).

Gate finders register here; this module imports nothing above the runtime. A *model* finder
(``register_gate_finder``) answers for a whole model or not at all: the engines' (Megatron-Core
MoE layers, ``decoder.layers.i.mlp``, through :mod:`bagualu2.integrations.megatron`, and
torchtitan's through :mod:`bagualu2.integrations.torchtitan`: a pre-hook on each layer's
experts reads the counts its token dispatcher computed), tried in registration order; the first
that answers gives the gates. Otherwise ``model.named_modules()`` is walked in order (layers are
numbered 0, 1, ... in that order, counting MoE layers only), and each module is asked of the
*module* finders (``register_module_gate``), then of the built-in rules:

- (module finder, :mod:`bagualu2.models`) the reference model's :class:`bagualu2.models.TopKRouter`
  (reads ``tokens_per_expert``), or, in an expert-parallel layer, its
  :class:`bagualu2.models.ExpertDispatcher` instead: its hook runs after the count exchange and
  before any token moves, and reads what this rank's experts will receive from every rank
  (``num_experts`` = local experts) and, for the operators outside the experts, how many slots
  this rank's own tokens routed (``GateSpec.size_fn``);
- Hugging Face transformers 5.x routers at ``model.layers.i.mlp.gate`` (``MixtralTopKRouter``,
  ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``, ``DeepseekV3TopkRouter`` and routers built
  the same way: a module with ``top_k`` and ``num_experts`` returning ``(router_logits,
  weights, indices)``). Counts come from the returned indices, which already include
  DeepSeek-V3's group-limited selection and ``e_score_correction_bias``; re-deriving them from
  the logits would be wrong for DeepSeek-V3;
- transformers 4.x gates: a plain ``nn.Linear`` named ``gate`` inside a sparse MoE block
  (a parent with ``experts`` and ``top_k`` or ``num_experts_per_tok``), returning logits; the
  counts are the top-k of the logits, as the block's softmax + top-k choose the same experts.

Anything else: :func:`describe_unsupported` lists modules that look like routers, and the
caller registers them explicitly (``prov.register_gate``) with :func:`counts_from_indices` or
:func:`counts_from_logits`, or reports counts itself (``bagualu2.on_gating``).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

CountsFn = Callable[[nn.Module, tuple, Any], Tensor]
"""(gate module, forward args, forward output) -> int64 [num_experts] token slots per expert."""

SizeFn = Callable[[nn.Module, tuple, Any], int]
"""(gate module, forward args, forward output) -> token slots this rank's own tokens routed."""

ModelGateFinder = Callable[[nn.Module], Optional[Sequence["GateSpec"]]]
"""model -> its gates, or None when it is not a model the finder knows (an engine's)."""

ModuleGateFinder = Callable[[str, nn.Module, Mapping[str, nn.Module]], Optional[Sequence["GateSpec"]]]
"""(path, module, every module of the model by path) -> None when the module is not the finder's;
else the gates at it: one, or none (a module the finder knows that is not a gate). Their
``layer`` is renumbered in model order."""

_MODEL_FINDERS: List[ModelGateFinder] = []
_MODULE_FINDERS: List[ModuleGateFinder] = []

HF_ROUTER_CLASSES = frozenset(
    {"MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "DeepseekV3TopkRouter"})
"""transformers 5.x router classes known to return (router_logits, weights, indices)."""


@dataclass
class GateSpec:
    """One MoE gate found in a model."""

    module: nn.Module
    name: str
    """Module path in the model (``named_modules`` name)."""
    layer: int
    """MoE layer index: 0-based, in model order, counting MoE layers only."""
    num_experts: int
    counts_fn: CountsFn
    """(module, args, output) -> int64 [num_experts] token slots per expert, no autograd."""
    top_k: Optional[int] = None
    """Experts per token, when the gate states it."""
    block_name: Optional[str] = None
    """Path of the MoE block holding the gate and its experts (the gate's parent)."""
    size_fn: Optional[SizeFn] = None
    """Token slots this rank's own tokens routed (top-k times its tokens), which size the
    operators outside the experts, where the counts are not this rank's routing (an
    expert-parallel gate's counts are what its local experts receive). None: the counts' sum."""
    ep_size: int = 1
    """Ranks whose tokens this gate's experts receive (1 unless expert-parallel): at worst each
    local expert gets every token of every one of them."""
    pre_hook: bool = False
    """The hook runs before the module's forward (``counts_fn`` gets ``output=None``): the
    module is the experts themselves, called with the counts after an engine's EP exchange."""
    experts: Optional[str] = None
    """Path of the module holding the gate's experts: a ``ModuleList`` of experts (each one's ops
    scale with its own tokens), or one module running them all at once, grouped (its ops scale
    with the tokens of all of them). None: ``<block_name>.experts``."""

    @property
    def experts_path(self) -> str:
        """The path of the module holding the experts (``experts``, or its default)."""
        if self.experts is not None:
            return self.experts
        return f"{self.block_name}.experts" if self.block_name else "experts"


def _is_index_tensor(value: Any) -> bool:
    return (isinstance(value, Tensor) and not value.is_floating_point() and not value.is_complex()
            and value.dtype != torch.bool)


def _bincount(indices: Tensor, num_experts: int, gate: nn.Module) -> Tensor:
    flat = indices.reshape(-1).long()
    if flat.numel():
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= num_experts:
            raise ValueError(
                f"{type(gate).__name__} routed to experts in [{low}, {high}], outside "
                f"[0, {num_experts}); pass the gate's real num_experts")
    return torch.bincount(flat, minlength=num_experts)


def counts_from_indices(num_experts: int) -> CountsFn:
    """Counts from a gate whose output holds one integer tensor of chosen experts (any shape).

    The output may be that tensor itself or a tuple / list containing it next to float tensors
    (transformers 5.x: ``(router_logits, weights, indices)``).
    """
    def counts_fn(module: nn.Module, args: tuple, output: Any) -> Tensor:
        with torch.no_grad():
            found = [output] if _is_index_tensor(output) else (
                [v for v in output if _is_index_tensor(v)] if isinstance(output, (tuple, list)) else [])
            if len(found) != 1:
                kinds = ([type(v).__name__ if not isinstance(v, Tensor) else str(v.dtype) for v in output]
                         if isinstance(output, (tuple, list)) else [type(output).__name__])
                raise TypeError(
                    f"{type(module).__name__} output {kinds} does not hold exactly one integer "
                    f"tensor of expert indices; use counts_from_logits or a custom counts_fn")
            return _bincount(found[0], num_experts, module)
    return counts_fn


def counts_from_logits(num_experts: int, top_k: int) -> CountsFn:
    """Counts from a gate returning router logits ``[..., num_experts]`` (or a tuple starting with
    them), routed by plain top-k: the experts with the ``top_k`` largest logits per token."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"counts_from_logits needs 1 <= top_k <= num_experts, got {top_k=}, {num_experts=}")

    def counts_fn(module: nn.Module, args: tuple, output: Any) -> Tensor:
        with torch.no_grad():
            logits = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(logits, Tensor) or logits.shape[-1] != num_experts:
                shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
                raise TypeError(
                    f"{type(module).__name__} returned {shape}, expected logits [..., {num_experts}]")
            indices = logits.reshape(-1, num_experts).topk(top_k, dim=-1).indices
            return _bincount(indices, num_experts, module)
    return counts_fn


def _int_attr(module: nn.Module, *names: str) -> Optional[int]:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _registered(finders: List[Any], finder: Any) -> Callable[[], None]:
    finders.append(finder)
    return lambda: finders.remove(finder) if finder in finders else None


def register_gate_finder(finder: ModelGateFinder) -> Callable[[], None]:
    """Have :func:`find_gates` ask ``finder(model)`` first, after the finders registered before
    it: an engine's, for the models of that engine (None for any other). Returns the function
    that unregisters it."""
    return _registered(_MODEL_FINDERS, finder)


def register_module_gate(finder: ModuleGateFinder) -> Callable[[], None]:
    """Have :func:`find_gates` ask ``finder(path, module, modules)`` of every module, before the
    built-in rules and after the finders registered before it (a model family's gate classes).
    Returns the function that unregisters it."""
    return _registered(_MODULE_FINDERS, finder)


def find_gates(model: nn.Module) -> list[GateSpec]:
    """Every recognized MoE gate of ``model``, in model order; ``[]`` when none is recognized
    (see :func:`describe_unsupported` for what to do then)."""
    return _discover(model)[0]


def _discover(model: nn.Module) -> Tuple[List[GateSpec], Set[str]]:
    """The gates found, and the paths of the modules a module finder knew that are no gate."""
    for finder in list(_MODEL_FINDERS):
        engine_gates = finder(model)  # None: not a model of that engine
        if engine_gates is not None:
            return list(engine_gates), set()
    modules = dict(model.named_modules())
    specs: list[GateSpec] = []
    known: Set[str] = set()

    def add(name: str, module: nn.Module, num_experts: int, counts_fn: CountsFn, top_k: Optional[int]) -> None:
        specs.append(GateSpec(module, name, len(specs), num_experts, counts_fn, top_k, _parent(name)))

    for name, module in modules.items():
        leaf = name.rpartition(".")[2]
        found = next((f for f in (finder(name, module, modules) for finder in list(_MODULE_FINDERS))
                      if f is not None), None)
        if found is not None:
            for spec in found:
                specs.append(dataclasses.replace(spec, layer=len(specs)))
            if not found:
                known.add(name)
        elif type(module).__name__ in HF_ROUTER_CLASSES or (
                leaf in ("gate", "router") and not isinstance(module, nn.Linear)
                and _int_attr(module, "top_k") is not None
                and _int_attr(module, "num_experts", "n_routed_experts") is not None):
            num_experts = _int_attr(module, "num_experts", "n_routed_experts")
            if num_experts is None:
                raise ValueError(f"{name} ({type(module).__name__}) has no integer num_experts attribute")
            add(name, module, num_experts, counts_from_indices(num_experts), _int_attr(module, "top_k"))
        elif leaf == "gate" and isinstance(module, nn.Linear):
            block = modules.get(_parent(name))
            top_k = _int_attr(block, "top_k", "num_experts_per_tok") if block is not None else None
            if block is None or top_k is None or not hasattr(block, "experts"):
                continue
            num_experts = module.out_features
            stated = _int_attr(block, "num_experts", "num_local_experts")
            if stated is not None and stated != num_experts:
                raise ValueError(
                    f"{name}: gate has {num_experts} outputs but its block states "
                    f"num_experts={stated}; register it explicitly with the right count")
            add(name, module, num_experts, counts_from_logits(num_experts, top_k), top_k)
    return specs, known


_ROUTER_LIKE = re.compile(r"(?i)router|routing|gating|^gate$|_gate$|gate$")


def describe_unsupported(model: nn.Module) -> str:
    """Explain what :func:`find_gates` saw: modules named or typed like routers that it did not
    recognize, why, and how to register them by hand."""
    gates, known = _discover(model)
    recognized = {spec.name for spec in gates}
    modules = dict(model.named_modules())
    lines = []
    for name, module in modules.items():
        leaf, cls = name.rpartition(".")[2], type(module).__name__
        if not name or name in recognized or name in known or not (_ROUTER_LIKE.search(leaf) or _ROUTER_LIKE.search(cls)):
            continue  # known: a module finder's, no gate (an expert-parallel layer's router)
        if isinstance(module, nn.Linear) and module.out_features < 2:
            continue  # a scalar gate (e.g. Qwen2-MoE's shared_expert_gate) routes nothing
        if isinstance(module, nn.Linear):
            block = modules.get(_parent(name))
            why = (f"nn.Linear({module.in_features}, {module.out_features}); a gate that is a plain Linear "
                   f"layer (as in transformers 4.x) is found when it is named `gate` in a block with "
                   f"`experts` and `top_k`/`num_experts_per_tok` "
                   f"(parent: {type(block).__name__ if block is not None else None})")
        else:
            missing = [attr for attr, names in (("top_k", ("top_k",)),
                                                ("num_experts", ("num_experts", "n_routed_experts")))
                       if _int_attr(module, *names) is None]
            why = (f"{cls} lacks integer {' and '.join(missing)}" if missing else
                   f"{cls} is not at a path ending in `gate` or `router`")
        lines.append(f"  {name}: {why}")
    head = (f"{len(recognized)} MoE gate(s) recognized in {type(model).__name__}"
            + (f" ({', '.join(sorted(recognized))})." if recognized else "."))
    if not lines:
        return head + " No other module is named or typed like a router (gate, router, gating)."
    return "\n".join([
        head + " Unrecognized modules that look like routers:", *lines,
        "Register one with prov.register_gate(module, num_experts=..., counts_fn=...) using "
        "bagualu2.runtime.gates.counts_from_indices(num_experts) or counts_from_logits(num_experts, top_k), "
        "or call bagualu2.on_gating(tokens_per_expert, layer=...) from the MoE layer's forward."])
