"""The bytes of shared memory rings a server may hold (:class:`RingBudget`): one budget for
a lone server, or for all of a unit's workers, passed to them as they are spawned; and the
memory this process may use (the host's, or its cgroup's limit), which sizes it. A ring
reserves its bytes as it is made (``_shared_memory.py``) and releases them as it closes."""

from __future__ import annotations

import contextlib
import logging
import pathlib
import threading
from typing import Any

from batchwire.common.shared_memory import warn_once

__all__ = ["RingBudget"]

# Shared memory's one logger, not this module's: its warnings keep the logger operators
# filter them by, and each is said once a process on it (warn_once).
log = logging.getLogger("batchwire.server.serving._shared_memory")


def _memory() -> tuple[int, int]:
    """Bytes of memory this process may use in all (the host's, or its cgroup's limit
    where lower), and bytes available now."""
    info: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", total)
    with contextlib.suppress(OSError, ValueError):
        limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            current = int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text())
            total = min(total, int(limit))
            available = min(available, int(limit) - current)
    return total, max(available, 0)


class RingBudget:
    """The bytes of rings a server may hold: one budget for all of a unit's workers
    (:meth:`for_unit`, picklable into spawned workers as a ``Process`` argument).

    ``limit`` in bytes; 0 is a quarter of the memory the server may use (the host's, or
    its container's limit). A new ring also takes at most half of the memory available
    when it is made: the rest is left to the pipelines and to the trainers."""

    def __init__(self, limit: int = 0, counter: Any = None) -> None:
        self.limit = limit or _memory()[0] // 4
        self._counter = counter  # a multiprocessing Value shared by a unit, or None
        self._lock = threading.Lock() if counter is None else counter.get_lock()
        self._local = 0

    @classmethod
    def for_unit(cls, context: Any, limit: int = 0) -> RingBudget:
        """A budget shared by the workers spawned from ``context``."""
        return cls(limit, context.Value("q", 0))

    @property
    def used(self) -> int:
        """Bytes of rings held now (by the unit's workers together)."""
        with self._lock:
            return self._local if self._counter is None else int(self._counter.value)

    def reserve(self, size: int) -> bool:
        """Whether a ring of ``size`` bytes fits (counted as held if so); warns once a
        process when it does not."""
        available = _memory()[1]
        with self._lock:
            used = self._local if self._counter is None else int(self._counter.value)
            fits = used + size <= self.limit and size <= available // 2
            if fits:
                if self._counter is None:
                    self._local += size
                else:
                    self._counter.value += size
        if not fits:
            warn_once(
                log,
                "budget",
                "no room for a stream's %.0f MiB of shared memory (rings hold %.0f MiB of "
                "their %.0f MiB, and %.0f MiB of memory is available, of which a ring takes "
                "at most half): such streams send their batches in their messages; raise "
                "shared_memory_mib, or give the host or container more memory, to send "
                "batches to trainers on this host without copies",
                size / 2**20,
                used / 2**20,
                self.limit / 2**20,
                available / 2**20,
            )
        return fits

    def release(self, size: int) -> None:
        with self._lock:
            if self._counter is None:
                self._local -= size
            else:
                self._counter.value -= size

    def __getstate__(self) -> dict[str, Any]:
        if self._counter is None:
            raise TypeError("only a unit's RingBudget (for_unit) travels to other processes")
        return {"limit": self.limit, "counter": self._counter}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["limit"], state["counter"])  # type: ignore[misc]
