"""Entry point for simulating from *measured* per-operator costs instead of the analytic model.

Use it to validate the simulator against a real run: profile the reference model with the
runtime (its :class:`bagualu2.CostModel` fits, per operator key, saved bytes and times as
``a + b * tokens``), hand those per-operator tables to :func:`measured_simulator`, and compare
the predicted step time and peak memory with the measured ones.

Each unit kind gets one table of :class:`MeasuredOp` rows (measured at mean routed load, i.e.
imbalance 1.0). Rows marked ``load_scaled`` (routed-expert ops) scale their bytes and times with
the load; the rest are constant per micro-batch; the ``*_per_load`` fields add a load-scaled
part to any row (a cost-model fit ``a + b * tokens`` at mean tokens ``t`` is ``value=a``,
``per_load=b * t``). Backward time defaults to twice the forward.

```python
from bagualu2.sim.measured import MeasuredOp, measured_simulator, model_from_moe_config
ops = [MeasuredOp("attn", nbytes=..., fwd_s=..., recompute_s=...),
       MeasuredOp("experts.fc1", nbytes=..., fwd_s=..., recompute_s=..., load_scaled=True)]
sim = measured_simulator(model_from_moe_config(cfg, seq=64), {"moe": ops},
                         device_memory=budget_bytes, microbatches=4, mbs=4, seq=64)
result = sim.run(generate_trace(20, 4, cfg.num_layers, ep=1))
```
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Mapping, Optional, Sequence

import numpy as np

from bagualu2.sim.clusters import ClusterSpec
from bagualu2.sim.engine import Simulator
from bagualu2.sim.kinds import KindTable
from bagualu2.sim.layout import Layout
from bagualu2.sim.models import ModelSpec, OpSpec, UnitOps

if TYPE_CHECKING:  # pragma: no cover
    from bagualu2.sim.engine import SimResult

__all__ = ["MeasuredOp", "local_cluster", "measured_kind_table", "measured_simulator",
           "model_from_moe_config", "prediction_error"]


@dataclass(frozen=True)
class MeasuredOp:
    """One operator's measured costs for one micro-batch at mean routed load.

    Attributes:
        name: operator key (the runtime's ``"<module path>:<aten op>:<occurrence>"`` or short).
        nbytes: bytes it saves for backward.
        fwd_s: forward seconds.
        recompute_s: seconds to rebuild its saved tensor in backward.
        bwd_s: backward seconds (``None``: ``2 * fwd_s``).
        load_scaled: True for routed-expert ops (bytes and times scale with the imbalance).
        releasable: False for tensors that must stay (unit inputs).
        flops: model FLOPs (forward + backward) it contributes, for MFU (0 if unknown).
        nbytes_per_load, fwd_s_per_load, recompute_s_per_load: extra parts proportional to
            the load (added to the above, whatever ``load_scaled`` says).
    """

    name: str
    nbytes: float
    fwd_s: float
    recompute_s: float
    bwd_s: Optional[float] = None
    load_scaled: bool = False
    releasable: bool = True
    flops: float = 0.0
    nbytes_per_load: float = 0.0
    fwd_s_per_load: float = 0.0
    recompute_s_per_load: float = 0.0


def measured_kind_table(kind: str, ops: Sequence[MeasuredOp], cluster: ClusterSpec) -> KindTable:
    """A :class:`KindTable` from measured rows (copy times from the cluster's host bandwidth)."""
    if not ops:
        raise ValueError(f"no measured operators for unit kind {kind!r}")
    names = [o.name for o in ops]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate operator names in the measured table of {kind!r}")

    def split(v: float, scaled: bool, extra: float = 0.0) -> tuple:
        return (0.0, float(v) + extra) if scaled else (float(v), float(extra))

    def nb(o: MeasuredOp) -> tuple:
        return split(o.nbytes, o.load_scaled, o.nbytes_per_load)

    def rc(o: MeasuredOp) -> tuple:
        return split(o.recompute_s, o.load_scaled, o.recompute_s_per_load)

    specs, fa, fb, ba, bb = [], 0.0, 0.0, 0.0, 0.0
    for o in ops:
        if min(o.nbytes, o.fwd_s, o.recompute_s, o.nbytes_per_load, o.fwd_s_per_load,
               o.recompute_s_per_load) < 0:
            raise ValueError(f"negative measurement in {o}")
        sa, sb = nb(o)
        specs.append(OpSpec(o.name, "measured", sa, sb, 0.0, 0.0, "measured", o.releasable))
        a, b = split(o.fwd_s, o.load_scaled, o.fwd_s_per_load)
        fa, fb = fa + a, fb + b
        if o.bwd_s is None:
            a, b = 2 * a, 2 * b
        else:
            a, b = split(o.bwd_s, o.load_scaled)
        ba, bb = ba + a, bb + b
    rel = [o for o in ops if o.releasable and sum(nb(o)) > 0]
    fixed = [o for o in ops if o not in rel]

    def arr(vals: list) -> np.ndarray:
        return np.array(vals, dtype=np.float64)

    return KindTable(
        kind=kind, ops=UnitOps(kind, tuple(specs)), fwd_a=fa, fwd_b=fb, bwd_a=ba, bwd_b=bb,
        full_a=sum(nb(o)[0] for o in ops), full_b=sum(nb(o)[1] for o in ops),
        fixed_a=sum(nb(o)[0] for o in fixed), fixed_b=sum(nb(o)[1] for o in fixed),
        flops=sum(o.flops for o in ops), names=[o.name for o in rel],
        nb_a=arr([nb(o)[0] for o in rel]), nb_b=arr([nb(o)[1] for o in rel]),
        rec_a=arr([rc(o)[0] for o in rel]), rec_b=arr([rc(o)[1] for o in rel]),
        off_a=arr([nb(o)[0] / cluster.host_d2h_bw for o in rel]),
        off_b=arr([nb(o)[1] / cluster.host_d2h_bw for o in rel]),
        rel_a=arr([nb(o)[0] / cluster.host_h2d_bw for o in rel]),
        rel_b=arr([nb(o)[1] / cluster.host_h2d_bw for o in rel]),
    )


def local_cluster(device_memory: float, *, copy_bw: float = 10e9, peak_flops: float = 1e12,
                  hbm_bw: float = 20e9) -> ClusterSpec:
    """A one-device "cluster" for validation runs on this machine (CPU: memory = the budget).

    ``peak_flops`` only scales the reported MFU; with measured tables the times come from the
    measurements. ``copy_bw``: the copy engine's measured bandwidth (both directions).
    """
    return ClusterSpec(name="local", device_memory=float(device_memory), peak_flops=peak_flops,
                       hbm_bw=hbm_bw, host_d2h_bw=copy_bw, host_h2d_bw=copy_bw,
                       intra_bw=copy_bw, inter_bw=copy_bw, devices_per_node=1,
                       p2p_latency_s=0.0, workspace=0.0, restart_s=0.0,
                       sources={"*": "local validation run; measured tables supply the costs"})


def model_from_moe_config(cfg: object, *, seq: Optional[int] = None) -> ModelSpec:
    """:class:`ModelSpec` of the reference model (``bagualu2.models.MoEConfig``): every layer a
    MoE unit, embedding and head folded into the first/last layer."""
    g = lambda n, d=0: getattr(cfg, n, d)  # noqa: E731 - tiny accessor
    shared = 1 if g("shared_expert_hidden_size") else 0
    return ModelSpec(name="reference", hidden=g("hidden_size"), layers=g("num_layers"),
                     dense_layers=0, vocab=g("vocab_size"), heads=g("num_heads"),
                     head_dim=g("hidden_size") // g("num_heads"), experts=g("num_experts"),
                     shared_experts=shared, top_k=g("top_k"), expert_ffn=g("expert_hidden_size"),
                     embed_units=False, seq=seq or g("max_seq_len"),
                     source="bagualu2.models.MoEConfig")


def measured_simulator(model: ModelSpec, tables: Mapping[str, Sequence[MeasuredOp]], *,
                       device_memory: float, static_bytes: float = 0.0, pp: int = 1,
                       vpp: int = 1, microbatches: int = 1, mbs: int = 1,
                       seq: Optional[int] = None, copy_bw: float = 10e9,
                       **sim_kwargs: object) -> Simulator:
    """A :class:`Simulator` whose per-unit costs come from measured tables.

    Args:
        model: gives the unit sequence (e.g. :func:`model_from_moe_config`).
        tables: unit kind -> measured rows; every kind of the model needs one.
        device_memory: bytes available (on CPU: the provisioner's byte budget + static_bytes).
        static_bytes: resident non-activation bytes (weights, optimizer) per device.
        copy_bw: measured host copy bandwidth.
    """
    missing = sorted(set(model.unit_kinds()) - set(tables))
    if missing:
        raise ValueError(f"measured tables missing for unit kinds {missing}; "
                         f"{model.name} uses {sorted(set(model.unit_kinds()))}")
    cluster = local_cluster(device_memory, copy_bw=copy_bw)
    layout = Layout(pp=pp, vpp=vpp, microbatches=microbatches, mbs=mbs, seq=seq or model.seq)
    kt = {k: measured_kind_table(k, tables[k], cluster) for k in set(model.unit_kinds())}
    sim = Simulator(model, cluster, layout, kind_tables=kt, **sim_kwargs)  # type: ignore[arg-type]
    sim.static = [float(static_bytes)] * sim.pp
    sim.dp_s = [0.0] * sim.pp
    return sim


def prediction_error(result: "SimResult", policy: str, *, measured_step_s: float,
                     measured_peak_bytes: float) -> Dict[str, float]:
    """Relative errors of a simulation against a real run of the same configuration.

    Args:
        result: :meth:`Simulator.run` output (from :func:`measured_simulator`).
        policy: the policy the real run used (e.g. ``"adaptive"``).
        measured_step_s: mean step time of the real run.
        measured_peak_bytes: peak resident bytes of the real run (the provisioner's accounting
            on CPU, ``torch.cuda.max_memory_allocated`` on a device).

    Returns:
        ``{"predicted_step_s", "step_time_error", "predicted_peak_bytes", "peak_error"}``;
        errors are (predicted - measured) / measured.
    """
    if policy not in result.policies:
        raise ValueError(f"policy {policy!r} was not simulated; have {sorted(result.policies)}")
    if measured_step_s <= 0 or measured_peak_bytes <= 0:
        raise ValueError(f"measurements must be > 0, got step {measured_step_s} s, "
                         f"peak {measured_peak_bytes} bytes")
    r = result.policies[policy]
    step = float(r.summary["mean_step_s"])
    peak = float(r.peak.max())
    return {"predicted_step_s": step, "step_time_error": (step - measured_step_s) / measured_step_s,
            "predicted_peak_bytes": peak,
            "peak_error": (peak - measured_peak_bytes) / measured_peak_bytes}
