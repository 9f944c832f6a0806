"""``bagualu2 selftest``: does this install work on this machine's accelerator? One command.

Runs, on one device, in a few minutes (at most 8 on one GPU), and prints a verdict table,
writes ``selftest.json`` and ``selftest.png`` under ``--out``:

  exact        every policy (keep_all, offload_all, recompute_all, adaptive, a random per-op
               plan) gives bitwise the loss and gradients of plain PyTorch on the reference
               model (bagualu2.models), through routing spikes, in fp32 and bf16 (autocast)
  budget       peak activation memory, measured independently of bagualu2's ledger
               (torch.cuda.max_memory_allocated over each forward), stays within the budget
               through routing spikes where keep_all goes over it
  bandwidth    offload (D2H) and reload (H2D), 64 MiB to 1 GiB, per-copy GPU event times
               against pinned torch copies (Tensor.copy_(non_blocking=True) into pinned
               memory) in the same run; target 95% (the CPU form: `bagualu2 bench offload`'s
               wall-clock table, no target)
  overlap      offloads and reloads on the engine's streams beside matmuls sized to the same
               GPU time; their event intervals must overlap by half the shorter phase
  oom-allocator  the caching allocator's limit (torch.cuda.set_per_process_memory_fraction)
               between recompute_all's and keep_all's needs: the safety net reruns, exact
  oom-driver   the same limit with the rest of the device taken, so cudaMalloc itself fails
  growth       no growth of device memory, pinned memory or the arena over 200 micro-batches
  device>0     a fresh process that sets the last device first: exact, and device 0's primary
               context inactive there (the driver's cuDevicePrimaryCtxGetState); when more
               than one device is present

The device rows are in bagualu2/cli/selftest_device.py, the reference model both run in
bagualu2/cli/selftest_model.py. selftest.json is written before each
row (with the row in progress named) and after it, so a row that aborts the process leaves
the rows before it on disk.
Without an accelerator it runs its CPU form end to end (the cpu backend, the provisioner's
ledger instead of device counters, a smaller model) and marks the device rows "not run".
Exit status: 0 when no row failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from bagualu2.cli.selftest_model import Bench, same

PASS, FAIL, NOT_RUN, INFO = "pass", "FAIL", "not run", "info"
POLICIES = ("keep_all", "offload_all", "recompute_all", "adaptive", "random_plan")
SPIKES = (0.0, 2.6, 0.0, 2.6)  # routing of the exactness micro-batches (2.6x: the measured worst)
MiB = 1 << 20


@dataclass
class Row:
    """One verdict: what was checked, the outcome, one line of why, the numbers behind it."""

    name: str
    verdict: str
    detail: str
    data: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("bagualu2-selftest"),
                   help="folder for selftest.json, selftest.png and the bandwidth files")
    p.add_argument("--cpu", action="store_true", help="run the CPU form even when a GPU is present")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches of the memory-growth row (default 200 on a device, 40 in "
                        "the CPU form, whose steps cost the cores everything else uses)")
    p.add_argument("--max-copy", default=None,
                   help="largest bandwidth size (default 1G on a device, 16M on cpu)")
    p.add_argument("--seed", type=int, default=0)


def _keep_all_peak(bench: Bench, spike: float = 0.0) -> int:
    """The ledger's all-keep activation peak of one micro-batch."""
    import bagualu2

    probe = bench.fresh()
    prov = bagualu2.enable(probe, budget=None, policy="keep_all", min_bytes=0)
    bench.step(probe, 0, spike)
    peak = prov.report()["peak_bytes"]
    prov.disable()
    return int(peak)


def _random_plan(bench: Bench, seed: int) -> Dict[str, Any]:
    """A random KEEP/OFFLOAD/RECOMPUTE choice for every operator the provisioner profiles."""
    import bagualu2

    probe = bench.fresh()
    prov = bagualu2.enable(probe, budget=10**15, min_bytes=0)
    for i in range(prov.profile_frames):
        bench.step(probe, i, 0.0)
    keys = list(prov.cost.order)
    prov.disable()
    rng = random.Random(seed)
    choices = (bagualu2.Choice.KEEP, bagualu2.Choice.OFFLOAD, bagualu2.Choice.RECOMPUTE)
    return {k: rng.choice(choices) for k in keys}


