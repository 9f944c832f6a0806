"""``python -m bagualu2.cli``: the ``bagualu2`` command."""
import sys

from bagualu2.cli import main

sys.exit(main())
