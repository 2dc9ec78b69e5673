"""Metrics read from the engine at each scrape, from one :class:`EngineStats`: where the
pipelines' time goes, what the scheduler's pipeline slots do, the pipelines' faults, and
the read-ahead.

=========================================  =========  ====================================
``batchwire_stage_seconds_total``          counter    seconds the pipelines' threads
                                                      spent, by ``stage``
``batchwire_pipeline_busy_seconds_total``  counter    slot seconds spent running each
                                                      ``pipeline``'s batches, from each
                                                      run's start (a batch run alone
                                                      counts too)
``batchwire_pipeline_slots``               gauge      pipeline slots (per device times
                                                      devices): busy seconds per second
                                                      divided by it is how busy they are
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

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from batchwire.server.engine import EngineStats

__all__ = ["EngineCollector"]

# EngineStats.slots field -> (metric name without _total, help)
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


class EngineCollector(Collector):
    """The engine's figures as metric families: ``stats()`` (the engine's
    :meth:`~batchwire.server.engine.Engine.stats`) is read once a scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        yield from _stages(stats)
        yield from _slots(stats)
        yield from _health(stats)
        yield from _readahead(stats)


def _stages(stats: EngineStats) -> Iterator[Metric]:
    family = CounterMetricFamily(
        "batchwire_stage_seconds",
        "Seconds the pipelines' threads spent, by stage: read (LMDB, parse, screen), "
        "pipeline (DALI's run), encode (message build).",
        labels=("stage",),
    )
    for stage, seconds in stats.stage_seconds.items():
        family.add_metric((stage,), seconds)
    yield family


def _slots(stats: EngineStats) -> Iterator[Metric]:
    """What the scheduler's slots did, and its queue, by pipeline name."""
    for field, (name, help) in _COUNTERS.items():
        sums = [
            ((pipeline,), value) for (kind, pipeline), value in stats.slots.items() if kind == field
        ]
        yield _family(CounterMetricFamily, name, help, ("pipeline",), sums)
    summary = SummaryMetricFamily(
        "batchwire_queue_wait_seconds",
        "Seconds a batch waited from being asked for to a pipeline taking it.",
        labels=("pipeline",),
    )
    for pipeline, (count, seconds) in sorted(stats.queue_waits.items()):
        summary.add_metric((pipeline,), count, seconds)
    yield summary
    yield GaugeMetricFamily(
        "batchwire_pipeline_slots",
        "Pipeline slots (slots_per_device for each device): the rate of "
        "batchwire_pipeline_busy_seconds_total divided by this is how busy they are.",
        value=stats.pipeline_slots,
    )
    yield _family(
        GaugeMetricFamily,
        "batchwire_queued_batches",
        "Batches asked for and waiting for a pipeline now.",
        ("pipeline",),
        [((pipeline,), count) for pipeline, count in stats.queued.items()],
    )


def _health(stats: EngineStats) -> Iterator[Metric]:
    """The pipelines' faults, the batches they failed, and the devices' health."""
    yield _family(
        CounterMetricFamily,
        "batchwire_pipeline_faults",
        "Pipeline faults (a failure that is not a sample's: the stream resumes on "
        "another server), by pipeline and kind.",
        ("pipeline", "kind"),
        stats.faults.items(),
    )
    yield _family(
        CounterMetricFamily,
        "batchwire_batches_failed",
        "Batches a pipeline held when a fault ended its run, by pipeline.",
        ("pipeline",),
        [((pipeline,), count) for pipeline, count in stats.batches_failed.items()],
    )
    yield _family(
        GaugeMetricFamily,
        "batchwire_device_healthy",
        "1 while a device runs its pipelines, 0 while it is broken (health NOT_SERVING).",
        ("device",),
        [((device,), 1 if ok else 0) for device, ok in stats.devices.items()],
    )


def _family(
    kind: type[CounterMetricFamily | GaugeMetricFamily],
    name: str,
    help: str,
    labels: tuple[str, ...],
    values: Iterable[tuple[tuple[str, ...], float]],
) -> Metric:
    """A counter or gauge family of ``values``, each its labels' values and its value, in
    the order of their labels' values."""
    family = kind(name, help, labels=labels)
    for label_values, value in sorted(values):
        family.add_metric(label_values, value)
    return family


def _readahead(stats: EngineStats) -> Iterator[Metric]:
    """The read-ahead's records and bytes (its seconds are in the ``read`` stage); nothing
    where the server reads nothing ahead."""
    readahead = stats.readahead
    if readahead is None:
        return
    counters = (
        ("records", "Records read ahead of their streams.", readahead.records),
        ("bytes", "Bytes of the records read ahead.", readahead.bytes),
        (
            "dropped",
            "Records a stream closed or read before they were read ahead.",
            readahead.dropped,
        ),
    )
    for name, help, value in counters:
        yield CounterMetricFamily(f"batchwire_readahead_{name}", help, value=value)
    gauges = (
        ("held_bytes", "Bytes read ahead and not yet read by their streams.", readahead.held_bytes),
        ("in_flight", "Records being read ahead now.", readahead.in_flight),
        ("streams", "Streams reading ahead now.", readahead.streams),
    )
    for name, help, value in gauges:
        yield GaugeMetricFamily(f"batchwire_readahead_{name}", help, value=value)
