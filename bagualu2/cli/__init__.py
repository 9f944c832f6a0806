"""The ``bagualu2`` command: ``demo``, ``bench offload``, ``simulate``, ``selftest``."""

from __future__ import annotations

import argparse
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``bagualu2`` console script."""
    from bagualu2.cli import bench, demo, selftest
    from bagualu2.sim import cli as sim_cli

    parser = argparse.ArgumentParser(
        prog="bagualu2",
        description="Runtime-adaptive activation provisioning for Mixture-of-Experts training.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("demo", help="train the reference MoE model through routing spikes "
                                         "under four policies and compare them")
    demo.add_arguments(p)
    p.set_defaults(run=demo.run)

    p = commands.add_parser("bench", help="microbenchmarks")
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = benches.add_parser("offload", help="offload/reload bandwidth of the copy engine vs torch and memcpy")
    bench.add_arguments(p)
    p.set_defaults(run=bench.run)

    p = commands.add_parser("simulate", help="cluster-scale simulation of activation policies")
    sim_cli.add_arguments(p)
    p.set_defaults(run=sim_cli.run)

    p = commands.add_parser("selftest", help="check this install on this machine's accelerator (or its "
                                             "CPU form): exactness, budget, bandwidth, overlap, OOM, leaks")
    selftest.add_arguments(p)
    p.set_defaults(run=selftest.run)

    args = parser.parse_args(argv)
    return int(args.run(args) or 0)

