"""The batches of one stream, computed by the server's pipelines.

A stream runs the batches it is asked for (:meth:`BatchStream.want`), in the order asked,
on the scheduler's pipelines, and hands them out in that order: awaited on the event loop
(:meth:`BatchStream.next_async`), or by iteration in a thread of the caller's. Who opened
it says which batches: a pulling client asks as it goes; a ``StreamBatches`` call asks for
its lane's at once, and in-process use for its whole share (:func:`share_batches`).

The server's path of a pulled batch, from the request to the bytes sent, all of it named
here (each line a call, with the thread it runs in and what it hands on)::

    BatchwireServicer._read_wants     the event loop: a PullRequest's batch indices
      BatchStream.want                  the share's PlannedBatches, appended in order
        Ticket.extend                   the stream has more batches
          Scheduler.request             under the scheduler's lock
            FairQueue.ask                 the batch numbers the window allows join the
                                          ticket's pending; it waits; the slots are woken
    Scheduler._run_key                a slot's thread (batchwire-pipeline-N), one key
      Runner.run(jobs)                  the slot's pipeline runs the jobs of any stream
        _Source (DALI's input)          called by DALI in pipe.run, on the slot's thread
          Scheduler._jobs               the next (ticket, seq) the FairQueue gives, kept
                                        in the slot's in-flight queue
            BatchStream.read            the ticket's stream, back up into this stream:
                                        the "read" stage, the read-ahead told
              read_job                    down to the records: Dataset.read_screened
                                          (pread, Datum walk, screen): a Job
        Runner._result                  DALI's output a Batch, images a view of its buffer,
                                        yielded to the slot, which before it resumes the
      BatchStream.finish                runner hands the batch to the ticket's stream,
                                        back up into this stream: the Batch with its
        encode                          place and format, through the "encode" stage to
                                        serving's encoder: encode_parts or
                                        SharedRing.encode, the one copy of the pixels:
                                        an EncodedBatch
      Ticket.deliver                    the next in flight: the future of its seq set
    serve_stream                      the event loop again
      BatchStream.next_async            the future awaited: the EncodedBatch
        Ticket.more                     one taken: Scheduler.request, one more allowed
      write                             each message's bytes to gRPC
    ReadAhead._work                   a read-ahead thread (batchwire-readahead-N): the
                                      next ids from BatchStream.batch_ids, back up into
                                      this stream, advised to the kernel

That is about 20 calls over 18 of the server's files (and 3 of ``batchwire.common``),
4 thread hand-offs (the event loop to a slot, the slot to DALI's own threads and back,
the slot to the event loop by a future), and 7 types: PullRequest, PlannedBatch, Job,
DALI's output, Batch (the runner's, which the stream completes), EncodedBatch, the message
bytes. A batch keeps one number, its ``seq`` in the stream, from its request to its
result.

Six calls on this path go up a layer, through five things a layer above handed down:
DALI's input takes its next job from the scheduler's generator (``Scheduler._jobs``); a
slot reads the batch through its ticket's stream (``BatchStream.read``) and hands it, once
run, to that stream's finish (``BatchStream.finish``), this stream being the one object
its ticket was given (a ``StreamPort``); the stream's finish encodes through serving's
encoder; the read-ahead takes the next ids from this stream (``batch_ids``, the one object
it was given too) and adds its seconds to the runners' stage times. docs/development.md
("Calls handed down") lists every call handed down across the server's layers, these and
the others (the builder, a lane's batches, the health listener, a Preprocess queue's own
port and its batches' callback), with their count and why each is. Inside scheduling, a
ticket only asks: what it has asked for and been served is the fair queue's to keep,
under the scheduler's lock. At its open the stream takes its ticket from the scheduler
(``StreamSetup.schedule``), handing itself down to it, and to its read-ahead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np

from batchwire.common.mixture import MixturePlan, split_ids
from batchwire.common.sampler import Plan, PlannedBatch
from batchwire.server.data.records import Records, StreamReadAhead
from batchwire.server.errors import Draining, InvalidRequest
from batchwire.server.runners import Batch, Job, StageTimes, batch_entropy, read_job
from batchwire.server.scheduling import StreamPort, Ticket

__all__ = ["Batch", "BatchStream", "share_batches", "wait_event"]

P = TypeVar("P")  # what the stream hands out for each batch (its encode's return)

_POLL_S = 0.25  # how often a stream waiting for requests or results checks for a drain


def share_batches(plan: Plan) -> range:
    """The indices of every batch of ``plan``'s share from its cursor on, in order
    (all lanes)."""
    if plan.start >= plan.share_size:
        return range(0)
    return range(plan.start // plan.batch_size, plan.num_batches)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamSetup:
    """What the engine gives a stream: its plan and output format, the scheduler's ticket
    for its batches (``schedule(stream)``), its read-ahead if any, the stage times its reads
    and encoding add to, its end (``release``) and a drain's notice."""

    dataset: Records
    plan: Plan
    normalized: bool
    layout: str
    schedule: Callable[[StreamPort], Ticket]
    ahead: StreamReadAhead | None
    stages: StageTimes
    release: Callable[[], None]
    draining: Callable[[], bool]
    # The dataset fields its pipeline takes (name, kind), read with each batch's records.
    inputs: tuple[tuple[str, str], ...] = ()


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether ``event`` is set within ``timeout`` seconds (None: no limit). Not
    ``asyncio.wait_for``: on Python 3.11 it loses a cancel of the waiting task that meets the
    event, and a stream's handler, a rescan or the unit follower would then not stop."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


