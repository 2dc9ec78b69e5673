"""The data directory's rescans, for a server: on a timer and on request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable

from batchwire.server.engine import Change, Engine, wait_event
from batchwire.server.errors import DatasetError
from batchwire.server.serving._metrics import ServerMetrics

__all__ = ["Rescans"]

log = logging.getLogger(__name__)


class Rescans:
    """Rescans of the engine's data directory, one at a time, off the event loop: every
    ``interval`` seconds (0: never on a timer) and whenever :attr:`wanted` is set; then
    ``changed()`` when datasets changed. A directory that fails is logged once, until it
    works again. Made and run on the server's event loop."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        executor: concurrent.futures.Executor,
        *,
        interval: float,
        changed: Callable[[], Awaitable[None]],
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._executor = executor
        self._interval = interval or None
        self._changed = changed
        self.wanted = asyncio.Event()
        self._lock = asyncio.Lock()
        self._failing = False  # the last rescan failed (logged once, not each time)

    async def run(self) -> None:
        """Rescan on the timer and on request until cancelled (the server stops)."""
        while True:
            await wait_event(self.wanted, self._interval)
            self.wanted.clear()
            try:
                await self.once()
            except Exception:  # a bug; the next rescan may fare better
                log.exception("rescan of %s failed", self._engine.config.data_dir)

    async def once(self) -> list[Change]:
        """One rescan; then ``changed()`` if anything changed."""
        async with self._lock:
            if self._engine.draining:
                return []
            loop = asyncio.get_running_loop()
            self._metrics.rescans.inc()
            try:
                changes = await loop.run_in_executor(self._executor, self._engine.rescan)
            except DatasetError as exc:
                self._metrics.rescan_errors.inc()
                if not self._failing:
                    log.error("rescan failed, serving the datasets found before: %s", exc)
                self._failing = True
                return []
            if self._failing:
                log.info("rescan of %s works again", self._engine.config.data_dir)
                self._failing = False
            for change in changes:
                self._metrics.datasets_changed.labels(change=change.change).inc()
            self._metrics.datasets.set(self._engine.num_datasets)
        if changes:
            await self._changed()
        return changes