# -- rows ----------------------------------------------------------------------------------------
def check_exact(bench: Bench, gpu: bool) -> Row:
    import bagualu2

    mismatches: List[str] = []
    data: Dict[str, Any] = {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    if gpu:  # atomics-based kernels (index_add on CUDA) differ run to run without this
        torch.use_deterministic_algorithms(True)
    try:
        for dtype in ("fp32", "bf16"):
            plain = bench.fresh()
            refs = [bench.step(plain, i, s, dtype) for i, s in enumerate(SPIKES)]
            budget = int(_keep_all_peak(bench) * 0.6)
            plan = _random_plan(bench, bench.seed)
            for policy in POLICIES:
                model = bench.fresh()
                kind = plan if policy == "random_plan" else policy
                prov = bagualu2.enable(model, budget=budget if policy == "adaptive" else None,
                                       policy=kind, min_bytes=0)
                ok = all(same(refs[i], bench.step(model, i, s, dtype)) for i, s in enumerate(SPIKES))
                mix = prov.report()["saved_bytes_by_choice"]
                prov.disable()
                data[f"{policy}/{dtype}"] = {"bit_exact": ok, "saved_bytes_by_choice": dict(mix)}
                if not ok:
                    mismatches.append(f"{policy}/{dtype}")
    finally:
        torch.use_deterministic_algorithms(deterministic)
    runs = len(POLICIES) * 2
    if mismatches:
        return Row("exact", FAIL, f"not bitwise equal to plain PyTorch: {', '.join(mismatches)}", data)
    return Row("exact", PASS, f"{runs} runs (5 policies x fp32/bf16, {len(SPIKES)} micro-batches "
                              f"with spikes) bitwise equal to plain PyTorch", data)


def check_budget(bench: Bench, gpu: bool) -> Row:
    """Adaptive under a budget of 70% of the calm all-keep peak, against keep_all, through
    spikes. On a device the peak is read from the caching allocator over each forward (where
    saved activations peak), and keep_all's excess over its own ledger on the same micro-batch
    is the allowance for transients that are not saved activations."""
    import bagualu2

    budget = int(_keep_all_peak(bench) * 0.7)
    trace = [0.0, 0.0, 2.6, 0.0, 2.6, 2.6, 0.0, 0.0]
    measured: Dict[str, List[Dict[str, int]]] = {}
    for policy in ("keep_all", "adaptive"):
        model = bench.fresh()
        prov = bagualu2.enable(model, budget=budget, policy=policy, min_bytes=0)
        rows = []
        with warnings.catch_warnings():
            if policy == "keep_all":  # the comparison that crosses the budget on purpose, not a finding
                warnings.filterwarnings("ignore", message="bagualu2: micro-batch .* went over")
            for i, spike in enumerate(trace):
                box: Dict[str, int] = {}
                if gpu:
                    torch.cuda.synchronize(bench.device)
                    model.zero_grad(set_to_none=True)
                    base = torch.cuda.memory_allocated(bench.device)
                    torch.cuda.reset_peak_memory_stats(bench.device)

                    def forward_peak() -> None:
                        torch.cuda.synchronize(bench.device)
                        box["device"] = torch.cuda.max_memory_allocated(bench.device) - base
                bench.step(model, i, spike, after_forward=forward_peak if gpu else None)
                mb = prov.telemetry.micro_batches[-1]
                rows.append({"spike": spike, "ledger": int(mb.peak_bytes), **box})
        measured[policy] = rows
        prov.disable()
    keep, adapt = measured["keep_all"], measured["adaptive"]
    keep_max = max(r["ledger"] for r in keep)
    data = {"budget_bytes": budget, "micro_batches": measured}
    over = [i for i, r in enumerate(adapt) if r["ledger"] > budget]
    if gpu:
        allowance = [max(0, k["device"] - k["ledger"]) for k in keep]
        data["transient_allowance_bytes"] = allowance
        over = [i for i, (r, a) in enumerate(zip(adapt, allowance)) if r["device"] > budget + a]
        keep_dev = max(k["device"] for k in keep)
        adapt_dev = max(r["device"] - a for r, a in zip(adapt, allowance))
        summary = (f"adaptive device peak {adapt_dev / MiB:.1f} MiB (less transients) vs budget "
                   f"{budget / MiB:.1f} MiB; keep_all reaches {keep_dev / MiB:.1f} MiB")
    else:
        adapt_max = max(r["ledger"] for r in adapt)
        summary = (f"adaptive ledger peak {adapt_max / MiB:.2f} MiB vs budget {budget / MiB:.2f} MiB; "
                   f"keep_all reaches {keep_max / MiB:.2f} MiB (device counters: not run)")
    if over:
        return Row("budget", FAIL, f"over budget at micro-batches {over}: {summary}", data)
    return Row("budget", PASS, summary, data)


def check_bandwidth(out: Path, gpu: bool, max_copy: Optional[str]) -> Row:
    if gpu:
        from bagualu2.cli.selftest_device import measure_bandwidth

        data = measure_bandwidth(torch.device("cuda", torch.cuda.current_device()), max_copy)
        table = data["rows"]
    else:
        data, table = _cpu_bandwidth(out, max_copy)
    worst = min(table, key=lambda t: t["ratio"])
    line = (f"engine / pinned torch copy >= {worst['ratio']:.2f} at {table[0]['bytes'] // MiB} MiB+ "
            f"(worst: {worst['direction']} {worst['bytes'] // MiB} MiB, {worst['engine_GBps']:.1f} "
            f"vs {worst['torch_pinned_GBps']:.1f} GB/s)")
    if not gpu:
        return Row("bandwidth", INFO, line + "; cpu: worker-thread copies, no DMA, no target", data)
    ok = worst["ratio"] >= data["target_ratio"] and all(t["exact"] for t in table)
    return Row("bandwidth", PASS if ok else FAIL, line + f" ({data['timing']})", data)


def _cpu_bandwidth(out: Path, max_copy: Optional[str]) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    from bagualu2.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--min-size", "1M", "--max-size", max_copy or "16M", "--step", "4", "--quiet",
            "--no-plot", "--backend", "auto", "--out", str(out / "bandwidth"), "--min-time", "0.005",
            "--min-iters", "2", "--max-iters", "8", "--passes", "1"]
    bench.run(parser.parse_args(argv))
    result = json.loads((out / "bandwidth.json").read_text())
    table = []
    for r in result["results"]:
        for d in ("d2h", "h2d"):
            eng, ref = r[d]["engine"]["GBps"], r[d]["torch_pinned"]["GBps"]
            table.append({"bytes": r["bytes"], "direction": d, "engine_GBps": eng,
                          "torch_pinned_GBps": ref, "ratio": eng / ref})
    return {"rows": table, "timing": "wall clock"}, table


