"""Unit kinds as linear tables: what one unit of a kind costs at load ``f``.

``build_kind_table`` turns the analytic op model (``models.unit_ops``) and a cluster into a
``KindTable``: forward and backward seconds, saved bytes, and per releasable op the bytes and
the seconds to recompute, offload and reload it. Every figure is ``a + b * f`` in the load of
the unit, which is what lets the engine evaluate a block of steps as numpy vectors and solve
each (kind, load bucket) once. Times are seconds and bytes are bytes, per micro-batch on one
device; a table never depends on the policy being simulated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from bagualu2.sim.clusters import ClusterSpec
from bagualu2.sim.layout import Layout, ep_alltoall_rate
from bagualu2.sim.models import ModelSpec, UnitOps, unit_ops

__all__ = ["KindTable", "build_kind_table"]


@dataclass
class KindTable:
    """Everything about one unit kind that scales linearly with the load ``f``.

    Scalars ``*_a`` / ``*_b`` mean ``value(f) = a + b * f``; arrays are per releasable op.
    Times in seconds, bytes in bytes, per micro-batch on one device.
    """

    kind: str
    ops: UnitOps
    fwd_a: float
    fwd_b: float
    bwd_a: float
    bwd_b: float
    full_a: float
    full_b: float
    fixed_a: float
    fixed_b: float
    flops: float  # model FLOPs (forward + backward) of one micro-batch at load 1
    names: List[str] = field(default_factory=list)
    nb_a: np.ndarray = field(default_factory=lambda: np.zeros(0))
    nb_b: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rec_a: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rec_b: np.ndarray = field(default_factory=lambda: np.zeros(0))
    off_a: np.ndarray = field(default_factory=lambda: np.zeros(0))
    off_b: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rel_a: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rel_b: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def full(self, f):  # noqa: ANN001, ANN201 - scalar or array
        """Saved bytes with everything kept."""
        return self.full_a + self.full_b * f

    def fwd(self, f):  # noqa: ANN001, ANN201
        """Forward seconds."""
        return self.fwd_a + self.fwd_b * f

    def bwd(self, f):  # noqa: ANN001, ANN201
        """Backward seconds (without recompute or exposed copies)."""
        return self.bwd_a + self.bwd_b * f

    def candidates(self, f: float, Candidate) -> list:  # noqa: ANN001
        """The planner's candidates at load ``f`` (op name as key)."""
        return [Candidate(key=n, nbytes=int(math.ceil(self.nb_a[i] + self.nb_b[i] * f)),
                          recompute_s=float(self.rec_a[i] + self.rec_b[i] * f),
                          offload_s=float(self.off_a[i] + self.off_b[i] * f),
                          reload_s=float(self.rel_a[i] + self.rel_b[i] * f),
                          can_offload=True, can_recompute=True)
                for i, n in enumerate(self.names)]


def build_kind_table(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
                     kind: str) -> KindTable:
    """Linear-in-load costs of one unit kind from the analytic op model and the cluster."""
    ops = unit_ops(model, kind, layout.mbs, layout.seq, layout.tp)
    fi, fo = ep_alltoall_rate(cluster, layout)
    net_s_per_byte = max(fi / cluster.intra_bw, fo / cluster.inter_bw) / cluster.network_efficiency
    fwd_t: Dict[str, Tuple[float, float]] = {}
    bwd_t: Dict[str, Tuple[float, float]] = {}
    flops = 0.0
    for o in ops.ops:
        if o.op_class == "network":
            a, b = o.work_fixed * net_s_per_byte, o.work_per_load * net_s_per_byte
            ratio = 1.0
        else:
            rate = cluster.op_rate(o.op_class)
            a, b = o.work_fixed / rate, o.work_per_load / rate
            ratio = (cluster.attention_backward_ratio if o.op_class == "attention"
                     else cluster.backward_ratio)
            if o.op_class in ("matmul", "attention"):
                flops += 3 * (o.work_fixed + o.work_per_load)
        fwd_t[o.name] = (a, b)
        bwd_t[o.name] = (a * ratio, b * ratio)
    tp_s = 0.0
    if layout.tp > 1 and kind in ("dense", "moe", "mtp"):
        full_tokens = layout.mbs * layout.seq
        tp_s = 4 * (layout.tp - 1) / layout.tp * full_tokens * model.hidden * 2 / (
            cluster.intra_bw * cluster.network_efficiency)
    fwd_a = sum(v[0] for v in fwd_t.values()) + tp_s
    fwd_b = sum(v[1] for v in fwd_t.values())
    bwd_a = sum(v[0] for v in bwd_t.values()) + tp_s
    bwd_b = sum(v[1] for v in bwd_t.values())
    rel = [o for o in ops.ops if o.releasable and (o.saved_fixed + o.saved_per_load) > 0]
    fixed = [o for o in ops.ops if o not in rel]
    t = KindTable(
        kind=kind, ops=ops, fwd_a=fwd_a, fwd_b=fwd_b, bwd_a=bwd_a, bwd_b=bwd_b,
        full_a=sum(o.saved_fixed for o in ops.ops), full_b=sum(o.saved_per_load for o in ops.ops),
        fixed_a=sum(o.saved_fixed for o in fixed), fixed_b=sum(o.saved_per_load for o in fixed),
        flops=flops, names=[o.name for o in rel],
        nb_a=np.array([o.saved_fixed for o in rel]), nb_b=np.array([o.saved_per_load for o in rel]),
        rec_a=np.array([fwd_t[o.regen][0] for o in rel]),
        rec_b=np.array([fwd_t[o.regen][1] for o in rel]),
        off_a=np.array([o.saved_fixed / cluster.host_d2h_bw for o in rel]),
        off_b=np.array([o.saved_per_load / cluster.host_d2h_bw for o in rel]),
        rel_a=np.array([o.saved_fixed / cluster.host_h2d_bw for o in rel]),
        rel_b=np.array([o.saved_per_load / cluster.host_h2d_bw for o in rel]),
    )
    return t
