"""The server's pipelines: a fixed set per device, shared fairly by every stream.

A stream does not get a pipeline of its own. It asks for its next batches through a
:class:`~batchwire.server.scheduling._ticket.Ticket`, at most ``window`` ahead of what its client
has taken; ``PullBatches`` and ``StreamBatches`` streams and the ``Preprocess`` RPC's
batches all go through the same tickets. Each device has ``slots_per_device`` pipeline
slots; a slot is a thread that takes requests in the order of the fairness policy
(:mod:`batchwire.server.scheduling._fair`: every stream an equal share of pipeline time, by
measured cost), reads them through their ticket's stream, runs them, and hands each batch
to the stream's ``finish`` as the runner yields it (while its images are still in DALI's
buffer), and what that makes back to the ticket.

A slot keeps the pipelines (:class:`Runner`) it built for the keys it ran, at most
``max_idle_pipelines``, the least recently used dropped first. Requests with different
parameters (``size``, crop ranges, output dtype and layout, batch size) need pipelines of
their own: DALI builds a graph for fixed arguments, and per-sample argument inputs would not
cover a different output size or dtype. So a slot runs one key at a time, for at least the policy's
quantum once it switched (longer when it dropped another key's pipeline to build this one).

The records of a batch are read (LMDB, parse, screen) in the slot's thread, when its
pipeline asks for the next batch.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from batchwire.server.errors import PipelineFault
from batchwire.server.runners import Batch, Job, Runner, RunnerKey
from batchwire.server.scheduling._fair import FairQueue
from batchwire.server.scheduling._ticket import StreamPort, Ticket

__all__ = ["Scheduler", "SchedulerStats"]

log = logging.getLogger(__name__)

# How long an idle slot's pipeline waits for another request before it lets the batches it
# holds run out (a stream's next request usually follows its client taking a batch).
_LINGER_S = 0.005


class SchedulerStats:
    """What the slots did, by pipeline name: for metrics. Thread-safe."""

    FIELDS = ("builds", "build_seconds", "evictions", "switches", "busy_seconds")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, str], float] = collections.defaultdict(float)
        self._waits: dict[str, list[float]] = {}  # pipeline -> [count, seconds]

    def add(self, field: str, pipeline: str, value: float = 1.0) -> None:
        with self._lock:
            self._sums[field, pipeline] += value

    def waited(self, pipeline: str, seconds: float) -> None:
        """A batch of ``pipeline`` waited ``seconds`` from being asked for to being taken."""
        with self._lock:
            wait = self._waits.setdefault(pipeline, [0, 0.0])
            wait[0] += 1
            wait[1] += seconds

    def snapshot(self) -> tuple[dict[tuple[str, str], float], dict[str, tuple[int, float]]]:
        """(field, pipeline) -> sum, and pipeline -> (batches taken, seconds they waited)."""
        with self._lock:
            waits = {p: (int(w[0]), w[1]) for p, w in self._waits.items()}
            return dict(self._sums), waits


@dataclasses.dataclass
class _Slot:
    """A thread of the scheduler's that runs requests on a device, and the runners it
    built for the keys it ran (at most ``max_idle_pipelines``, least recently used first out)."""

    device_id: int | None
    runners: collections.OrderedDict[RunnerKey, Runner] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    key: RunnerKey | None = None  # the key it ran last
    thread: threading.Thread | None = None


class Scheduler:
    """``slots_per_device`` pipelines for each device id, fed from every ticket by the fair policy."""

    def __init__(
        self,
        build: Callable[[RunnerKey], Runner],
        device_ids: tuple[int | None, ...],
        *,
        slots_per_device: int,
        max_idle_pipelines: int = 4,
    ) -> None:
        self._build = build
        self._max_idle_pipelines = max(1, max_idle_pipelines)
        self._lock = threading.Condition()
        self._fair = FairQueue()
        self.stats = SchedulerStats()
        self._stopped = False
        self._slots = [
            _Slot(device_id) for device_id in device_ids for _ in range(slots_per_device)
        ]
        for index, slot in enumerate(self._slots):
            slot.thread = threading.Thread(
                target=self._run_slot, args=(slot,), name=f"batchwire-pipeline-{index}", daemon=True
            )
            slot.thread.start()

    def ticket(self, key: RunnerKey, count: int, stream: StreamPort, window: int) -> Ticket:
        """A stream's ticket: ``count`` batches of ``stream``, at most ``window`` asked ahead
        of those taken. Close it when done."""
        ticket = Ticket(key, count, stream, window, self)
        with self._lock:
            self._fair.open(ticket)
        return ticket

    def queued(self) -> dict[str, int]:
        """Batches asked for and not yet taken by a pipeline, by pipeline name."""
        with self._lock:
            queued = self._fair.queued()
        counts: collections.Counter[str] = collections.Counter()
        for key, count in queued.items():
            counts[key.pipeline] += count
        return dict(counts)

    # -- the streams' side ---------------------------------------------------------

    def request(self, ticket: Ticket, room: int, *, more: int = 0) -> None:
        """``ticket``'s window moved by ``room`` batches and its stream grew by ``more``
        (see ``FairQueue.ask``); a slot is woken if it has something new to run."""
        with self._lock:
            if ticket.closed:
                return
            if self._fair.ask(ticket, room, more):
                self._lock.notify_all()

    def forget(self, ticket: Ticket) -> None:
        with self._lock:
            self._fair.close(ticket)

    # -- the slots' side -------------------------------------------------------------

    def _next_key(self, slot: _Slot) -> RunnerKey | None:
        """The key this slot runs next (see ``FairQueue.choose``). Blocks until there is
        one; None once stopped."""
        with self._lock:
            while not self._stopped:
                key = self._fair.choose(slot.device_id, slot.runners, slot.key)
                if key is not None:
                    return key
                self._lock.wait()
            return None

    def _jobs(
        self,
        slot: _Slot,
        key: RunnerKey,
        stay: float,
        in_flight: collections.deque[tuple[Ticket, int]],
    ) -> Iterator[Job]:
        """Jobs of ``key`` in the policy's order, each kept in ``in_flight`` with its ticket
        until its result comes back (the runner's are in the order of its jobs); ends when
        none is waiting (after a short linger), or, ``stay`` seconds on, when another key's
        turn has come."""
        started = time.monotonic()
        while True:
            with self._lock:
                if self._stopped:
                    return
                if time.monotonic() - started >= stay and (
                    self._fair.choose(slot.device_id, slot.runners, key) != key
                ):
                    return
                taken = self._fair.take(key)
                if taken is None:
                    self._lock.wait(_LINGER_S)
                    taken = self._fair.take(key)
                if taken is None:
                    return
            ticket, seq, waited = taken
            self.stats.waited(key.pipeline, waited)
            try:
                job = ticket.stream.read(seq)
            except Exception as exc:  # the stream fails, not the slot
                ticket.deliver(seq, exc)
                continue
            in_flight.append((ticket, seq))
            yield job

    def _runner(self, slot: _Slot, key: RunnerKey) -> tuple[Runner, float]:
        """The slot's pipeline for ``key``, and the seconds it took to build where that
        dropped another key's pipeline (0: none was)."""
        runner = slot.runners.pop(key, None)
        seconds = 0.0
        evicted = False
        if runner is None:
            log.info(
                "%s building pipeline %s for batch size %d on %s",
                threading.current_thread().name,  # each slot builds its own
                key.pipeline,
                key.batch_size,
                key.device,
            )
            started = time.monotonic()
            runner = self._build(key)
            seconds = time.monotonic() - started
            self.stats.add("builds", key.pipeline)
            self.stats.add("build_seconds", key.pipeline, seconds)
        slot.runners[key] = runner
        while len(slot.runners) > self._max_idle_pipelines:
            dropped, _ = slot.runners.popitem(last=False)
            self.stats.add("evictions", dropped.pipeline)
            evicted = True
        return runner, seconds if evicted else 0.0

    def _run_slot(self, slot: _Slot) -> None:
        while (key := self._next_key(slot)) is not None:
            if slot.key is not None and key != slot.key:
                self.stats.add("switches", key.pipeline)
            slot.key = key
            try:
                self._run_key(slot, key)
            except Exception:  # a slot outlives any one failure
                log.exception("pipeline slot failed on %s", key.pipeline)

    def _run_key(self, slot: _Slot, key: RunnerKey) -> None:
        """Run ``key``'s requests on the slot's pipeline while it is the key's turn."""
        try:
            runner, rebuilt = self._runner(slot, key)
        except Exception as exc:
            # The key's pipeline cannot be built: its streams fail, not the server.
            if not isinstance(exc, PipelineFault):  # a fault is logged where it is found
                log.exception("building pipeline %s failed", key.pipeline)
            self._fail_waiting(key, exc)
            return
        in_flight: collections.deque[tuple[Ticket, int]] = collections.deque()
        with self._lock:
            stay = self._fair.stay(key, rebuilt)
        jobs = self._jobs(slot, key, stay, in_flight)
        # The slot is busy from the run's start: a run of one batch (requests that come one
        # at a time) counts too. The fair share leaves out the first result's time, which
        # includes the pipeline's start.
        last: float | None = None
        started = time.monotonic()
        try:
            for batch in runner.run(jobs):
                ticket, seq = in_flight.popleft()
                result = _finish(ticket, batch)  # before the runner runs on: see _finish
                now = time.monotonic()
                self.stats.add(
                    "busy_seconds", key.pipeline, now - (started if last is None else last)
                )
                if last is not None:
                    self._measured(key, now - last)
                last = now
                ticket.deliver(seq, result)
        except Exception as exc:
            # A pipeline that fails outside a bad sample (which the runner skips) fails
            # the batches it held, not the server: it is dropped and built again.
            if not isinstance(exc, PipelineFault):  # a fault is logged where it is found
                log.exception("pipeline %s failed; rebuilding it", key.pipeline)
            slot.runners.pop(key, None)
            for ticket, seq in in_flight:
                ticket.deliver(seq, exc)
        else:
            if not runner.healthy:
                slot.runners.pop(key, None)

    def _measured(self, key: RunnerKey, seconds: float) -> None:
        """One batch of ``key`` came out ``seconds`` after the slot's previous one."""
        with self._lock:
            self._fair.measured(key, seconds)

    def _fail_waiting(self, key: RunnerKey, exc: Exception) -> None:
        """Every request of ``key`` not yet taken fails with ``exc``."""
        with self._lock:
            failed = []
            for ticket in self._fair.waiting(key):
                failed.append((ticket, [seq for seq, _ in ticket.pending]))
                ticket.pending.clear()
        for ticket, seqs in failed:
            for seq in seqs:
                ticket.deliver(seq, exc)

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        for slot in self._slots:
            if slot.thread is not None:
                slot.thread.join(30)
            slot.runners.clear()


def _finish(ticket: Ticket, batch: Batch) -> Any:
    """What ``ticket``'s stream makes of ``batch``, or the exception that failed it (the
    stream fails, not the slot). Called before the runner is resumed: its images are a view
    of DALI's buffer until then, and the stream copies them once, from there into what it
    hands out."""
    try:
        return ticket.stream.finish(batch)
    except Exception as exc:
        return exc
