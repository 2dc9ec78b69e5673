"""``python -m batchwire.cli``: the ``batchwire`` command without the console script."""

from __future__ import annotations

from batchwire.cli import main

raise SystemExit(main())
