"""What a training script calls: ``enable`` (provision a model; returns its ``Provisioner``) and
``on_gating`` (report a MoE layer's routing from inside its forward, for gates that are not
modules). How a provisioner decides is ``bagualu2.provisioner``'s note.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence, Union

import torch

from bagualu2.inputs import checked_counts
from bagualu2.plan.planner import Choice
from bagualu2.provision.forward import active
from bagualu2.provisioner import Provisioner
from bagualu2.runtime import is_recomputing
from bagualu2.runtime.gates import describe_unsupported

__all__ = ["enable", "on_gating"]


def enable(model: torch.nn.Module, budget: Union[str, int, float, None] = "auto",
           policy: Union[str, Mapping[str, Choice]] = "adaptive", **options: Any) -> Provisioner:
    """Provision ``model``'s saved activations under ``budget``; the training loop is unchanged.

    Args:
        model: the module whose ``forward`` is one micro-batch (a whole model or a pipeline
            stage; for a ``torch.compile`` wrapper, the module it wraps). Its MoE gates are
            found automatically (see ``bagualu2.runtime.gates.find_gates``); register others with
            ``Provisioner.register_gate`` or report loads with ``bagualu2.on_gating``.
        budget: ``"auto"`` (device memory minus what is resident now minus ``reserve_bytes``;
            no limit on CPU), an int of bytes, or a float fraction of device memory.
        policy: ``"adaptive"`` (decide per micro-batch at gating), or a static baseline through
            the same machinery: ``"keep_all"``, ``"recompute_all"`` (all but what the model
            saves after its last block, which backward reads first), ``"offload_all"``, or a
            fixed mapping of operator keys to ``Choice``.
        **options: ``on_exceed`` (``"record"`` or ``"raise"``: raise ``BudgetExceededError``
            when the budget is crossed), ``min_bytes`` (smaller activations are kept, unless
            the budget leaves no room for one),
            ``arena_bytes`` (pinned host memory reserved at enable; by default 64 MiB, and
            once the profiled micro-batches show how large activations get, what offloading
            them may need, up to 8 GiB), ``arena_max_bytes`` (what the arena may grow to when
            offloads need more; default half of this process's share of host memory),
            ``reserve_bytes``, ``profile_frames``, ``calibrate_frames`` (adaptive micro-batches
            that recompute all they can once profiled, to measure what replays cost before a
            plan relies on it: the first under a budget their worst routing would not fit;
            default 3, the first of which runs cold), ``recalibrate_every`` (one more such
            micro-batch after every that many that may have to release, every other one of
            them offloading all it can instead when there is a copy engine, to measure what
            copies cost, and every other one that recomputes recomputing half of it, to
            measure rebuilds at two sizes; default 0, never),
            ``allocator`` (a view of the allocator: ``"cuda"`` for ``torch.cuda``'s counters of the
            model's device, or a callable returning ``(bytes allocated now, peak bytes since its
            last call)``; the budget is then on the whole memory it counts, and each micro-batch's
            activations get the budget less what it learned lies outside them at the peak, at
            that micro-batch's routing; default None: the budget is on the activations alone),
            ``verify`` (the exactness check of what is released, ``bagualu2.runtime.verify``:
            ``"off"``, ``"sample"`` (one released save in 32 fingerprinted as it is saved and
            compared when backward gets it back) or ``"all"``; default ``"off"``, or what the
            ``BAGUALU2_VERIFY`` environment variable says), ``on_mismatch`` (``"raise"``:
            ``bagualu2.ExactnessError``; ``"fallback"``: counted in ``report()["verify"]`` and
            that operator kept from then on),
            ``releases`` (how an adaptive micro-batch that is not calm releases:
            ``"reruns"``, the default, reruns whole blocks in backward, untraced, where the
            model has blocks a rerun may repeat and whose rerun fits, offloads what they leave,
            and plans operator by operator elsewhere (pipeline schedules, compiled regions): a
            block's forward must then run the same way in backward, as under
            ``torch.utils.checkpoint`` (``verify="sample"`` checks it); ``"operators"`` traces
            every such micro-batch and plans operator by operator, replaying recorded ops, for a
            model that changes its modules' state between forward and backward),
            ``margin``, ``telemetry_path`` (JSON lines), ``gates`` (a list of
            ``bagualu2.runtime.gates.GateSpec`` instead of discovery; ``[]`` when the model reports its
            routing through ``bagualu2.on_gating``).

    Returns:
        The ``Provisioner``: ``report()``, ``plot(path)``, ``disable()``.
    """
    prov = Provisioner(model, budget, policy, **options)
    if not prov.gates and policy == "adaptive" and options.get("gates") is None:
        warnings.warn(
            "bagualu2.enable: no MoE gate found, so decisions are made only by the budget check at "
            "each save. " + describe_unsupported(model), stacklevel=2,
        )
    return prov


def on_gating(tokens_per_expert: Union[torch.Tensor, Sequence[int]], layer: int) -> None:
    """Report a MoE layer's routing from inside its forward (for gates that are not modules).

    Call it after routing and before the experts run. Outside a provisioned forward, and
    during recomputation, it does nothing.
    """
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise TypeError(f"on_gating(layer={layer!r}): layer must be the MoE layer's index, an int >= 0")
    running = active()
    if not running or is_recomputing():
        return
    # The innermost provisioner of this thread whose forward runs (one an interrupt left on the
    # stack has none).
    prov = next((p for p in reversed(running) if p.runtime.active_frame is not None), None)
    if prov is None:
        return
    spec = next((g for g in prov.gates if g.layer == layer), None)
    values = checked_counts(tokens_per_expert, f"on_gating(layer={layer})", spec.num_experts if spec else None)
    with prov.runtime.residency.untraced(), torch.no_grad():
        prov.on_gate(layer, values)
