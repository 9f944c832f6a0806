"""The ``bagualu2`` command: ``demo``, ``bench offload``, ``simulate``, ``selftest``.

Every subcommand has a description and shows its defaults in ``--help``; every one writes its
files into one folder, ``--out`` (``bagualu2-demo``, ``bagualu2-bench``, ``bagualu2-selftest``;
``simulate`` writes only when given one).
"""

from __future__ import annotations

import argparse
from typing import List, Optional


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, unless the help states it already or there is
    none to show (a flag, an option that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS \
                or "default" in text:
            return text
        return super()._get_help_string(action)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``bagualu2`` console script."""
    from bagualu2.cli import bench, demo, selftest
    from bagualu2.sim import cli as sim_cli

    parser = argparse.ArgumentParser(
        prog="bagualu2",
        description="Runtime-adaptive activation provisioning for Mixture-of-Experts training.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(parent, name: str, summary: str, module) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=summary, description=summary, formatter_class=_Formatter)
        module.add_arguments(p)  # may replace the description with a longer one
        p.set_defaults(run=module.run)
        return p

    add(commands, "demo", "train the reference MoE model through routing spikes under four policies "
                          "and compare them", demo)
    p = commands.add_parser("bench", help="microbenchmarks", description="Microbenchmarks of bagualu2's pieces.")
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    add(benches, "offload", "offload/reload bandwidth of the copy engine vs torch and memcpy", bench)
    add(commands, "simulate", "cluster-scale simulation of activation policies (128 to 12,288 accelerators)",
        sim_cli)
    add(commands, "selftest", "check this install on this machine's accelerator (or its CPU form): "
                              "exactness, budget, bandwidth, overlap, OOM, leaks", selftest)

    args = parser.parse_args(argv)
    return int(args.run(args) or 0)
