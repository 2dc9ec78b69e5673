"""What the engine's parts have done so far and hold now, read at once: the figures the
server's metrics export at each scrape (``batchwire.server.serving``'s collectors)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from batchwire.server.data.records import ReadAheadStats

__all__ = ["EngineStats"]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counts and gauges (:meth:`Engine.stats`). Pipelines and
    devices are by name and label; counts and seconds are totals since the engine was made,
    but ``queued``, ``devices`` and the read-ahead's gauges, which are as they stand now."""

    stage_seconds: Mapping[str, float]
    """Seconds the pipelines' threads spent, by stage (``read``, ``pipeline``, ``encode``)."""
    slots: Mapping[tuple[str, str], float]
    """What the scheduler's slots did, by (field, pipeline): ``builds``, ``build_seconds``,
    ``evictions``, ``switches`` and ``busy_seconds``."""
    queue_waits: Mapping[str, tuple[int, float]]
    """By pipeline: the batches a pipeline took, and the seconds they waited for it."""
    queued: Mapping[str, int]
    """Batches asked for and not yet taken by a pipeline, by pipeline."""
    faults: Mapping[tuple[str, str], int]
    """Pipeline faults, by (pipeline, kind)."""
    batches_failed: Mapping[str, int]
    """Batches failed by those faults, by pipeline."""
    devices: Mapping[str, bool]
    """Every device the pipelines ran on (``cpu`` or a GPU's id), and whether it is healthy."""
    readahead: ReadAheadStats | None
    """What the read-ahead did and holds, or None where the server reads nothing ahead."""
    pipeline_slots: int = 0
    """The scheduler's pipeline slots (``slots_per_device`` for each device): what
    ``busy_seconds`` can add up to per second."""