class BatchStream(Generic[P]):
    """The batches one client asks for, each handed out as ``encode(batch)``, called on
    the pipeline's thread while the images are still in DALI's output buffer (so that
    they are copied once, into what it builds).

    Take its batches either with :meth:`next_async` on one event loop or by iteration
    from one thread; :meth:`close` may come from any thread.

    The stream is the one object its ticket and its read-ahead are given: the scheduler's
    slots read its batches (:meth:`read`) and finish them (:meth:`finish`), a
    :class:`StreamPort`; the read-ahead asks for the ids of those to come
    (:meth:`batch_ids`).
    """

    def __init__(
        self,
        setup: StreamSetup,
        encode: Callable[[Batch], P],
        batches: Sequence[int] | None = None,
    ) -> None:
        """``batches``: those asked for at open, with no more to come (else the client
        asks, :meth:`want`)."""
        self._setup = setup
        self._encode = encode
        self._planned: list[PlannedBatch] = []
        self._wants_ended = False
        self._wanted = asyncio.Event()  # set when the stream gets more to do
        self._failure: Exception | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.produced = 0  # batches handed out so far
        self._next_seq = 0  # the batch to hand out next, in the order asked
        self._ticket = setup.schedule(self)
        try:
            if batches is not None:
                self.want(batches)
                self.end_wants()
            self._ticket.start(0)
        except BaseException:
            self._ticket.close()
            raise
        if setup.ahead is not None:
            setup.ahead.follow(self)

    def read(self, seq: int) -> Job:
        """The job of batch ``seq``, its records read (on a slot's thread, as its pipeline
        asks for input): the ``read`` stage. The read-ahead learns which batch is read, and
        when it is, so that it advises the batches after it and frees what it held of it."""
        ahead = self._setup.ahead
        with self._setup.stages.timing("read"):
            if ahead is None:
                return self._job(seq)
            ahead.reading(seq)
            try:
                return self._job(seq)
            finally:
                ahead.read(seq)

    def _job(self, seq: int) -> Job:
        ids = self._planned[seq].ids
        plan = self._setup.plan
        entropy = batch_entropy(plan.seed, plan.epoch, ids)
        return read_job(self._setup.dataset, seq, ids, self._setup.inputs, entropy)

    def finish(self, batch: Batch) -> P:
        """What the stream hands out for ``batch``, a pipeline's run of its job: the batch
        with its place in the share and its format, encoded (the ``encode`` stage). Called
        on the pipeline's thread while the images are a view of DALI's output buffer, which
        the encoder copies, once, into what it builds."""
        planned = self._planned[batch.seq]
        plan = self._setup.plan
        source_counts: tuple[int, ...] = ()
        if isinstance(plan, MixturePlan):
            sources = split_ids(batch.ids, plan.sizes)[0]
            source_counts = tuple(np.bincount(sources, minlength=len(plan.sizes)).tolist())
        placed = dataclasses.replace(
            batch,
            index=planned.index,
            cursor=planned.end,
            num_batches=plan.num_batches,
            normalized=self._setup.normalized,
            layout=self._setup.layout,
            source_counts=source_counts,
        )
        with self._setup.stages.timing("encode"):
            return self._encode(placed)

    def batch_ids(self, seq: int) -> np.ndarray | None:
        """The ids of the stream's batch ``seq``, for reading ahead. Past the batches a
        pulling client asked for so far, a guess: the share's next batches in order, as
        clients ask; None past the share's end, or once nothing more will be asked for."""
        planned = self._planned
        if 0 <= seq < len(planned):
            return planned[seq].ids
        if not planned or self._wants_ended:
            return None
        index = planned[-1].index + seq - len(planned) + 1
        plan = self._setup.plan
        return plan.batch(index).ids if index < plan.num_batches else None

    @property
    def plan(self) -> Plan:
        return self._setup.plan

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting(self) -> int:
        """Batches asked for and not yet handed out."""
        return len(self._planned) - self._next_seq

    def want(self, indices: Sequence[int]) -> None:
        """Ask for batches ``indices`` of the share, after those asked for before.
        InvalidRequest refuses them (after :meth:`end_wants`, or not in the share)."""
        if self._wants_ended:
            raise InvalidRequest("batches asked for after the request stream was closed")
        try:
            planned = self._setup.plan.batches_at(indices)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        self._planned += planned
        self._ticket.extend(len(planned))
        self._wanted.set()

    def end_wants(self, failure: Exception | None = None) -> None:
        """Nothing more will be asked for (the stream ends once what was asked for is
        handed out), or the requests failed with ``failure`` (raised by
        :meth:`next_async`)."""
        self._wants_ended = True
        self._failure = self._failure or failure
        self._wanted.set()

    def _ready(self) -> bool | None:
        """True: the next batch was asked for; None: the stream is over; False: it waits
        for requests. Raises a drain or the requests' failure."""
        if self._failure is not None:
            raise self._failure
        done = self._next_seq >= len(self._planned)
        if self._closed or self._stop.is_set() or (done and self._wants_ended):
            return None
        if self._setup.draining():
            # End between batches, so the client resumes from its cursor elsewhere.
            raise Draining("the server is shutting down; resume the stream on another server")
        return not done

    def _took(self, encoded: P | None) -> P | None:
        if encoded is None:  # closed
            return None
        self._next_seq += 1
        self.produced += 1
        self._ticket.more()
        return encoded

    async def next_async(self) -> P | None:
        """The next batch, awaited on the event loop; None at the end or once closed."""
        while not (ready := self._ready()):
            if ready is None:
                return None
            # More is asked for, or the asking ends; a drain or close is seen within the
            # poll even while nothing is asked.
            self._wanted.clear()
            await wait_event(self._wanted, _POLL_S)
        return self._took(await asyncio.wrap_future(self._ticket.future(self._next_seq)))

    def __iter__(self) -> BatchStream[P]:
        return self

    def __next__(self) -> P:
        """The next batch, waited for in the calling thread (a stream whose batches were
        all asked for)."""
        with self._lock:
            ready = self._ready()
            if ready is None:
                raise StopIteration
            if not ready:
                raise RuntimeError("iterate a stream whose batches were all asked for")
            future = self._ticket.future(self._next_seq)
            while True:
                try:
                    result = future.result(_POLL_S)
                    break
                except concurrent.futures.TimeoutError:
                    if self._stop.is_set():
                        raise StopIteration from None
            output = self._took(result)
            if output is None:
                raise StopIteration
            return output

    def close(self) -> None:
        """Stop; what was asked of the pipelines and not yet run is dropped. Idempotent."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ticket.close()
            self._setup.release()
