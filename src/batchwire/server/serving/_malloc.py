"""Keep large freed buffers in the heap: the server allocates and frees tens of MB per batch.

glibc serves allocations above ``M_MMAP_THRESHOLD`` (128 KiB at first) with fresh
``mmap`` pages and returns them on ``free``, so every batch's message buffers are
page-faulted and zeroed by the kernel again. Measured with ``batchwire bench`` on
the transport path, that fault cost was about a third of the server's CPU. Raising
the thresholds lets freed buffers be reused; resident memory then stays at the
working set's peak instead of shrinking between batches.

Only the ``batchwire serve`` process calls this (a library must not tune the
allocator of the process it is loaded into). ``BATCHWIRE_MALLOC_TUNING=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["tune_for_large_buffers"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def tune_for_large_buffers(mmap_threshold: int = 32 * 2**20, trim_threshold: int = 2**30) -> bool:
    """Apply the glibc settings; whether they took effect (False off glibc or when disabled)."""
    if os.environ.get("BATCHWIRE_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    applied = all(
        mallopt(option, value) == 1
        for option, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold),
            (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_TOP_PAD, 64 * 2**20),
        )
    )
    log.debug("malloc tuning for large buffers: %s", "on" if applied else "not applied")
    return applied