def check_overlap(device: torch.device) -> Row:
    from bagualu2.cli.selftest_device import check_overlap as measure

    ok, line, data = measure(device)
    return Row("overlap", PASS if ok else FAIL, line, data)


def check_other_device(seed: int) -> Row:
    from bagualu2.cli.selftest_device import check_other_device as probe

    ok, line, data = probe(seed)
    return Row("device>0", PASS if ok else FAIL, line, data)


def check_oom(bench: Bench, driver: bool) -> Row:
    """A memory limit between what recompute_all needs and what keep_all's forward needs: the
    all-keep attempt runs out of memory, the safety net reruns the micro-batch releasing what it
    can, and the result is exact. The limit is the caching allocator's (driver=False:
    set_per_process_memory_fraction), or the device's own (driver=True: one tensor takes the
    rest, so cudaMalloc fails in the driver)."""
    import bagualu2
    from bagualu2.cli.selftest_device import take_device_memory

    name = "oom-driver" if driver else "oom-allocator"

    device = bench.device
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref = bench.step(bench.fresh(), 0, 2.6)

        def peaks(policy: str) -> Tuple[int, int]:
            model = bench.fresh()
            prov = bagualu2.enable(model, budget=None, policy=policy, min_bytes=0)
            box: Dict[str, int] = {}
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

            def fwd() -> None:
                box["forward"] = torch.cuda.max_memory_reserved(device)
                torch.cuda.reset_peak_memory_stats(device)
            bench.step(model, 0, 2.6, after_forward=fwd)
            box["backward"] = torch.cuda.max_memory_reserved(device)
            prov.disable()
            del model
            return box["forward"], box["backward"]

        keep_fwd, _ = peaks("keep_all")
        rc_fwd, rc_bwd = peaks("recompute_all")
        need = max(rc_fwd, rc_bwd)
        data = {"keep_all_forward_reserved": keep_fwd, "recompute_all_reserved": need}
        if need >= keep_fwd * 0.95:
            return Row(name, FAIL, f"no limit separates recompute_all ({need / MiB:.0f} MiB) from "
                                    f"keep_all's forward ({keep_fwd / MiB:.0f} MiB) on this model", data)
        limit = (need + keep_fwd) // 2
        total = torch.cuda.get_device_properties(device).total_memory
        model = bench.fresh()
        prov = bagualu2.enable(model, budget=None, policy="adaptive", min_bytes=0)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        blocker = None
        if driver:
            blocker = take_device_memory(device, limit - torch.cuda.memory_reserved(device))
            if blocker is None:
                return Row(name, FAIL, f"less than {limit / MiB:.0f} MiB free on the device", data)
        else:
            torch.cuda.set_per_process_memory_fraction(limit / total, device)
        try:
            got = bench.step(model, 0, 2.6)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            del blocker
            torch.cuda.empty_cache()
        report = prov.report()
        prov.disable()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    data.update(limit_bytes=limit, oom_recoveries=report["oom_recoveries"])
    exact = same(ref, got)
    line = (f"{'device' if driver else 'allocator'} limit {limit / MiB:.0f} MiB (keep_all forward "
            f"needs {keep_fwd / MiB:.0f}): {report['oom_recoveries']} OOM caught and rerun, "
            f"{'exact' if exact else 'NOT exact'}")
    return Row(name, PASS if exact and report["oom_recoveries"] >= 1 else FAIL, line, data)


