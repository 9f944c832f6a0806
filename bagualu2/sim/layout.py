"""Parallel layout: TP x PP (with virtual stages) x EP x DP, and where each unit lives.

World size = ``tp * pp * ep * dp``. Expert parallelism is carved out of data parallelism as in
DeepSeek-V3 / Megatron: each of the ``ep * dp`` data-parallel replicas of a pipeline stage
processes its own micro-batches; routed experts are sharded over ``ep`` and replicated over
``dp``; attention, dense FFNs, shared experts and embeddings are replicated over ``ep * dp``.

Pipeline units (see :meth:`bagualu2.sim.models.ModelSpec.unit_kinds`) are split into
``pp * vpp`` equal chunks; virtual stage ``v = chunk * pp + stage`` holds units
``[v * u, (v + 1) * u)`` with ``u = units / (pp * vpp)`` (Megatron's interleaved assignment).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from bagualu2.sim.clusters import ClusterSpec
from bagualu2.sim.models import ModelSpec

__all__ = ["Layout", "stage_static_bytes"]


@dataclass(frozen=True)
class Layout:
    """Parallel sizes and batch shape.

    Attributes:
        tp, pp, vpp, ep, dp: tensor, pipeline, virtual-pipeline, expert, data parallel sizes.
        microbatches: micro-batches per step per pipeline (``None``: 4 * pp).
        mbs: sequences per micro-batch.
        seq: tokens per sequence.
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    dp: int = 1
    microbatches: int = 0
    mbs: int = 1
    seq: int = 4096

    @property
    def world(self) -> int:
        """Accelerators in the job."""
        return self.tp * self.pp * self.ep * self.dp

    @property
    def m(self) -> int:
        """Micro-batches per step (resolved default)."""
        return self.microbatches or 4 * self.pp

    @property
    def global_tokens(self) -> int:
        """Tokens per optimizer step over the whole job."""
        return self.m * self.mbs * self.seq * self.ep * self.dp

    def validate(self, model: ModelSpec) -> None:
        """Raise ``ValueError`` naming the bad value and the fix."""
        for name in ("tp", "pp", "vpp", "ep", "dp", "mbs", "seq"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.microbatches < 0:
            raise ValueError(f"microbatches must be >= 1 (or 0 for the default 4*pp), "
                             f"got {self.microbatches}")
        units = model.units
        chunks = self.pp * self.vpp
        if units % chunks:
            divisors = [d for d in range(1, units + 1) if units % d == 0]
            raise ValueError(
                f"pp * vpp = {self.pp} * {self.vpp} = {chunks} does not divide the "
                f"{units} pipeline units of {model.name} ({model.layers} layers"
                f"{f' + {model.mtp_layers} MTP' if model.mtp_layers else ''}"
                f"{' + embedding + loss head' if model.embed_units else ''}); choose pp * vpp "
                f"among {divisors}")
        if model.experts and model.experts % self.ep:
            raise ValueError(f"ep = {self.ep} does not divide the {model.experts} experts of "
                             f"{model.name}; choose a divisor of {model.experts}")
        if not model.experts and self.ep != 1:
            raise ValueError(f"{model.name} is dense; use ep = 1 (got {self.ep})")
        if model.heads % self.tp:
            raise ValueError(f"tp = {self.tp} does not divide the {model.heads} heads of "
                             f"{model.name}")
        if self.vpp > 1 and self.m % self.pp:
            fix = self.m // self.pp * self.pp or self.pp
            raise ValueError(f"interleaved 1F1B needs microbatches divisible by pp: "
                             f"{self.m} % {self.pp} != 0; pass --microbatches {fix}")
        if self.m < self.pp:
            raise ValueError(f"microbatches = {self.m} < pp = {self.pp}: the pipeline never "
                             f"fills; use at least {self.pp}")

    def units_per_chunk(self, model: ModelSpec) -> int:
        """Units per virtual stage."""
        return model.units // (self.pp * self.vpp)

    def chunk_units(self, model: ModelSpec, stage: int, chunk: int) -> List[int]:
        """Unit indices of virtual stage ``chunk * pp + stage``."""
        u = self.units_per_chunk(model)
        v = chunk * self.pp + stage
        return list(range(v * u, (v + 1) * u))

    def stage_units(self, model: ModelSpec, stage: int) -> List[int]:
        """Every unit held by physical stage ``stage`` (all its chunks)."""
        return [i for c in range(self.vpp) for i in self.chunk_units(model, stage, c)]


def stage_static_bytes(model: ModelSpec, layout: Layout, stage: int) -> Dict[str, float]:
    """Resident non-activation bytes of one device of ``stage``.

    bf16 weights (2 B/param) + fp32 gradient accumulation (4 B/param) + fp32 master weights and
    Adam moments (12 B/param) sharded over the data-parallel group (distributed optimizer):
    ``ep * dp`` ranks for replicated parameters, ``dp`` for routed experts.
    """
    kinds = model.unit_kinds()
    h, tp = model.hidden, layout.tp
    dense = expert = 0.0
    for u in layout.stage_units(model, stage):
        k = kinds[u]
        if k in ("dense", "moe", "mtp"):
            dense += model.attn_params() / tp
        if k == "dense":
            dense += 3 * h * model.dense_ffn / tp
        if k in ("moe", "mtp"):
            dense += (model.shared_experts * model.expert_params() + h * model.experts) / tp
            expert += model.experts / layout.ep * model.expert_params() / tp
        if k in ("embed", "head", "mtp") or (not model.embed_units and u in (0, len(kinds) - 1)):
            dense += model.vocab * h / tp
    weights = 6 * (dense + expert)
    optim = 12 * dense / (layout.ep * layout.dp) + 12 * expert / layout.dp
    return {"dense_params": dense, "expert_params": expert, "weights_grads": weights,
            "optimizer": optim, "total": weights + optim}


def ep_alltoall_rate(cluster: ClusterSpec, layout: Layout) -> Tuple[float, float]:
    """(intra-node fraction, inter-node fraction) of an EP all-to-all's bytes.

    Ranks are numbered TP-innermost, then EP: an EP group spans ``ep * tp / devices_per_node``
    nodes; a token leaves the device for each of the other ``ep - 1`` ranks equally.
    """
    ep = layout.ep
    if ep <= 1:
        return 0.0, 0.0
    in_node = max(1, min(ep, cluster.devices_per_node // layout.tp))
    return (in_node - 1) / ep, (ep - in_node) / ep
