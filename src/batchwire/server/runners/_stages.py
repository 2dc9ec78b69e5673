"""Where the time goes (:class:`StageTimes`): seconds the server's threads spent in each
stage of making batches.

Three stages, summed over every batch the server's pipelines make:

``read``
    the record path (``Dataset.read_screened``, for each job): LMDB, parse, screen; and
    the read-ahead's threads, looking up the records of the streams' next batches and
    asking the disk for them (:mod:`batchwire.server.data.records._readahead`);
``pipeline``
    DALI's own run (decode, augment, normalize, on the CPU or the GPU), that is the
    time in ``Pipeline.run`` less the time it spent asking for its input;
``encode``
    building the stream's messages, the one copy from DALI's buffer included.

The sums are exported as ``batchwire_stage_seconds_total{stage}``; their rates divided
by the rate of samples sent give the seconds per image of each stage.

Thread-safe: runners add from their own threads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["STAGES", "StageTimes"]

STAGES = ("read", "pipeline", "encode")


class StageTimes:
    """Seconds spent in each of :data:`STAGES`, summed; safe to add to from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(STAGES, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        if stage not in self._seconds:
            raise ValueError(f"unknown stage {stage!r} (stages: {', '.join(STAGES)})")
        with self._lock:
            self._seconds[stage] += seconds

    @contextlib.contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        """The time spent in the ``with`` block, added to ``stage`` (whatever it raises)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - started)

    def snapshot(self) -> dict[str, float]:
        """The sums so far, by stage."""
        with self._lock:
            return dict(self._seconds)