def check_growth(bench: Bench, gpu: bool, micro_batches: int) -> Row:
    """Adaptive training (SGD) through spikes for many micro-batches: after warm-up, device
    memory, pinned memory (torch's and the arena's) and the arena's use stay flat."""
    import bagualu2

    model = bench.fresh()
    budget = int(_keep_all_peak(bench) * 0.7)
    prov = bagualu2.enable(model, budget=budget, min_bytes=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    arena = prov.engine.arena if prov.engine is not None else None
    series: Dict[str, List[int]] = {k: [] for k in ("device", "host_pinned", "arena_capacity",
                                                     "arena_in_use", "rss_kib")}
    for i in range(micro_batches):
        bench.step(model, i, 2.6 if i % 10 == 7 else 0.0)
        opt.step()
        model.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize(bench.device)
            series["device"].append(torch.cuda.memory_allocated(bench.device))
            stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
            series["host_pinned"].append(int(stats.get("allocated_bytes.current", 0)))
        series["arena_capacity"].append(arena.capacity if arena else 0)
        series["arena_in_use"].append(arena.stats()["in_use"] if arena else 0)
        series["rss_kib"].append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    report = prov.report()
    prov.disable()
    warm = min(20, micro_batches // 2)
    grown = {k: v[-1] - v[warm] for k, v in series.items() if v and k != "rss_kib"}
    bad = {k: g for k, g in grown.items() if g > (MiB if k == "device" else 0)}
    if series["arena_in_use"] and series["arena_in_use"][-1] != 0:
        bad["arena_in_use_at_end"] = series["arena_in_use"][-1]
    data = {"series": series, "growth_after_warmup": grown, "violations": report["violations"]}
    what = "device, pinned, arena" if gpu else "arena, ledger (device counters: not run)"
    if bad or report["resident_bytes"]:
        return Row("growth", FAIL, f"grew over {micro_batches} micro-batches: {bad}", data)
    return Row("growth", PASS, f"{what} flat over {micro_batches} micro-batches after {warm} of "
                               f"warm-up; arena in use back to 0", data)


# -- the command ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from bagualu2.offload import torch_gpu_backend

    gpu = torch_gpu_backend() is not None and not args.cpu
    if gpu:  # deterministic cuBLAS for the exactness rows; must precede cuBLAS's first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.micro_batches is None:
        args.micro_batches = 200 if gpu else 40
    if args.micro_batches < 40:
        raise SystemExit(f"--micro-batches {args.micro_batches}: use at least 40")
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    print(f"bagualu2 selftest on {env['device_name']} ({'device' if gpu else 'CPU'} form), torch "
          f"{env['torch']}, backends {env['backend_status_line']}")
    bench = Bench(device, gpu, args.seed, (8, 128) if gpu else (2, 32))
    rows: List[Row] = []
    steps: List[Tuple[str, Callable[[], Row]]] = [
        ("exact", lambda: check_exact(bench, gpu)),
        ("budget", lambda: check_budget(bench, gpu)),
        ("bandwidth", lambda: check_bandwidth(args.out, gpu, args.max_copy)),
        ("overlap", (lambda: check_overlap(device)) if gpu else None),
        ("oom-allocator", (lambda: check_oom(Bench(device, True, args.seed, (32, 128)), False))
         if gpu else None),
        ("oom-driver", (lambda: check_oom(Bench(device, True, args.seed, (32, 128)), True))
         if gpu else None),
        ("growth", lambda: check_growth(bench, gpu, args.micro_batches)),
        ("device>0", (lambda: check_other_device(args.seed))
         if gpu and torch.cuda.device_count() > 1 else None),
    ]
    for name, fn in steps:
        if fn is None:
            why = "no accelerator: device row" if not gpu else "one device only"
            rows.append(Row(name, NOT_RUN, why))
            continue
        _write_json(args.out, env, gpu, rows, running=name)  # on disk if this row aborts
        start = time.perf_counter()
        try:
            row = fn()
        except Exception as e:  # a row that crashes is a failed row; the others still run
            row = Row(name, FAIL, f"{type(e).__name__}: {e}"[:400])
        row.seconds = time.perf_counter() - start
        rows.append(row)
        print(f"  {row.name:<10} {row.verdict:<8} {row.seconds:6.1f}s  {row.detail}", flush=True)
    _print_table(rows)
    failed = _write_json(args.out, env, gpu, rows, running=None)
    png = _plot(rows, args.out / "selftest.png")
    print(f"wrote {args.out / 'selftest.json'} and {png}")
    if not gpu:
        print("device rows were not run: no accelerator torch can use "
              f"({env['backend_status_line']})")
    return 1 if failed else 0


def _write_json(out: Path, env: Dict[str, Any], gpu: bool, rows: List[Row],
                running: Optional[str]) -> List[str]:
    """selftest.json with the rows so far (and the one running, if any); the failed rows."""
    import bagualu2

    failed = [r.name for r in rows if r.verdict == FAIL]
    doc = {"environment": env, "form": "device" if gpu else "cpu", "rows": [asdict(r) for r in rows],
           "failed": failed, "running": running, "version": bagualu2.__version__}
    tmp = out / "selftest.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(out / "selftest.json")
    return failed


def environment(device: torch.device) -> Dict[str, Any]:
    """What ``selftest.json`` records of this machine (torch and python versions, cpus, the
    device's name) and which offload backends are compiled and usable on it
    (``backend_status``, and ``backend_status_line``: one line for the report)."""
    import bagualu2

    status = bagualu2.backend_status()
    env: Dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "backend_status": status,
        "backend_status_line": ", ".join(f"{k}: {'usable' if v['usable'] else 'compiled, not usable' if v['compiled'] else 'not compiled'}"
                                         for k, v in status.items()),
        "device_name": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["device_count"] = torch.cuda.device_count()
    return env


def _print_table(rows: List[Row]) -> None:
    print(f"\n{'check':<10} {'verdict':<8} {'time':>7}  detail")
    for r in rows:
        print(f"{r.name:<10} {r.verdict:<8} {r.seconds:6.1f}s  {r.detail}")


def _plot(rows: List[Row], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r.name: r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    bw = by.get("bandwidth")
    if bw is not None and bw.data.get("rows"):
        for d, style in (("d2h", "-"), ("h2d", "--")):
            pts = [t for t in bw.data["rows"] if t["direction"] == d]
            ax.plot([t["bytes"] / MiB for t in pts], [t["engine_GBps"] for t in pts], "o" + style,
                    label=f"bagualu2 {d}")
            ax.plot([t["bytes"] / MiB for t in pts], [t["torch_pinned_GBps"] for t in pts], "x" + style,
                    label=f"pinned torch {d}")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    ax.set(title="offload bandwidth", xlabel="MiB per copy", ylabel="GB/s")
    ax = axes[1]
    budget = by.get("budget")
    if budget is not None and budget.data.get("micro_batches"):
        key = "device" if "device" in budget.data["micro_batches"]["adaptive"][0] else "ledger"
        for policy, mbs in budget.data["micro_batches"].items():
            ax.plot([m[key] / MiB for m in mbs], "o-", label=policy)
        ax.axhline(budget.data["budget_bytes"] / MiB, color="red", linestyle=":", label="budget")
        ax.legend(fontsize=8)
        ax.set(title=f"activation peak per micro-batch ({key})", xlabel="micro-batch", ylabel="MiB")
    ax = axes[2]
    growth = by.get("growth")
    if growth is not None and growth.data.get("series"):
        for k in ("device", "arena_capacity", "arena_in_use"):
            v = growth.data["series"].get(k)
            if v:
                ax.plot([x / MiB for x in v], label=k)
        ax.legend(fontsize=8)
        ax.set(title="memory over micro-batches", xlabel="micro-batch", ylabel="MiB")
    verdicts = "  ".join(f"{r.name}: {r.verdict}" for r in rows)
    fig.suptitle(f"bagualu2 selftest - {verdicts}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
