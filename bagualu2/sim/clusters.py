"""Cluster presets of the simulator: accelerators, links and achievable efficiencies as data.

Every hardware figure carries its source in :attr:`ClusterSpec.sources`. Two kinds of numbers
live here:

- **Datasheet figures** (memory, peak dense bf16 throughput, HBM bandwidth, links): cited.
- **Efficiency parameters** (what fraction of a peak an op class achieves). Only
  ``network_efficiency`` (the *effective* fraction of link bandwidth achieved by the expert-
  parallel all-to-all and pipeline sends; above 1 means part of it hides behind computation)
  and ``dp_efficiency`` (achieved fraction of the network bandwidth by the per-step data-
  parallel gradient sync plus the optimizer; it absorbs everything a step does outside the
  pipeline) are *calibrated*, by :func:`bagualu2.sim.calibrate.calibrate`, so that the two
  static baselines land on the published MFUs (keep-all 30.0% in calm phases, full recompute
  24.6%) on the DCU reference scenario. Everything else (in particular every adaptive result)
  follows from the model. The values are stored in both presets (the H200 preset reuses the
  DCU fit: same software stack, not fitted on H200 hardware) and reproduced by
  ``python -m bagualu2.sim.calibrate``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

__all__ = ["CLUSTER_PRESETS", "ClusterSpec", "describe_clusters", "get_cluster"]

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class ClusterSpec:
    """One accelerator type and its interconnect.

    Attributes:
        name: preset name.
        device_memory: bytes of device memory.
        peak_flops: dense bf16 matrix throughput per device (FLOP/s).
        hbm_bw: device memory bandwidth (B/s).
        host_d2h_bw, host_h2d_bw: achievable pinned-host copy bandwidth per direction (B/s).
        intra_bw: per-device bandwidth to peers in the same node, per direction (B/s).
        inter_bw: per-device network bandwidth to other nodes, per direction (B/s).
        devices_per_node: accelerators sharing the intra-node fabric.
        p2p_latency_s: latency of one pipeline send.
        compute_efficiency: achieved fraction of ``peak_flops`` by matmuls (calibrated).
        attention_ratio: attention kernels' efficiency relative to matmuls.
        memory_efficiency: achieved fraction of ``hbm_bw`` by memory-bound ops.
        network_efficiency: achieved fraction of link bandwidth by all-to-all and sends.
        dp_efficiency: achieved fraction of ``inter_bw`` by the per-step gradient sync and
            optimizer (calibrated; it also absorbs what the step does outside the pipeline).
        backward_ratio: backward FLOPs / forward FLOPs of matmul and memory ops.
        attention_backward_ratio: the same for attention (FlashAttention recomputes scores).
        workspace: bytes reserved for allocator fragmentation, communication buffers and
            kernel workspaces (never available to activations).
        restart_s: cold restart of the whole job after an OOM (seconds).
        sources: field -> citation or rationale.
    """

    name: str
    device_memory: float
    peak_flops: float
    hbm_bw: float
    host_d2h_bw: float
    host_h2d_bw: float
    intra_bw: float
    inter_bw: float
    devices_per_node: int
    p2p_latency_s: float = 20e-6
    compute_efficiency: float = 0.5
    attention_ratio: float = 0.7
    memory_efficiency: float = 0.8
    network_efficiency: float = 0.8
    dp_efficiency: float = 0.5
    backward_ratio: float = 2.0
    attention_backward_ratio: float = 2.5
    workspace: float = 4 * GiB
    restart_s: float = 284.0
    sources: Dict[str, str] = field(default_factory=dict, compare=False)

    def op_rate(self, op_class: str) -> float:
        """Achieved work rate of an op class: FLOP/s (matmul, attention), B/s (memory)."""
        if op_class == "matmul":
            return self.peak_flops * self.compute_efficiency
        if op_class == "attention":
            return self.peak_flops * self.compute_efficiency * self.attention_ratio
        if op_class == "memory":
            return self.hbm_bw * self.memory_efficiency
        raise ValueError(f"op class {op_class!r} has no single rate; network depends on layout")


_COMMON_SOURCES = {
    "compute_efficiency": "large bf16 GEMMs reach ~70-80% of peak on current accelerators; 0.75 "
                          "assumed (not fitted: see bagualu2.sim.calibrate)",
    "network_efficiency": "calibrated (bagualu2.sim.calibrate, DCU reference scenario) to keep_all "
                          "30.0% calm MFU / recompute_all 24.6%: effective 2.43 = link efficiency "
                          "~0.8 with ~2/3 of the all-to-all hidden behind computation",
    "dp_efficiency": "calibrated together with network_efficiency (see above)",
    "attention_ratio": "FlashAttention-2 (arXiv:2307.08691) reaches ~50-73% of GEMM throughput "
                       "in forward; 0.7 assumed",
    "memory_efficiency": "STREAM-like kernels reach ~80% of HBM peak; assumed",
    "backward_ratio": "dgrad + wgrad = 2x forward GEMM FLOPs (Narayanan et al., SC21)",
    "attention_backward_ratio": "FlashAttention backward ~2.5x forward FLOPs (arXiv:2205.14135)",
    "workspace": "allocator fragmentation + NCCL buffers + cuBLAS workspaces; assumed 4 GiB",
    "restart_s": "cold restart of the reference deployment: 284 s (BaGuaLu-2, SC26)",
    "p2p_latency_s": "one pipeline send/recv launch + link latency; assumed 20 us",
}

CLUSTER_PRESETS: Dict[str, ClusterSpec] = {
    "h200": ClusterSpec(
        name="h200",
        device_memory=141 * GB,
        peak_flops=989e12,
        hbm_bw=4.8e12,
        host_d2h_bw=50 * GB,
        host_h2d_bw=50 * GB,
        intra_bw=450 * GB,
        inter_bw=50 * GB,
        devices_per_node=8,
        compute_efficiency=0.75,
        network_efficiency=2.4365,
        dp_efficiency=0.0521,
        sources={
            "device_memory": "NVIDIA H200 datasheet: 141 GB HBM3e",
            "peak_flops": "NVIDIA H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with "
                          "sparsity, i.e. 989 TFLOPS dense",
            "hbm_bw": "NVIDIA H200 datasheet: 4.8 TB/s",
            "host_d2h_bw": "PCIe Gen5 x16: 64 GB/s per direction raw, ~50 GB/s achievable pinned",
            "host_h2d_bw": "as host_d2h_bw",
            "intra_bw": "NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction (datasheet)",
            "inter_bw": "DGX/HGX H200: one 400 Gb/s ConnectX-7 NIC per GPU = 50 GB/s per direction",
            "devices_per_node": "HGX H200 8-GPU baseboard",
            **_COMMON_SOURCES,
        },
    ),
    "dcu-64g": ClusterSpec(
        name="dcu-64g",
        device_memory=64 * GiB,
        peak_flops=181e12,
        hbm_bw=1.6e12,
        host_d2h_bw=24 * GB,
        host_h2d_bw=24 * GB,
        intra_bw=50 * GB,
        inter_bw=25 * GB,
        devices_per_node=8,
        compute_efficiency=0.75,
        network_efficiency=2.4365,
        dp_efficiency=0.0521,
        sources={
            "device_memory": "64 GB HBM2e DCU-class accelerator. Hygon publishes no full "
                             "datasheet; figures follow the same-class, same-lineage (CDNA) "
                             "AMD Instinct MI210: 64 GB HBM2e (AnandTech 17326, AMD MI210 brief)",
            "peak_flops": "MI210: 181 TFLOPS FP16/BF16 matrix (AnandTech 17326)",
            "hbm_bw": "MI210: 1.6 TB/s HBM2e (AnandTech 17326)",
            "host_d2h_bw": "PCIe Gen4 x16: 31.5 GB/s per direction raw, ~24 GB/s achievable pinned",
            "host_h2d_bw": "as host_d2h_bw",
            "intra_bw": "MI210: 3 Infinity Fabric links (AnandTech 17326), bridged 4-card "
                        "hives; 50 GB/s per direction per device assumed",
            "inter_bw": "one 200 Gb/s HDR InfiniBand NIC per accelerator assumed "
                        "(= 25 GB/s per device per direction)",
            "devices_per_node": "8 PCIe accelerators per node assumed",
            **_COMMON_SOURCES,
        },
    ),
}


def get_cluster(name: str, **overrides: object) -> ClusterSpec:
    """Preset by name (with field overrides), or a clear error listing the presets."""
    try:
        spec = CLUSTER_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r}; choose one of: "
                         f"{', '.join(sorted(CLUSTER_PRESETS))}") from None
    return dataclasses.replace(spec, **overrides) if overrides else spec


def describe_clusters(names: Sequence[str] = ()) -> List[str]:
    """One line per preset (for ``--list``)."""
    out = []
    for n in names or sorted(CLUSTER_PRESETS):
        c = CLUSTER_PRESETS[n]
        out.append(f"{n:20s} {c.device_memory / GiB:6.1f} GiB  "
                   f"{c.peak_flops / 1e12:6.0f} TFLOPS bf16  host {c.host_d2h_bw / GB:.0f} GB/s  "
                   f"net {c.inter_bw / GB:.1f} GB/s/dev  "
                   f"{c.devices_per_node}/node")
    return out
