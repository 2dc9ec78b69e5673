"""The batches of one stream, computed by the server's pipelines.

A stream runs its plan's batches in order on the scheduler's pipelines, or on a pipeline of
its own whose records are read in worker processes (falling back to the scheduler's from
the batch where that fails). A pulled stream runs the batches its client asks for instead,
and is awaited on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from batchwire.common.sampler import Plan
from batchwire.server.core._errors import Draining, InvalidRequest, OverCapacity
from batchwire.server.core._jobs import Job, Result, read_job
from batchwire.server.core._parallel import ParallelRunner
from batchwire.server.core._ticket import Ticket
from batchwire.server.data._dataset import Dataset

__all__ = ["MAX_PULL_AHEAD", "Batch", "BatchStream"]

# Batches a pulling client may have asked for and not yet received, per stream.
MAX_PULL_AHEAD = 1024
_WANT_POLL_S = 0.25  # how often a pulled stream waiting for requests checks for a drain


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of a stream; arrays own their memory."""

    index: int
    ids: np.ndarray
    images: np.ndarray
    labels: np.ndarray
    cursor: int
    skipped_ids: tuple[int, ...]
    normalized: bool
    num_batches: int
    layout: str


class BatchStream:
    """The batches of one request, computed by the server's pipelines (``Scheduler``).

    Iterate it from one thread; :meth:`close` may come from another thread and
    waits for a batch in progress.
    """

    def __init__(
        self,
        release: Callable[[], None],
        draining: Callable[[], bool],
        dataset: Dataset,
        plan: Plan,
        schedule: Callable[[int, Callable[[int], Job]], Ticket],
        normalized: bool,
        layout: str,
        parallel: Callable[[list[np.ndarray]], ParallelRunner] | None = None,
        pull: bool = False,
        encode: Callable[[Batch], Any] | None = None,
    ) -> None:
        self._release = release
        self._draining = draining
        self._dataset = dataset
        self._plan = plan
        self._schedule = schedule
        self._normalized = normalized
        self._layout = layout
        # With ``encode``, the stream yields what it returns for each batch, built on the
        # pipeline's thread while the images are still in DALI's buffer (Job.finish).
        self._encode = encode
        # A pulled stream's batches are those its client asks for (want), in that order.
        self.pull = pull
        self._planned = [] if pull else list(plan.batches())
        self._wants_ended = not pull
        self._wanted = asyncio.Event()  # set when a pulled stream gets more to do
        self._failure: Exception | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self.produced = 0  # batches handed to the servicer so far
        # The requests to the server's pipelines: from the start, or from the batch where
        # a pipeline reading in worker processes failed.
        self._ticket: Ticket | None = None
        self._next_seq = 0  # with next_async: the batch to hand out next
        if parallel is None or pull:
            self._ticket = self._schedule(len(self._planned), self._read)
            self._ticket.start(0)
            self._results = self._inline(0)
        else:
            self._results = parallel([p.ids for p in self._planned]).run(self._inline)
        self.awaitable = self._ticket is not None

    def _inline(self, first: int) -> Generator[Result, None, None]:
        ticket = self._ticket
        if ticket is None:  # the fallback of a stream read by worker processes
            ticket = self._ticket = self._schedule(len(self._planned), self._read)
            ticket.start(first)
        for seq in range(first, len(self._planned)):
            result = ticket.take(seq, self._stop)
            if result is None:
                return
            yield result

    def _read(self, seq: int) -> Job:
        job = read_job(self._dataset, seq, self._planned[seq].ids)
        if self._encode is not None:
            job.finish = functools.partial(self._finish, seq)
        return job

    def _finish(self, seq: int, result: Result) -> Any:
        # The pipelines number their jobs their own way: the stream's is ``seq``.
        assert self._encode is not None
        return self._encode(self._batch(dataclasses.replace(result, seq=seq)))

    def _output(self, result: Result) -> Any:
        """What the stream yields for ``result``: its Batch, or that Batch encoded."""
        if result.payload is not None:
            return result.payload
        batch = self._batch(result)
        return batch if self._encode is None else self._encode(batch)

    def batch_ids(self, seq: int) -> np.ndarray | None:
        """The ids of the stream's batch ``seq``, for reading ahead. Past the batches a
        pulling client asked for so far, a guess: the share's next batches in order, as
        clients ask; None past the share's end."""
        if seq < len(self._planned) or not self._planned:
            return self._planned[seq].ids if 0 <= seq < len(self._planned) else None
        index = self._planned[-1].index + seq - len(self._planned) + 1
        return self._plan.batch(index).ids if self.pull and index < self._plan.num_batches else None

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def closed(self) -> bool:
        return self._closed

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._closed or self._stop.is_set():
                raise StopIteration
            if self._draining():
                # End between batches, so the client resumes from its cursor elsewhere.
                raise Draining("the server is shutting down; resume the stream on another server")
            result = next(self._results)
            self.produced += 1
            return self._output(result)

    def want(self, indices: Sequence[int]) -> None:
        """A pulling client asks for batches ``indices`` of the share, after those it asked
        for before. Called on the event loop; InvalidRequest or OverCapacity refuse them."""
        assert self.pull and self._ticket is not None
        if self._wants_ended:
            raise InvalidRequest("batches asked for after the request stream was closed")
        waiting = len(self._planned) - self._next_seq + len(indices)
        if waiting > MAX_PULL_AHEAD:
            raise OverCapacity(
                f"{waiting} batches asked for and not yet sent; a stream may hold at most "
                f"{MAX_PULL_AHEAD}: ask for more as batches arrive"
            )
        try:
            planned = [self._plan.batch(index) for index in indices]
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        self._planned += planned
        self._ticket.extend(len(planned))
        self._wanted.set()

    def end_wants(self, failure: Exception | None = None) -> None:
        """The client asks for nothing more (the stream ends once what it asked for is
        sent), or its requests failed with ``failure`` (raised by :meth:`next_async`)."""
        self._wants_ended = True
        self._failure = self._failure or failure
        self._wanted.set()

    async def next_async(self) -> Any:
        """The next batch, awaited on the event loop; None at the end or once closed.
        Only for a stream whose ``awaitable`` is true (its batches come from the server's
        pipelines, not from worker processes), and not mixed with iteration."""
        ticket = self._ticket
        assert ticket is not None and self.awaitable
        while True:
            if self._failure is not None:
                raise self._failure
            done = self._next_seq >= len(self._planned)
            if self._closed or self._stop.is_set() or (done and self._wants_ended):
                return None
            if self._draining():
                raise Draining("the server is shutting down; resume the stream on another server")
            if not done:
                break
            # A pulling client asks for more, or ends; a drain or close is seen within
            # the poll even while it asks for nothing.
            self._wanted.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), _WANT_POLL_S)
        result = await asyncio.wrap_future(ticket.future(self._next_seq))
        if result is None:
            return None
        self._next_seq += 1
        self.produced += 1
        ticket.more()
        return self._output(result)

    def _batch(self, result: Result) -> Batch:
        planned = self._planned[result.seq]
        return Batch(
            index=planned.index,
            ids=result.ids,
            images=result.images,
            labels=result.labels,
            cursor=planned.end,
            skipped_ids=result.skipped,
            normalized=self._normalized,
            num_batches=self._plan.num_batches,
            layout=self._layout,
        )

    def close(self) -> None:
        """Stop; what was asked of the pipelines and not yet run is dropped. Idempotent."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._results.close()
            if self._ticket is not None:
                self._ticket.close()
            self._release()
