"""The names of the files through which a server sends batches to a client on its host:
one rule for both sides (``batchwire.server.serving._shared_memory`` makes rings and reads
probes, ``batchwire.client._shared_memory`` makes probes and maps rings).

A client's probe is ``PROBE_PREFIX`` and 32 hex digits, a server's ring ``RING_PREFIX``,
its process id, ``-`` and 16 hex digits; a side accepts a name the other sends only where
it matches ``PROBE_NAME`` or ``RING_NAME``: a file name in ``SHM_DIR``, never a path.
"""

from __future__ import annotations

import pathlib
import re

__all__ = ["PROBE_NAME", "PROBE_PREFIX", "RING_NAME", "RING_PREFIX", "SHM_DIR"]

SHM_DIR = pathlib.Path("/dev/shm")
PROBE_PREFIX = "batchwire-probe-"
PROBE_NAME = re.compile(PROBE_PREFIX + "[0-9a-f]{16,64}")
RING_PREFIX = "batchwire-"
RING_NAME = re.compile(RING_PREFIX + "[0-9]+-[0-9a-f]{16}")
