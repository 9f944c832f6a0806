"""Offload bandwidth benchmark (same as `bagualu2 bench offload`); see bagualu2/cli/bench.py.

    python benchmarks/offload_bandwidth.py --max-size 256M
"""
import sys

from bagualu2.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
