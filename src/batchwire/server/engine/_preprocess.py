"""Inference preprocessing: encoded images from clients, batched across requests.

``PreprocessBatcher.submit`` validates a request (limits first, then every
image's header through the same screen the streams use) and queues its
images; it returns a ``concurrent.futures.Future`` of a
:class:`PreprocessResult`. One thread per pipeline configuration (a *queue*:
pipeline, parameters, dtype, layout) collects queued images until it has
``batch_size`` of them or the oldest has waited ``max_delay`` seconds, and
hands them as one DALI batch to the server's scheduler through the queue's
:class:`Ticket`: preprocessing shares the pipelines with the streams, a queue
counting as one stream in the fair share. The output is split back to the
requests as it comes. A request larger than ``batch_size`` is cut into parts
that may travel in several DALI batches.

Bad images never reach DALI unscreened (DALI 2.4's CPU decoder can crash the
process on garbage behind a valid signature). An image that passes the screen
but still fails in DALI is found by the runner's bisection of the batch. Either way
the request gets a per-image reason and its other images come back.

Bounded: at most ``max_queued`` images wait across all queues (more is
``OverCapacity``), at most ``MAX_QUEUES`` queues exist at once, each has at most
``QUEUE_WINDOW`` batches with the scheduler, and a queue idle for
``IDLE_SECONDS`` ends its thread and its ticket. Never imports grpc.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from batchwire.server.data.records import unsupported_reason
from batchwire.server.engine._preprocess_request import (
    Pending,
    PreprocessLimits,
    PreprocessRequest,
    PreprocessResult,
    settle,
)
from batchwire.server.errors import Draining, OverCapacity, PipelineFault
from batchwire.server.pipelines import PipelineSpec
from batchwire.server.runners import (
    Batch,
    Job,
    RunnerKey,
    StageTimes,
    keep,
    pipeline_named,
    runner_key,
)
from batchwire.server.scheduling import Scheduler

__all__ = ["IDLE_SECONDS", "MAX_QUEUES", "QUEUE_WINDOW", "PreprocessBatcher"]

log = logging.getLogger(__name__)

MAX_QUEUES = 16
IDLE_SECONDS = 30.0
QUEUE_WINDOW = 2  # a queue's DALI batches with the scheduler at once
_JOIN_SECONDS = 10.0
_POLL_S = 0.1  # how often a queue waiting for room with the scheduler checks for a stop
_DALI_FAILED = (
    "DALI could not decode or process it (corrupt or truncated image data, or a size the "
    "pipeline cannot handle)"
)


@dataclasses.dataclass
class _Part:
    """Images ``offset .. offset + len(images)`` of a request, screened and queued."""

    pending: Pending
    offset: int
    images: list[np.ndarray]
    arrived: float


class _Queue:
    """One pipeline configuration's queue, its thread and its ticket, whose stream it is
    (a :class:`StreamPort`: the ticket's batches are the jobs the thread hands it, and come
    back as batches of their own). Guarded by the batcher's lock, but for ``jobs``, which
    :meth:`read` takes from."""

    def __init__(
        self, key: RunnerKey, lock: threading.Lock, scheduler: Scheduler, stages: StageTimes
    ) -> None:
        self.key = key
        self.parts: collections.deque[_Part] = collections.deque()
        self.queued = 0
        self.wake = threading.Condition(lock)
        self.thread: threading.Thread | None = None
        self.jobs: dict[int, Job] = {}  # batches handed to the ticket, by its number
        self.sent = 0  # batches handed to the ticket so far
        self.running = 0  # ... and not yet come back
        self._stages = stages
        self.ticket = scheduler.ticket(key, 0, self, QUEUE_WINDOW)

    def read(self, seq: int) -> Job:
        """The job handed to the ticket as its batch ``seq`` (the ``read`` stage)."""
        with self._stages.timing("read"):
            return self.jobs.pop(seq)

    def finish(self, batch: Batch) -> Batch:
        """``batch`` with images of its own: its rows go to their requests later, on the
        future's callback (:meth:`PreprocessBatcher._finish`)."""
        return keep(batch)


