"""One ``/metrics`` for a unit of worker processes: each worker's series, labelled
``worker="i"``, plus the unit's own.

Each worker serves its own registry on a loopback port (its custom collectors read
its engine, which lives only in that process, so prometheus_client's multiprocess
mode, which sums files of plain counters and gauges, cannot hold them). At each
scrape the parent reads every worker's text and merges the families.

=================================  =====  ============================================
``batchwire_workers``              gauge  worker processes running now
``batchwire_worker_serving``       gauge  1 while a ``worker`` reports SERVING itself
                                          (the unit's health needs every one)
``batchwire_worker_scrape_errors`` gauge  1 when a ``worker``'s metrics could not be
                                          read at this scrape (its series are missing)
=================================  =====  ============================================
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from batchwire.server.serving import State, WorkerStates

__all__ = ["WorkerMetricsCollector"]

log = logging.getLogger(__name__)

_SCRAPE_TIMEOUT = 5.0  # seconds for one worker's /metrics


class WorkerMetricsCollector(Collector):
    """The unit's metrics; ``endpoints()`` gives each worker's loopback metrics port
    (None while it has none) by index, ``alive()`` how many workers run."""

    def __init__(
        self,
        states: WorkerStates,
        endpoints: Callable[[], Sequence[int | None]],
        alive: Callable[[], int],
    ) -> None:
        self._states = states
        self._endpoints = endpoints
        self._alive = alive

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        errors = GaugeMetricFamily(
            "batchwire_worker_scrape_errors",
            "1 when a worker's metrics could not be read at this scrape.",
            labels=("worker",),
        )
        for index, port in enumerate(self._endpoints()):
            if port is None:
                continue
            text = _scrape(index, port)
            errors.add_metric((str(index),), 0 if text is not None else 1)
            if text is not None:
                _merge(families, text, str(index))
        workers = GaugeMetricFamily("batchwire_workers", "Worker processes running now.")
        workers.add_metric((), self._alive())
        serving = GaugeMetricFamily(
            "batchwire_worker_serving",
            "1 while a worker reports SERVING itself (the unit serves when every one does).",
            labels=("worker",),
        )
        for index, state in enumerate(self._states.snapshot()):
            serving.add_metric((str(index),), 1 if state == State.SERVING else 0)
        yield from families.values()
        yield from (workers, serving, errors)


def _scrape(index: int, port: int) -> str | None:
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=_SCRAPE_TIMEOUT) as response:
            return str(response.read().decode())
    except OSError as exc:  # a worker stopping, or stuck: its series are left out
        log.warning("cannot read worker %d's metrics at %s: %s", index, url, exc)
        return None


def _merge(families: dict[str, Metric], text: str, worker: str) -> None:
    """Add the families of ``text`` to ``families``, every sample labelled ``worker``."""
    for family in text_string_to_metric_families(text):
        merged = families.get(family.name)
        if merged is None:
            merged = families[family.name] = Metric(family.name, family.documentation, family.type)
        for sample in family.samples:
            merged.samples.append(sample._replace(labels={**sample.labels, "worker": worker}))
