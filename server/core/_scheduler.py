"""Pipelines owned by the server: a fixed set per device, fed by every open stream.

A stream does not get a pipeline of its own. It asks for its next batches, at most
``window`` ahead of what its client has taken (so a slow client never makes the server hold
more), and the device's slots take those requests in turn across streams, one batch at a
time: a stream's share of the pipelines does not depend on how far ahead it asks, and
each stream's batches still come back to it in order.

A slot is a thread that keeps built pipelines (:class:`Runner`) for the keys it has run,
least recently used first out beyond ``max_idle``. Requests with different parameters
(``size``, crop ranges, output dtype and layout, batch size) need pipelines of their own:
DALI builds a graph for fixed arguments, and per-sample argument inputs would not cover a
different output size or dtype. So a slot runs one key at a time and moves to another key
after ``switch_after`` batches when other keys are waiting. A job of many streams with one
key (the usual training job) keeps every slot on that key.

The records of a batch are read (LMDB, parse, screen) in the slot's thread, when its
pipeline asks for the next batch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator

from batchwire.server.core._errors import PipelineFault
from batchwire.server.core._jobs import Job, Result
from batchwire.server.core._keys import RunnerKey
from batchwire.server.core._runner import Runner

__all__ = ["Scheduler", "Ticket"]

log = logging.getLogger(__name__)

# How long an idle slot's pipeline waits for another request before it lets the batches it
# holds run out (a stream's next request usually follows its client taking a batch).
_LINGER_S = 0.005


class Ticket:
    """One stream's requests and results.

    ``read(seq)`` gives the job of the stream's batch ``seq`` (its records read); results
    come back through :meth:`take`, in order.
    """

    def __init__(
        self,
        key: RunnerKey,
        count: int,
        read: Callable[[int], Job],
        window: int,
        scheduler: Scheduler,
    ) -> None:
        self.key = key
        self.count = count
        self.read = read
        self._window = window
        self._scheduler = scheduler
        self.pending: collections.deque[int] = collections.deque()
        self._results: dict[int, Result | BaseException] = {}
        # Results someone awaits (``future``): set on delivery instead of kept.
        self._futures: dict[int, concurrent.futures.Future[Result | None]] = {}
        self._requested = 0  # batches before this one have been asked of the pipelines
        self._allowed = 0  # ... and those before this one may be
        self._ready = threading.Condition()
        self.closed = False

    def start(self, first: int) -> None:
        """Ask for batches ``first``, ``first + 1``, … (``window`` of them to begin with)."""
        self._requested = self._allowed = first
        self._scheduler.request(self, self._window)

    def extend(self, count: int) -> None:
        """The stream has ``count`` more batches (a pulling client asked for them); they are
        asked of the pipelines as the window allows."""
        self._scheduler.request(self, 0, more=count)

    def next_requests(self, room: int, more: int = 0) -> list[int]:
        """Further batch numbers to ask for, ``room`` more allowed and ``more`` batches more
        in the stream (called under the scheduler's lock)."""
        self.count += more
        self._allowed += room
        seqs = list(range(self._requested, min(self._allowed, self.count)))
        self._requested += len(seqs)
        return seqs

    def deliver(self, seq: int, result: Result | BaseException) -> None:
        with self._ready:
            if self.closed:
                return
            future = self._futures.pop(seq, None)
            if future is None:
                self._results[seq] = result
                self._ready.notify_all()
        if future is not None:
            _settle(future, result)

    def future(self, seq: int) -> concurrent.futures.Future[Result | None]:
        """Batch ``seq``'s result as a future (None once the ticket is closed); for a
        caller that awaits it instead of holding a thread. Ask for the next batch with
        :meth:`more` once it is taken."""
        future: concurrent.futures.Future[Result | None] = concurrent.futures.Future()
        with self._ready:
            if self.closed:
                _settle(future, None)
                return future
            if seq not in self._results:
                self._futures[seq] = future
                return future
            result = self._results.pop(seq)
        _settle(future, result)
        return future

    def more(self) -> None:
        """One batch taken: ask for one more."""
        self._scheduler.request(self, 1)

    def take(self, seq: int, stop: threading.Event, poll: float = 0.1) -> Result | None:
        """Batch ``seq``'s result, once a slot has run it, and asks for one more batch;
        None once ``stop`` is set or the ticket closed."""
        with self._ready:
            while seq not in self._results:
                if stop.is_set() or self.closed:
                    return None
                self._ready.wait(poll)
            result = self._results.pop(seq)
        if isinstance(result, BaseException):
            raise result
        self.more()
        return result

    def close(self) -> None:
        """Drop what is asked for and not yet run; results still running are discarded."""
        with self._ready:
            self.closed = True
            self._results.clear()
            waiting = list(self._futures.values())
            self._futures.clear()
            self._ready.notify_all()
        for future in waiting:
            _settle(future, None)
        self._scheduler.forget(self)


def _settle(
    future: concurrent.futures.Future[Result | None], result: Result | BaseException | None
) -> None:
    """Set ``future``, unless its awaiter gave up on it (the stream's handler was cancelled,
    which cancels the future)."""
    try:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


@dataclasses.dataclass
class _Slot:
    device_id: int | None
    runners: collections.OrderedDict[RunnerKey, Runner] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    next_seq: int = 0
    thread: threading.Thread | None = None


class Scheduler:
    """``slots`` pipelines for each device id, fed round-robin from every ticket."""

    def __init__(
        self,
        build: Callable[[RunnerKey], Runner],
        device_ids: tuple[int | None, ...],
        *,
        slots: int,
        max_idle: int = 2,
        switch_after: int = 8,
    ) -> None:
        self._build = build
        self._max_idle = max(1, max_idle)
        self._switch_after = switch_after
        self._lock = threading.Condition()
        # Tickets with requests not yet taken, per key, in turn order.
        self._waiting: dict[RunnerKey, collections.deque[Ticket]] = {}
        self._stopped = False
        self._slots = [_Slot(device_id) for device_id in device_ids for _ in range(slots)]
        for index, slot in enumerate(self._slots):
            slot.thread = threading.Thread(
                target=self._run_slot, args=(slot,), name=f"batchwire-pipeline-{index}", daemon=True
            )
            slot.thread.start()

    def ticket(self, key: RunnerKey, count: int, read: Callable[[int], Job], window: int) -> Ticket:
        return Ticket(key, count, read, window, self)

    # -- the streams' side ---------------------------------------------------------

    def request(self, ticket: Ticket, room: int, *, more: int = 0) -> None:
        with self._lock:
            if ticket.closed:
                return
            seqs = ticket.next_requests(room, more)
            if not seqs:
                return
            ticket.pending.extend(seqs)
            turn = self._waiting.setdefault(ticket.key, collections.deque())
            if ticket not in turn:
                turn.append(ticket)
            self._lock.notify_all()

    def forget(self, ticket: Ticket) -> None:
        with self._lock:
            ticket.pending.clear()
            turn = self._waiting.get(ticket.key)
            if turn is not None and ticket in turn:
                turn.remove(ticket)
                if not turn:
                    del self._waiting[ticket.key]

    # -- the slots' side -------------------------------------------------------------

    def _take(self, key: RunnerKey) -> tuple[Ticket, int] | None:
        """The next request of ``key``: the first ticket in turn, which then goes last."""
        turn = self._waiting.get(key)
        if not turn:
            return None
        ticket = turn.popleft()
        seq = ticket.pending.popleft()
        if ticket.pending:
            turn.append(ticket)
        if not turn:
            del self._waiting[key]
        return ticket, seq

    def _next_key(self, slot: _Slot) -> RunnerKey | None:
        """A key with requests for this slot's device: one it has built if any, else the
        one waiting longest. Blocks until there is one; None once stopped."""
        with self._lock:
            while not self._stopped:
                keys = [k for k in self._waiting if k.device_id == slot.device_id]
                if keys:
                    built = [k for k in keys if k in slot.runners]
                    return (built or keys)[0]
                self._lock.wait()
            return None

    def _jobs(
        self, slot: _Slot, key: RunnerKey, in_flight: dict[int, tuple[Ticket, int]]
    ) -> Iterator[Job]:
        """Jobs of ``key`` in turn across tickets, numbered by the slot; ends when none
        is waiting (after a short linger), or to let another key's requests run."""
        taken = 0
        while True:
            with self._lock:
                if self._stopped:
                    return
                if taken >= self._switch_after and any(
                    k != key and k.device_id == slot.device_id for k in self._waiting
                ):
                    return
                next_request = self._take(key)
                if next_request is None:
                    self._lock.wait(_LINGER_S)
                    next_request = self._take(key)
                if next_request is None:
                    return
            ticket, seq = next_request
            try:
                job = ticket.read(seq)
            except Exception as exc:  # the stream fails, not the slot
                ticket.deliver(seq, exc)
                continue
            job.seq = slot.next_seq
            in_flight[job.seq] = (ticket, seq)
            slot.next_seq += 1
            taken += 1
            yield job

    def _runner(self, slot: _Slot, key: RunnerKey) -> Runner:
        runner = slot.runners.pop(key, None)
        if runner is None:
            log.info(
                "building pipeline %s for batch size %d on %s",
                key.pipeline,
                key.batch_size,
                key.device,
            )
            runner = self._build(key)
        slot.runners[key] = runner
        while len(slot.runners) > self._max_idle:
            slot.runners.popitem(last=False)
        return runner

    def _run_slot(self, slot: _Slot) -> None:
        while (key := self._next_key(slot)) is not None:
            try:
                self._run_key(slot, key)
            except Exception:  # a slot outlives any one failure
                log.exception("pipeline slot failed on %s", key.pipeline)

    def _run_key(self, slot: _Slot, key: RunnerKey) -> None:
        """Run ``key``'s requests on the slot's pipeline while there are any."""
        try:
            runner = self._runner(slot, key)
        except Exception as exc:
            # The key's pipeline cannot be built: its streams fail, not the server.
            if not isinstance(exc, PipelineFault):  # a fault is logged where it is found
                log.exception("building pipeline %s failed", key.pipeline)
            self._fail_waiting(key, exc)
            return
        in_flight: dict[int, tuple[Ticket, int]] = {}
        try:
            for result in runner.run(self._jobs(slot, key, in_flight), slot.next_seq):
                ticket, seq = in_flight.pop(result.seq)
                ticket.deliver(seq, dataclasses.replace(result, seq=seq))
        except Exception as exc:
            # A pipeline that fails outside a bad sample (which the runner skips) fails
            # the batches it held, not the server: it is dropped and built again.
            if not isinstance(exc, PipelineFault):  # a fault is logged where it is found
                log.exception("pipeline %s failed; rebuilding it", key.pipeline)
            slot.runners.pop(key, None)
            for ticket, seq in in_flight.values():
                ticket.deliver(seq, exc)
        else:
            if not runner.healthy:
                slot.runners.pop(key, None)

    def _fail_waiting(self, key: RunnerKey, exc: Exception) -> None:
        """Every request of ``key`` not yet taken fails with ``exc``."""
        with self._lock:
            turn = self._waiting.pop(key, collections.deque())
            failed = [(ticket, list(ticket.pending)) for ticket in turn]
            for ticket in turn:
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
