"""Stream-seconds open, and those of them in which a stream's client waited on this server:
the measure an autoscaler reads to tell whether trainers wait for data.

====================================================  =======  ===================================
``batchwire_stream_seconds_total``                    counter  seconds streams were open (two
                                                               streams open for a second add 2),
                                                               by ``dataset`` and ``pipeline``
``batchwire_stream_waiting_seconds_total``            counter  of those, the seconds in which the
                                                               stream had a batch asked for and
                                                               none ready: its handler awaited the
                                                               pipelines, not the client
====================================================  =======  ===================================

``rate(waiting) / rate(open)`` is the share of stream time in which trainers waited on the
server. The rest of a stream's time it was writing (the client, or the network, not taking
batches as fast as they come: ``batchwire_client_wait_seconds``) or, for a pulling client,
had nothing asked for (the client holds as many batches ahead as it wants).

Live: a scrape counts each open stream's time up to the scrape, so the counters grow
smoothly under streams that last hours (a counter added to at a stream's end would jump).
The handler's transitions run on the event loop, the scrape in the metrics thread: both
under one lock, each reading the clock inside it, so the counters never go back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["StreamClock", "StreamTimes"]

_Labels = tuple[str, str]  # dataset, pipeline


class StreamTimes(Collector):
    """The stream-seconds of every stream a server opened; :meth:`clock` times one."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        # Seconds of intervals that ended (streams closed, waits over): [open, waiting].
        self._ended: dict[_Labels, list[float]] = {}
        self._live: set[StreamClock] = set()

    def clock(self, dataset: str, pipeline: str) -> StreamClock:
        """The clock of a stream opened now; close it when the stream ends."""
        with self._lock:
            clock = StreamClock(self, (dataset, pipeline), self._now())
            self._ended.setdefault(clock.labels, [0.0, 0.0])
            self._live.add(clock)
        return clock

    def totals(self) -> dict[_Labels, tuple[float, float]]:
        """(open, waiting) stream-seconds by (dataset, pipeline), up to now."""
        with self._lock:
            now = self._now()
            sums = {labels: list(seconds) for labels, seconds in self._ended.items()}
            for clock in self._live:
                sums[clock.labels][0] += now - clock.opened
                if clock.waiting_since is not None:
                    sums[clock.labels][1] += now - clock.waiting_since
        return {labels: (open_, waiting) for labels, (open_, waiting) in sums.items()}

    def collect(self) -> Iterable[Metric]:
        labels = ("dataset", "pipeline")
        open_ = CounterMetricFamily(
            "batchwire_stream_seconds",
            "Seconds streams were open (stream-seconds: two streams for a second add 2).",
            labels=labels,
        )
        waiting = CounterMetricFamily(
            "batchwire_stream_waiting_seconds",
            "Stream-seconds with a batch asked for and none ready: the client waited on "
            "this server's pipelines. Divided by batchwire_stream_seconds_total, the share of "
            "time trainers wait.",
            labels=labels,
        )
        for names, (open_seconds, waiting_seconds) in sorted(self.totals().items()):
            open_.add_metric(names, open_seconds)
            waiting.add_metric(names, waiting_seconds)
        yield open_
        yield waiting

    # -- what a clock reports, under the lock ------------------------------------------

    def _start_waiting(self, clock: StreamClock) -> None:
        with self._lock:
            if clock.waiting_since is None and not clock.closed:
                clock.waiting_since = self._now()

    def _stop_waiting(self, clock: StreamClock, close: bool) -> None:
        with self._lock:
            if clock.closed:
                return
            now = self._now()
            ended = self._ended[clock.labels]
            if clock.waiting_since is not None:
                ended[1] += now - clock.waiting_since
                clock.waiting_since = None
            if close:
                ended[0] += now - clock.opened
                clock.closed = True
                self._live.discard(clock)


class StreamClock:
    """One stream's time: open from its creation to :meth:`close`, waiting while its
    handler awaits a batch that was asked for. Used from the stream's event loop."""

    def __init__(self, times: StreamTimes, labels: _Labels, opened: float) -> None:
        self._times = times
        self.labels = labels
        self.opened = opened
        self.waiting_since: float | None = None
        self.closed = False
        self._awaiting = False

    def awaiting(self, asked: bool) -> None:
        """The handler awaits the stream's next batch; ``asked``: one is asked for now
        (a pulling client may not have asked yet: then :meth:`asked` starts the wait)."""
        self._awaiting = True
        if asked:
            self._times._start_waiting(self)

    def asked(self) -> None:
        """The client asked for more batches."""
        if self._awaiting:
            self._times._start_waiting(self)

    def took(self) -> None:
        """The awaited batch is here (or the stream ended)."""
        self._awaiting = False
        self._times._stop_waiting(self, close=False)

    def close(self) -> None:
        """The stream ended. Idempotent."""
        self._awaiting = False
        self._times._stop_waiting(self, close=True)
