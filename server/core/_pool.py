"""A bounded pool of built pipelines, reused across streams.

Building a CPU pipeline is cheap; a GPU one allocates device memory and
decoder state, so idle pipelines are kept (at most ``max_idle``, least
recently used evicted) and handed to the next stream with the same key.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from batchwire.server.core._keys import RunnerKey
from batchwire.server.core._runner import Runner

__all__ = ["RunnerPool"]

log = logging.getLogger(__name__)


class RunnerPool:
    def __init__(self, build: Callable[[RunnerKey], Runner], *, max_idle: int = 8) -> None:
        self._build = build
        self._max_idle = max_idle
        self._idle: collections.OrderedDict[int, Runner] = collections.OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, key: RunnerKey) -> Runner:
        """An idle runner for ``key``, or a newly built one (may take a while)."""
        with self._lock:
            for token, runner in self._idle.items():
                if runner.key == key:
                    del self._idle[token]
                    return runner
        log.info(
            "building pipeline %s for batch size %d on %s", key.pipeline, key.batch_size, key.device
        )
        return self._build(key)

    def release(self, runner: Runner) -> None:
        """Return a runner after its stream; a broken one is dropped."""
        if not runner.healthy:
            return
        with self._lock:
            self._idle[id(runner)] = runner
            while len(self._idle) > self._max_idle:
                self._idle.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