class PreprocessBatcher:
    """Batches concurrent preprocessing requests into DALI runs; see the module docstring.

    Each queue opens a ticket with the server's ``scheduler``, its reads timed in
    ``stages``; ``device``/``next_device`` say where its pipelines run; ``draining`` is polled at
    submit; ``limits`` bound its batches and requests.
    """

    def __init__(
        self,
        *,
        pipelines: Mapping[str, PipelineSpec],
        scheduler: Scheduler,
        stages: StageTimes,
        device: str,
        next_device: Callable[[], int | None],
        draining: Callable[[], bool],
        limits: PreprocessLimits,
    ) -> None:
        self._pipelines = pipelines
        self._scheduler = scheduler
        self._stages = stages
        self._device = device
        self._next_device = next_device
        self._draining = draining
        self.limits = limits
        self._lock = threading.Lock()
        self._queues: dict[tuple[object, ...], _Queue] = {}
        self._queued = 0
        self._stop = threading.Event()
        self._serial = 0
        self.batches_run = 0  # DALI batches run so far (for metrics and tests)
        self.images_run = 0

    @property
    def queued(self) -> int:
        """Images waiting for a DALI batch now."""
        return self._queued

    # -- requests ----------------------------------------------------------------------

    def submit(self, request: PreprocessRequest) -> concurrent.futures.Future[PreprocessResult]:
        """Validate and queue ``request``; raises ServiceErrors for request-level problems."""
        if self._draining() or self._stop.is_set():
            raise Draining("the server is shutting down; send the request to another server")
        pipeline = pipeline_named(self._pipelines, request.pipeline)
        self.limits.check(request, pipeline)
        count = len(request.images)
        key, output = runner_key(
            pipeline, request, batch_size=self.limits.batch_size, device=self._device
        )

        pending = Pending(count, 0, output, pipeline)
        good: list[tuple[int, np.ndarray]] = []
        for index, image in enumerate(request.images):
            reason = "empty: no bytes" if not image else unsupported_reason(image)
            if reason is None:
                # A view of the request's buffer, not a copy; DALI copies it in.
                good.append((index, np.frombuffer(image, dtype=np.uint8)))
            else:
                pending.fail(index, reason)
        if not good:
            pending.parts_left = 1
            pending.part_done()
            return pending.future
        self._enqueue(key, pending, good)
        return pending.future

    def _enqueue(
        self, key: RunnerKey, pending: Pending, good: list[tuple[int, np.ndarray]]
    ) -> None:
        # Parts are runs of consecutive good images, at most batch_size long, so
        # any part fits one DALI batch. Failed images split runs.
        parts: list[_Part] = []
        now = time.monotonic()
        for index, array in good:
            last = parts[-1] if parts else None
            if (
                last is not None
                and last.offset + len(last.images) == index
                and len(last.images) < self.limits.batch_size
            ):
                last.images.append(array)
            else:
                parts.append(_Part(pending, index, [array], now))
        pending.parts_left = len(parts)
        queue_id = (key.pipeline, key.params, key.dtype, key.layout)
        with self._lock:
            if self._queued + len(good) > self.limits.max_queued:
                raise OverCapacity(
                    f"the server's preprocessing queue is full ({self._queued} images waiting, "
                    f"limit {self.limits.max_queued}); retry with backoff or add servers"
                )
            queue = self._queues.get(queue_id)
            if queue is None:
                if len(self._queues) >= MAX_QUEUES:
                    raise OverCapacity(
                        f"the server already preprocesses with {MAX_QUEUES} different pipeline "
                        "settings at once; retry later, or use fewer parameter combinations"
                    )
                queue = self._start_queue(queue_id, key)
            queue.parts.extend(parts)
            queue.queued += len(good)
            self._queued += len(good)
            queue.wake.notify()

    def _start_queue(self, queue_id: tuple[object, ...], key: RunnerKey) -> _Queue:
        key = dataclasses.replace(key, device_id=self._next_device())
        queue = _Queue(key, self._lock, self._scheduler, self._stages)
        queue.ticket.start(0)
        self._serial += 1
        queue.thread = threading.Thread(
            target=self._work,
            args=(queue_id, queue),
            name=f"batchwire-preprocess-{key.pipeline}-{self._serial}",
            daemon=True,
        )
        self._queues[queue_id] = queue
        queue.thread.start()
        return queue

    # -- the queues' threads ------------------------------------------------------------

    def _take(self, queue_id: tuple[object, ...], queue: _Queue) -> list[_Part] | None:
        """The parts of the next DALI batch, or None when the queue should end."""
        with self._lock:
            idle_until = time.monotonic() + IDLE_SECONDS
            while not queue.parts and not self._stop.is_set():
                remaining = idle_until - time.monotonic()
                if remaining <= 0 and not queue.running:
                    del self._queues[queue_id]
                    return None
                queue.wake.wait(max(remaining, _POLL_S))
            # A batch goes to the scheduler only when the queue has room there.
            while queue.running >= QUEUE_WINDOW and not self._stop.is_set():
                queue.wake.wait(_POLL_S)
            if self._stop.is_set():
                return None
            # Wait for company until the batch is full or the oldest waited enough.
            deadline = queue.parts[0].arrived + self.limits.max_delay
            while queue.queued < self.limits.batch_size and not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                queue.wake.wait(remaining)
            if self._stop.is_set():
                return None
            taken: list[_Part] = []
            size = 0
            while queue.parts and size + len(queue.parts[0].images) <= self.limits.batch_size:
                part = queue.parts.popleft()
                taken.append(part)
                size += len(part.images)
            queue.queued -= size
            self._queued -= size
            queue.running += 1  # until _done
            return taken

    def _work(self, queue_id: tuple[object, ...], queue: _Queue) -> None:
        try:
            while True:
                parts = self._take(queue_id, queue)
                if parts is None:
                    return
                self._send(queue, parts)
        finally:
            queue.ticket.close()  # batches still running come back as None: see _finish
            self._fail_waiting(queue)

    def _send(self, queue: _Queue, parts: list[_Part]) -> None:
        """Hand one DALI batch of ``parts`` to the queue's ticket."""
        parts = [p for p in parts if not p.pending.future.cancelled()]
        if not parts:
            self._done(queue)
            return
        images = [image for part in parts for image in part.images]
        seq = queue.sent
        queue.sent += 1
        queue.jobs[seq] = Job(
            seq=seq,
            ids=np.arange(len(images), dtype=np.int64),
            images=images,
            labels=np.zeros(len(images), dtype=np.int64),
        )
        queue.ticket.extend(1)
        future = queue.ticket.future(seq)
        future.add_done_callback(lambda done: self._finish(queue, parts, done))

    def _finish(
        self, queue: _Queue, parts: list[_Part], done: concurrent.futures.Future[Batch | None]
    ) -> None:
        """A batch came back (on the pipeline's thread): its rows go to their requests."""
        try:
            result = done.result()
        except Exception as exc:
            if not isinstance(exc, PipelineFault):  # a fault is logged where it is found
                log.error("preprocessing with pipeline %r failed: %s", queue.key.pipeline, exc)
            for part in parts:
                settle(part.pending.future, exception=exc)
        else:
            if result is None:  # the queue closed: the server is shutting down
                for part in parts:
                    settle(part.pending.future, exception=_draining())
            else:
                self._split(parts, result)
        finally:
            self._done(queue)
            queue.ticket.more()

    def _done(self, queue: _Queue) -> None:
        with self._lock:
            queue.running -= 1
            queue.wake.notify_all()

    def _split(self, parts: list[_Part], result: Batch) -> None:
        with self._lock:
            self.batches_run += 1
            self.images_run += sum(len(part.images) for part in parts)
        assert isinstance(result.images, np.ndarray)  # Preprocess refuses named outputs
        rows = dict(zip(result.ids.tolist(), result.images, strict=True))
        skipped = set(result.skipped_ids)
        start = 0
        for part in parts:
            for k in range(len(part.images)):
                index = part.offset + k
                row = rows.get(start + k)
                if row is not None:
                    part.pending.rows[index] = np.array(row)  # owns its memory
                else:
                    reason = _DALI_FAILED if start + k in skipped else "no output from DALI"
                    part.pending.fail(index, reason)
            start += len(part.images)
            part.pending.part_done()

    def _fail_waiting(self, queue: _Queue) -> None:
        """Requests still queued in an ending queue (only when closing) learn why."""
        with self._lock:
            parts = list(queue.parts)
            queue.parts.clear()
            self._queued -= queue.queued
            queue.queued = 0
        for part in parts:
            settle(part.pending.future, exception=_draining())

    # -- life cycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the queues: queued requests fail with Draining; waits for batches running."""
        self._stop.set()
        with self._lock:
            queues = list(self._queues.values())
            for queue in queues:
                queue.wake.notify_all()
        for queue in queues:
            if queue.thread is not None:
                queue.thread.join(_JOIN_SECONDS)


def _draining() -> Draining:
    return Draining("the server is shutting down; send the request to another server")
