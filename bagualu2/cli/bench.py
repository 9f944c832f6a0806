"""Offload bandwidth: bagualu2's CopyEngine against torch's own paths and a plain memcpy.

`bagualu2 bench offload` and `benchmarks/offload_bandwidth.py` both run this. For every size
from --min-size to --max-size (powers of --step) and both directions it measures, in one run:

  engine        CopyEngine.offload + wait (D2H), CopyEngine.reload into a preallocated tensor (H2D)
  torch_pinned  Tensor.copy_(src, non_blocking=True) into a pinned host tensor (plain host
                tensor on cpu-only torch, where pinning needs an accelerator) and back
  save_on_cpu   torch.autograd.graph.save_on_cpu pack / unpack hooks (on cpu tensors torch
                skips the copy entirely, so there it is reported but not a baseline)
  memcpy        one single-threaded ctypes.memmove between host buffers: the hardware reference
  hip_memcpy    hipMemcpyAsync through hip-python, when installed and running on ROCm

Each figure is the median over repeated batches: a batch issues up to 64 copies of one source
into distinct destinations back to back (32 MiB per batch for small sizes, one copy at 32 MiB
and above) and waits once, for every method alike. The methods of one size take turns in
blocks over several passes (--passes), so drift in the machine's load affects them alike
while each block runs undisturbed by the others' threads. Output: a
table with the engine's ratio to the best baseline, a JSON file and a PNG plot.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

BASELINES = ("torch_pinned", "save_on_cpu", "memcpy", "hip_memcpy")


def parse_size(text: str) -> int:
    """'64K', '1M', '1G', '4096' -> bytes."""
    t = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], 1)
    return int(float(t[:-1] if mult != 1 else t) * mult)


def human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-size", type=parse_size, default=64 * KiB, help="smallest copy (default 64K)")
    parser.add_argument("--max-size", type=parse_size, default=1 * GiB, help="largest copy (default 1G)")
    parser.add_argument("--step", type=int, default=4, help="size multiplier between points, >= 2 (default 4)")
    parser.add_argument("--backend", default="auto", help="auto|cpu|cuda|hip (default auto)")
    parser.add_argument("--min-time", type=float, default=0.2,
                        help="seconds of copying per method and size, at least --min-iters batches per pass")
    parser.add_argument("--min-iters", type=int, default=3, help="fewest batches per method, size and pass")
    parser.add_argument("--max-iters", type=int, default=200, help="most batches per method, size and pass")
    parser.add_argument("--passes", type=int, default=3,
                        help="rounds in which every method runs its block of batches (drift reaches all alike)")
    parser.add_argument("--chunk-bytes", type=parse_size, default=None,
                        help="engine chunk size (default: the backend's, 4M on cpu, 16M on gpus)")
    parser.add_argument("--out", default="bagualu2-bench/offload",
                        help="path prefix of the outputs, PREFIX.json and PREFIX.png "
                             "(default: bagualu2-bench/offload, in the folder bagualu2-bench)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _measure(fns: Sequence[Callable[[], None]], nbytes: int, args) -> list:
    """Median seconds of one call of each of ``fns`` (each moves ``nbytes`` bytes).

    The methods take turns in blocks: ``--passes`` rounds, in each of which every method runs
    back to back for its share of ``--min-time``. Drift in the machine's load (tens of percent
    from second to second on a shared machine) then reaches every method alike, while within a
    block a method runs as it would alone: run one call at a time round-robin instead and, on a
    machine with few cores, torch's OpenMP workers, which spin for a while after each parallel
    copy, take a core from the engine's copy threads that run next.
    """
    for fn in fns:
        fn()  # warm-up (first touch, lazy init)
    times: list = [[] for _ in fns]
    share = args.min_time / args.passes
    for _ in range(args.passes):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            count = 0
            while count < args.max_iters and (count < args.min_iters or time.perf_counter() - start < share):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
                count += 1
    out = []
    for samples in times:
        med = statistics.median(samples)
        out.append({"seconds": med, "GBps": nbytes / med / 1e9, "iters": len(samples)})
    return out


def batch_size(n: int) -> int:
    """Copies per measurement: enough that small copies are timed as a stream, not one by one."""
    return max(1, min(64, (32 * MiB) // n))


class _Setup:
    """Buffers and callables for one size: every method moves `batch` copies of one `n`-byte
    source into `batch` distinct destinations, back to back, then waits once (the way an async
    engine is used, and the same cache situation for every method)."""

    def __init__(self, n: int, engine, device: torch.device) -> None:
        self.n = n
        self.k = batch_size(n)
        self.device = device
        self.gpu = device.type == "cuda"
        self.src = torch.empty(n, dtype=torch.uint8, device=device)
        self.src.fill_(0x5A)
        self.dev_out = torch.empty(self.k * n, dtype=torch.uint8, device=device)
        self.dev_out.fill_(0)
        self.dev_outs = list(self.dev_out.split(n))
        pin = self.gpu  # pinning needs an accelerator in torch
        self.host = torch.empty(self.k * n, dtype=torch.uint8, pin_memory=pin)
        self.host.fill_(0xA5)
        self.hosts = list(self.host.split(n))
        self.ref = torch.empty(n, dtype=torch.uint8)
        self.ref.fill_(0x33)
        self.engine = engine
        self.offloaded = engine.offload(self.src)
        self.offloaded.wait()
        self.soc = torch.autograd.graph.save_on_cpu(pin_memory=pin)
        self.packed = self.soc.pack_hook(self.src)

    def close(self) -> None:
        self.offloaded.release()
        self.engine.synchronize()

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.current_stream().synchronize()

    # D2H -----------------------------------------------------------------------------------
    def engine_d2h(self) -> None:
        hs = [self.engine.offload(self.src) for _ in range(self.k)]
        hs[-1].wait()  # one stream: the last copy completes last
        for h in hs:
            h.release()

    def torch_d2h(self) -> None:
        for dst in self.hosts:
            dst.copy_(self.src, non_blocking=True)
        self.sync()

    def soc_d2h(self) -> None:
        for _ in range(self.k):
            self.soc.pack_hook(self.src)
        self.sync()

    # H2D -----------------------------------------------------------------------------------
    def engine_h2d(self) -> None:
        rs = [self.engine.reload_async(self.offloaded, out=dst) for dst in self.dev_outs]
        for r in rs:
            r.wait()
        self.sync()

    def torch_h2d(self) -> None:
        for dst, src in zip(self.dev_outs, self.hosts):
            dst.copy_(src, non_blocking=True)
        self.sync()

    def soc_h2d(self) -> None:
        for _ in range(self.k):
            self.soc.unpack_hook(self.packed)
        self.sync()

    # host reference --------------------------------------------------------------------------
    def memcpy(self) -> None:
        src = self.ref.data_ptr()
        for dst in self.hosts:
            ctypes.memmove(dst.data_ptr(), src, self.n)


def _hip_memcpy(setup: _Setup, direction: str) -> Optional[Callable[[], None]]:
    if not (setup.gpu and getattr(torch.version, "hip", None)):
        return None
    try:
        from hip import hip  # type: ignore[import-not-found]
    except ImportError:
        return None
    stream = torch.cuda.current_stream().cuda_stream
    kind = hip.hipMemcpyKind.hipMemcpyDeviceToHost if direction == "d2h" else \
        hip.hipMemcpyKind.hipMemcpyHostToDevice
    pairs = [(h, setup.src) for h in setup.hosts] if direction == "d2h" else \
        list(zip(setup.dev_outs, setup.hosts))

    def fn() -> None:
        for dst, src in pairs:
            hip.hipMemcpyAsync(dst.data_ptr(), src.data_ptr(), setup.n, kind, stream)
        hip.hipStreamSynchronize(stream)

    return fn


def run(args: argparse.Namespace) -> int:
    from bagualu2.offload import CopyEngine, HostArena, resolve_backend

    for name, value, least in (("--min-size", args.min_size, 1), ("--step", args.step, 2),
                               ("--passes", args.passes, 1), ("--min-iters", args.min_iters, 1),
                               ("--max-iters", args.max_iters, args.min_iters)):
        if value < least:
            raise SystemExit(f"{name} {value} must be at least {least}")
    if args.min_time < 0:
        raise SystemExit(f"--min-time {args.min_time} must be >= 0")
    try:
        backend = resolve_backend(args.backend)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"--backend: {e}") from None
    if backend != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--backend {backend} needs a visible GPU and a torch built for it; this torch "
                         f"({torch.__version__}) sees none: use --backend cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if backend != "cpu" else torch.device("cpu")
    sizes = []
    n = args.min_size
    while n <= args.max_size:
        sizes.append(n)
        n *= args.step
    if not sizes:
        print(f"no sizes between {args.min_size} and {args.max_size}", file=sys.stderr)
        return 2
    # The reload source plus one batch of offloads, at every size.
    arena = HostArena(max(sizes[-1] * (1 + batch_size(sizes[-1])), 33 * MiB) + 4 * MiB, backend)
    engine = CopyEngine(arena, chunk_bytes=args.chunk_bytes)
    cpu_tensors = device.type == "cpu"

    try:
        from tqdm import tqdm
        bar = tqdm(total=len(sizes) * 7, unit="measurement", disable=args.quiet, desc="offload bandwidth",
                   file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm is a dependency
        bar = None
    results = []
    for n in sizes:
        s = _Setup(n, engine, device)
        row: dict = {"bytes": n, "d2h": {}, "h2d": {}}
        plan = [("d2h", "engine", s.engine_d2h), ("d2h", "torch_pinned", s.torch_d2h),
                ("d2h", "save_on_cpu", s.soc_d2h), ("h2d", "engine", s.engine_h2d),
                ("h2d", "torch_pinned", s.torch_h2d), ("h2d", "save_on_cpu", s.soc_h2d),
                ("both", "memcpy", s.memcpy)]
        for direction in ("d2h", "h2d"):
            fn = _hip_memcpy(s, direction)
            if fn is not None:
                plan.append((direction, "hip_memcpy", fn))
        if bar is not None:
            methods = len({name for _, name, _ in plan})
            bar.set_postfix_str(f"{human(n)}: {methods} methods taking turns, both directions")
        for (direction, name, _), m in zip(plan, _measure([fn for _, _, fn in plan], n * s.k, args)):
            m["batch"] = s.k
            if name == "save_on_cpu" and cpu_tensors:
                m["note"] = "no copy: save_on_cpu keeps cpu tensors as they are"
            for d in (("d2h", "h2d") if direction == "both" else (direction,)):
                row[d][name] = m
            if bar is not None:
                bar.update(1)
        for d in ("d2h", "h2d"):
            base = {k: v["GBps"] for k, v in row[d].items() if k in BASELINES and "note" not in v}
            best = max(base, key=base.get)
            row[d]["best_baseline"] = best
            row[d]["ratio"] = row[d]["engine"]["GBps"] / base[best]
        results.append(row)
        s.close()
        del s, plan, fn
    if bar is not None:
        bar.close()

    _print_table(results, backend)
    meta = {"backend": backend, "device": str(device), "torch": torch.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(), "chunk_bytes": engine.chunk_bytes,
            "engine_stats": engine.stats(), "arena_stats": arena.stats()}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {json_path}")
    if not args.no_plot:
        png = out.with_suffix(".png")
        _plot(results, backend, png)
        print(f"wrote {png}")
    return 0


def _print_table(results: list, backend: str) -> None:
    names = ["engine", "torch_pinned", "save_on_cpu", "memcpy"]
    if any("hip_memcpy" in r["d2h"] for r in results):
        names.append("hip_memcpy")
    print(f"\nOffload bandwidth, GB/s (backend={backend}; median of batches of copies)")
    header = f"{'size':>9} {'dir':>4} " + " ".join(f"{n:>12}" for n in names) + f" {'engine/best':>12} {'best':>12}"
    print(header)
    print("-" * len(header))
    for r in results:
        for d in ("d2h", "h2d"):
            cells = []
            for n in names:
                m = r[d].get(n)
                cells.append(f"{'-':>12}" if m is None else
                             f"{m['GBps']:>11.2f}{'*' if 'note' in m else ' '}")
            print(f"{human(r['bytes']):>9} {d:>4} " + " ".join(cells) +
                  f" {r[d]['ratio']:>11.2f}x {r[d]['best_baseline']:>12}")
    if any("note" in r["d2h"].get("save_on_cpu", {}) for r in results):
        print("* save_on_cpu does not copy cpu tensors; not counted as a baseline")
    big = [r for r in results if r["bytes"] >= MiB]
    if big:
        worst = min(min(r["d2h"]["ratio"], r["h2d"]["ratio"]) for r in big)
        print(f"engine vs best baseline at >= 1 MiB: worst ratio {worst:.2f}")


def _plot(results: list, backend: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    sizes = [r["bytes"] for r in results]
    for ax, d in zip(axes, ("d2h", "h2d")):
        for name, style in (("engine", "o-"), ("torch_pinned", "s--"), ("save_on_cpu", "^:"),
                            ("memcpy", "x-."), ("hip_memcpy", "d--")):
            ys = [r[d][name]["GBps"] if name in r[d] and "note" not in r[d][name] else None
                  for r in results]
            if all(y is None for y in ys):
                continue
            ax.plot([s for s, y in zip(sizes, ys) if y is not None], [y for y in ys if y is not None],
                    style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("copy size (bytes)")
        ax.set_title(f"{'offload (D2H)' if d == 'd2h' else 'reload (H2D)'} - {backend}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
