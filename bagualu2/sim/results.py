"""Tables, JSON and plots of simulation results."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

from bagualu2.sim.engine import SimResult

__all__ = ["format_table", "plot_memory_timeline", "plot_scaling", "to_json", "write_outputs"]

_COLS = [("policy", "policy", "{:<17s}"), ("tokens_per_s", "tokens/s", "{:>12,.0f}"),
         ("eflops", "EFLOP/s", "{:>8.3f}"), ("mfu", "MFU", "{:>6.1%}"),
         ("calm_mfu", "calm MFU", "{:>8.1%}"), ("oom_count", "OOMs", "{:>5d}"),
         ("lost_s", "lost s", "{:>9,.0f}"), ("peak_gib", "peak GiB", "{:>8.1f}"),
         ("vs_recompute", "x recomp", "{:>8.3f}"), ("vs_static", "x static", "{:>8.3f}")]


def _ratios(result: SimResult) -> Dict[str, Dict[str, float]]:
    base = {k: result.policies[k].summary["tokens_per_s"]
            for k in ("recompute_all", "static") if k in result.policies}
    out = {}
    for p, r in result.policies.items():
        t = r.summary["tokens_per_s"]
        out[p] = {f"vs_{k.split('_')[0]}": (t / b if b else float("nan")) for k, b in base.items()}
    return out


def format_table(result: SimResult) -> str:
    """Fixed-width table, one row per policy, plus a header line with the scenario."""
    lay = result.layout
    head = (f"{result.model} on {result.cluster}: tp={lay['tp']} pp={lay['pp']} vpp={lay['vpp']} "
            f"ep={lay['ep']} dp={lay['dp']} = {lay['world']:,} accelerators, "
            f"{lay['microbatches']} micro-batches x {lay['mbs']} x {lay['seq']} tokens, "
            f"{result.steps} steps; trace spike rate {result.trace['spike_rate']:.1%}, "
            f"max imbalance {result.trace['max_imbalance']:.2f}x; device "
            f"{result.device_memory / 2**30:.0f} GiB")
    ratios = _ratios(result)
    widths = [17 if k == "policy" else len(f.format(0 if f.endswith("d}") else 0.0))
              for k, _, f in _COLS]
    lines = [head, "  ".join(h.ljust(w) if k == "policy" else h.rjust(w)
                             for (k, h, _), w in zip(_COLS, widths))]
    for p, r in result.policies.items():
        row = {"policy": p, **r.summary, **ratios[p]}
        cells = []
        for (k, _, f), w in zip(_COLS, widths):
            v = row.get(k, float("nan"))
            cells.append("n/a".rjust(w) if isinstance(v, float) and math.isnan(v) else f.format(v))
        lines.append("  ".join(cells))
    lines.append(f"peak GiB per stage (device memory {result.device_memory / 2**30:.0f} GiB):")
    for p, r in result.policies.items():
        lines.append(f"  {p:<17s} " + " ".join(f"{x / 2**30:5.1f}" for x in r.peak.max(axis=1)))
    return "\n".join(lines)


def to_json(result: SimResult) -> Dict[str, object]:
    """Everything needed to reproduce the table and plots, JSON-serializable."""
    ratios = _ratios(result)

    def clean(v: object) -> object:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return {
        "model": result.model, "cluster": result.cluster, "layout": result.layout,
        "steps": result.steps, "trace": {k: clean(v) for k, v in result.trace.items()},
        "device_memory": result.device_memory, "static_bytes": result.static_bytes,
        "workspace_bytes": result.workspace,
        "activation_budget": result.budget, "showcase_step": result.showcase_step,
        "showcase_stage": result.showcase_stage, "wall_s": result.wall_s,
        "policies": {
            p: {**{k: clean(v) for k, v in r.summary.items()},
                **{k: clean(v) for k, v in ratios[p].items()},
                "plan_mix": r.mix,
                "peak_bytes_per_stage": [float(x) for x in r.peak.max(axis=1)],
                "memory_timeline": r.timeline.get(str(result.showcase_stage), [])}
            for p, r in result.policies.items()},
    }


def plot_memory_timeline(result: SimResult, path: Union[str, Path]) -> None:
    """Device memory of the most loaded stage through the showcase step, per policy, vs limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.showcase_stage
    base = result.static_bytes[s] + result.workspace
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = ["-", "-", "--", "-.", ":"]
    for i, (p, r) in enumerate(result.policies.items()):
        line = r.timeline.get(str(s), [])
        if line:
            ax.plot(range(len(line)), [(base + x) / 2**30 for x in line], label=p, lw=1.4,
                    ls=styles[i % len(styles)])
    ax.axhline(result.device_memory / 2**30, color="k", ls="--", lw=1, label="device memory")
    ax.set_xlabel(f"schedule position on stage {s} (forward / backward events)")
    ax.set_ylabel("GiB (weights, optimizer, workspace, activations)")
    ax.set_title(f"{result.model} on {result.cluster}: step {result.showcase_step}, stage {s}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(rows: Sequence[Mapping[str, object]], path: Union[str, Path],
                 metric: str = "tokens_per_s", title: Optional[str] = None) -> None:
    """Throughput by policy across cluster sizes (``rows``: world, policy, metric)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    policies: List[str] = []
    for r in rows:
        if r["policy"] not in policies:
            policies.append(str(r["policy"]))
    for p in policies:
        pts = sorted((int(r["world"]), float(r[metric])) for r in rows if r["policy"] == p)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("accelerators")
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(title or f"{metric} by policy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: SimResult, out: Union[str, Path]) -> List[Path]:
    """``result.json``, ``table.txt`` and ``memory_timeline.png`` under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "result.json", out / "table.txt", out / "memory_timeline.png"]
    paths[0].write_text(json.dumps(to_json(result), indent=1))
    paths[1].write_text(format_table(result) + "\n")
    plot_memory_timeline(result, paths[2])
    return paths
