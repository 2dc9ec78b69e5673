"""``python -m benchmarks``, from the root of a checkout."""

from __future__ import annotations

import sys

from benchmarks._cli import main

if __name__ == "__main__":  # not when a spawned child process imports this module
    sys.exit(main())
