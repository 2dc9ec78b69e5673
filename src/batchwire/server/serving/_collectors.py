"""Metrics read from the engine at each scrape: where the pipelines' time goes, what the
scheduler's pipeline slots do, and the pipelines' faults.

=========================================  =========  ====================================
``batchwire_stage_seconds_total``          counter    seconds the pipelines' threads
                                                      spent, by ``stage``
``batchwire_pipeline_busy_seconds_total``  counter    slot seconds spent on each
                                                      ``pipeline``'s batches (the fair
                                                      share's measure)
``batchwire_pipeline_builds_total``        counter    pipelines built, by ``pipeline``
``batchwire_pipeline_build_seconds_total`` counter    seconds spent building them
``batchwire_pipeline_evictions_total``     counter    built pipelines a slot dropped to
                                                      make room (more keys than it keeps:
                                                      each is rebuilt when its turn comes)
``batchwire_pipeline_switches_total``      counter    times a slot switched to a
                                                      ``pipeline``'s key from another key
``batchwire_queue_wait_seconds``           summary    seconds a batch waited from being
                                                      asked for to a pipeline taking it
``batchwire_queued_batches``               gauge      batches asked for and waiting now
``batchwire_pipeline_faults_total``        counter    pipeline faults (not a sample's: the
                                                      stream resumes on another server), by
                                                      ``pipeline`` and ``kind``
``batchwire_batches_failed_total``         counter    batches a pipeline held when a fault
                                                      ended its run, by ``pipeline``
``batchwire_device_healthy``               gauge      0 while a device is broken, by
                                                      ``device``
``batchwire_readahead_records_total``      counter    records read ahead of their streams
``batchwire_readahead_bytes_total``        counter    their bytes
``batchwire_readahead_dropped_total``      counter    records a stream closed or read
                                                      before they were read ahead
``batchwire_readahead_held_bytes``         gauge      bytes read ahead and not yet read by
                                                      their streams (at most
                                                      ``read_ahead_mib``)
``batchwire_readahead_in_flight``          gauge      records being read ahead now
``batchwire_readahead_streams``            gauge      streams reading ahead now
=========================================  =========  ====================================
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from batchwire.server.data.records import ReadAhead
from batchwire.server.runners import PipelineHealth, StageTimes
from batchwire.server.scheduling import Scheduler

__all__ = ["HealthCollector", "ReadAheadCollector", "SchedulerCollector", "StageCollector"]

# SchedulerStats field -> (metric name without _total, help)
_COUNTERS = {
    "busy_seconds": (
        "batchwire_pipeline_busy_seconds",
        "Seconds the pipeline slots spent on each pipeline's batches.",
    ),
    "builds": ("batchwire_pipeline_builds", "Pipelines built, by pipeline."),
    "build_seconds": ("batchwire_pipeline_build_seconds", "Seconds spent building pipelines."),
    "evictions": (
        "batchwire_pipeline_evictions",
        "Built pipelines dropped to make room for another key's (rebuilt at their next turn).",
    ),
    "switches": (
        "batchwire_pipeline_switches",
        "Times a pipeline slot switched to this pipeline's key from another.",
    ),
}


class StageCollector(Collector):
    """The engine's :class:`StageTimes` as a counter family."""

    def __init__(self, stages: StageTimes) -> None:
        self._stages = stages

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "batchwire_stage_seconds",
            "Seconds the pipelines' threads spent, by stage: read (LMDB, parse, screen), "
            "pipeline (DALI's run), encode (message build).",
            labels=("stage",),
        )
        for stage, seconds in self._stages.snapshot().items():
            family.add_metric((stage,), seconds)
        yield family


class SchedulerCollector(Collector):
    """The scheduler's :class:`SchedulerStats` and queue, by pipeline name."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterable[Metric]:
        sums, waits = self._scheduler.stats.snapshot()
        for field, (name, help) in _COUNTERS.items():
            family = CounterMetricFamily(name, help, labels=("pipeline",))
            for (kind, pipeline), value in sorted(sums.items()):
                if kind == field:
                    family.add_metric((pipeline,), value)
            yield family
        summary = SummaryMetricFamily(
            "batchwire_queue_wait_seconds",
            "Seconds a batch waited from being asked for to a pipeline taking it.",
            labels=("pipeline",),
        )
        for pipeline, (count, seconds) in sorted(waits.items()):
            summary.add_metric((pipeline,), count, seconds)
        yield summary
        queued = GaugeMetricFamily(
            "batchwire_queued_batches",
            "Batches asked for and waiting for a pipeline now.",
            labels=("pipeline",),
        )
        for pipeline, count in sorted(self._scheduler.queued().items()):
            queued.add_metric((pipeline,), count)
        yield queued


class HealthCollector(Collector):
    """The engine's :class:`PipelineHealth` as metric families, read when scraped."""

    def __init__(self, health: PipelineHealth) -> None:
        self._health = health

    def collect(self) -> Iterable[Metric]:
        faults = CounterMetricFamily(
            "batchwire_pipeline_faults",
            "Pipeline faults (a failure that is not a sample's: the stream resumes on "
            "another server), by pipeline and kind.",
            labels=("pipeline", "kind"),
        )
        for (pipeline, kind), count in sorted(self._health.faults().items()):
            faults.add_metric((pipeline, kind), count)
        failed = CounterMetricFamily(
            "batchwire_batches_failed",
            "Batches a pipeline held when a fault ended its run, by pipeline.",
            labels=("pipeline",),
        )
        for pipeline, count in sorted(self._health.batches_failed().items()):
            failed.add_metric((pipeline,), count)
        healthy = GaugeMetricFamily(
            "batchwire_device_healthy",
            "1 while a device runs its pipelines, 0 while it is broken (health NOT_SERVING).",
            labels=("device",),
        )
        for device, ok in sorted(self._health.devices().items()):
            healthy.add_metric((device,), 1 if ok else 0)
        yield from (faults, failed, healthy)


class ReadAheadCollector(Collector):
    """The server's :class:`ReadAhead` (its seconds are in the ``read`` stage)."""

    def __init__(self, readahead: ReadAhead) -> None:
        self._readahead = readahead

    def collect(self) -> Iterable[Metric]:
        stats = self._readahead.stats()
        counters = (
            ("records", "Records read ahead of their streams.", stats.records),
            ("bytes", "Bytes of the records read ahead.", stats.bytes),
            (
                "dropped",
                "Records a stream closed or read before they were read ahead.",
                stats.dropped,
            ),
        )
        for name, help, value in counters:
            yield CounterMetricFamily(f"batchwire_readahead_{name}", help, value=value)
        gauges = (
            ("held_bytes", "Bytes read ahead and not yet read by their streams.", stats.held_bytes),
            ("in_flight", "Records being read ahead now.", stats.in_flight),
            ("streams", "Streams reading ahead now.", stats.streams),
        )
        for name, help, value in gauges:
            yield GaugeMetricFamily(f"batchwire_readahead_{name}", help, value=value)
