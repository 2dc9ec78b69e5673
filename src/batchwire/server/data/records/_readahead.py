"""Read-ahead: the records streams will read next, brought into the page cache before them.

A stream reads its batches' records in order (``Dataset.read``); from a cold page cache
a batch costs at least a disk latency (``Dataset.read`` asks for a batch's missing
records together, then waits), and a stream waits for it batch after batch. So the
server asks the disk for the records of the next batches of every open stream ahead of
time, many at once: a pool of ``reads`` threads, each taking a batch of a stream (a
stream's batches one at a time and in order, so that the one waiting for room is always its
next), finds where the batch's records lie in their shards' files (:meth:`Dataset.locate`,
from the shards' B-tree pages, without reading a record) and advises the kernel
(``posix_fadvise(POSIX_FADV_WILLNEED)``) to read those bytes, which queues their reads
and returns. When the stream comes to those records their pages are in the page cache,
or on their way. A batch is one task (one look-up, a few acquisitions of the pool's lock):
with a task per record, its threads took the interpreter lock from the streams' reads for
each record, and on a quick disk cost more than they saved (docs/performance.md).
(Threads that looked records up through py-lmdb and touched or ``madvise``-d their pages
read each record in, page by page, before going on: measured slower, see
docs/performance.md.)

The pool is one per server, shared by every stream. It is bounded in bytes: the records
advised and not yet read by their stream hold at most ``max_bytes`` (a single batch
larger than the bound alone excepted), and each stream at most an equal share of it, so a
stream whose client is slow cannot crowd out the others; among the streams with records
to advise, the one holding the fewest bytes goes first. A stream's read-ahead ends when
the stream closes (:meth:`StreamReadAhead.close`): what it had not advised is dropped and
what it held is freed.

Reading ahead never changes what a stream reads, only when its pages arrive: the records
still come from ``Dataset.read``, in the stream's order.

A stream reads ahead only while its reads wait for the disk long enough to hold it back,
and only the batches after the one it reads (that read asks for its own batch's missing
records at once, :meth:`Dataset.read`). It starts by advising its first
``_FIRST_BATCHES``; from then on it advises up to a horizon of batches past the last batch
whose read was held back: it waited for the disk (``Dataset.waited``) for more than
``_HELD_BACK`` of the stream's time between batches (averaged). The horizon doubles (up
to ``_MAX_HORIZON``) with each read held back, advised or not (an advised read that still
waits that long was not advised far enough ahead), and halves (down to
``_FIRST_BATCHES``) with each read past it that was not, so that a disk's rare slow read
does not keep a stream reading ahead for good. A read that waits less is hidden behind
the pipeline's run of the batches before it (DALI asks for its input ahead): on a fast
disk, advising every batch only took CPU from the decoders (docs/performance.md). Where
the dataset sits in the page cache, a stream's reads never wait and its read-ahead stays
idle: its bookkeeping, when it took a record at a time, cost a quarter of the rate of
small images from memory.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from batchwire.server.data.records._dataset import advise
from batchwire.server.data.records._mixed import Records

__all__ = ["BatchIds", "ReadAhead", "ReadAheadStats", "StreamReadAhead"]

log = logging.getLogger(__name__)

_WAIT_S = 0.25  # how often an idle read-ahead thread looks for a stop
_FIRST_BATCHES = 4  # a stream's first batches are read ahead whatever the cache holds
_MAX_HORIZON = 64  # batches read ahead, at most, past a read that waited for the disk
# A read holds its stream back, and the batches after it are read ahead, where it waited
# for the disk for more than this share of the stream's time between batches.
_HELD_BACK = 0.5
_PACE_WEIGHT = 1 / 8  # of the newest interval between a stream's reads, in their average
_CLOSE_WAIT_S = 10.0  # how long a closing stream waits for its records being advised


@dataclasses.dataclass(frozen=True)
class ReadAheadStats:
    """What the read-ahead did, for metrics and tests: totals since the server started,
    and the state now."""

    records: int  # records advised
    bytes: int  # their bytes
    dropped: int  # records of batches a stream closed or read before they were advised
    seconds: float  # thread seconds spent looking up and advising
    streams: int  # streams reading ahead now
    held_bytes: int  # bytes advised and not yet read by their streams
    peak_held_bytes: int  # the most held at any time
    in_flight: int  # records being looked up or advised now


class BatchIds(Protocol):
    """A stream, as its read-ahead sees it (:meth:`StreamReadAhead.follow`)."""

    def batch_ids(self, seq: int) -> np.ndarray | None:
        """The ids of the stream's batch ``seq``; None past those planned so far (a pulled
        stream plans more as its client asks). Called under the read-ahead pool's lock."""
        ...


class StreamReadAhead:
    """One stream's read-ahead: made by :meth:`ReadAhead.open`, ended by :meth:`close`.

    It reads ahead the batches of the stream it follows (:meth:`follow`); the stream tells
    it which batch it reads as it reads each (:meth:`reading`, then :meth:`read`).
    """

    def __init__(self, pool: ReadAhead, dataset: Records) -> None:
        self._pool = pool
        self._dataset = dataset
        self._stream: BatchIds | None = None
        self.next_seq = 0  # the batch to advise next
        self.read_seq = -1  # batches up to this one are read (their bytes freed)
        self.held: dict[int, int] = {}  # bytes advised and not yet read, by batch
        self.held_bytes = 0
        self.records = 0  # records advised
        self.in_flight = 0
        self.closed = False
        self.advise_until = _FIRST_BATCHES - 1  # the last batch to advise for now
        self.horizon = _FIRST_BATCHES
        self.pace = 0.0  # seconds between the starts of the stream's reads, averaged
        self._began = -1.0  # when the read before began (perf_counter)
        self._waited_before = -1.0  # the reading thread's Dataset.waited as the read began

    def follow(self, stream: BatchIds) -> None:
        """Read ahead the batches of ``stream``, from the first not yet read."""
        with self._pool.lock:
            self._stream = stream
            self._pool.lock.notify_all()

    def reading(self, seq: int) -> None:
        """Batch ``seq`` is being read now, in the calling thread: advise the batches after
        it, never it (its read asks for its missing records itself) or what came before."""
        now = time.perf_counter()
        with self._pool.lock:
            self.next_seq = max(self.next_seq, seq + 1)
            if self._began >= 0:
                interval = now - self._began
                self.pace += (interval - self.pace) * (_PACE_WEIGHT if self.pace else 1.0)
            self._began = now
            self._waited_before = self._dataset.waited
            if self._advisable():
                self._pool.lock.notify_all()

    def read(self, seq: int) -> None:
        """Batches up to ``seq`` were read (in the thread that said :meth:`reading`): what
        was advised of them is freed. Where the read waited for the disk long enough to
        hold the stream back, the batches after it are advised."""
        with self._pool.lock:
            if self._waited_before >= 0:
                waited = self._dataset.waited - self._waited_before
                if self.pace and waited >= _HELD_BACK * self.pace:  # held back (pace known)
                    self.horizon = min(_MAX_HORIZON, self.horizon * 2)
                    self.advise_until = max(self.advise_until, seq + self.horizon)
                elif seq > self.advise_until:  # read without advice, and not held back
                    self.horizon = max(_FIRST_BATCHES, self.horizon // 2)
            self._waited_before = -1.0
            self.read_seq = max(self.read_seq, seq)
            freed = [self.held.pop(done) for done in [s for s in self.held if s <= seq]]
            for size in freed:
                self._pool.free(self, size)
            # The pool's threads wait for records to advise, for room, or for a record of
            # theirs to be read: woken only where one of those changed, so that a stream
            # read from the page cache costs them nothing.
            if freed or self.in_flight or self._advisable():
                self._pool.lock.notify_all()

    def _advisable(self) -> bool:
        """Whether this stream has records to advise now (under the pool's lock)."""
        return not self.closed and self.next_seq <= self.advise_until

    def close(self) -> None:
        """End this stream's read-ahead: nothing more is advised, what it holds is freed.
        Returns once no thread is advising its records (its dataset may be closed next).
        Idempotent."""
        self._pool.close_stream(self)

    def next_batch(self) -> tuple[int, np.ndarray] | None:
        """(seq, ids) of the batch to advise next, the cursor moved past it; None if none
        is to be advised now. Called under the pool's lock."""
        if not self._advisable() or self._stream is None:
            return None
        try:
            ids = self._stream.batch_ids(self.next_seq)
        except Exception:  # a stream's plan that cannot say; never the pool's thread
            log.debug("no ids for batch %d to read ahead", self.next_seq, exc_info=True)
            return None
        if ids is None:
            return None
        self.next_seq += 1
        return self.next_seq - 1, ids

    def locate(self, ids: np.ndarray) -> list[tuple[int, int, int]]:
        return self._dataset.locate(ids)


class ReadAhead:
    """The server's read-ahead: ``reads`` threads advising the records of every open
    stream's next batches, at most ``max_bytes`` held. ``on_seconds`` is called with the
    seconds each batch took (the server adds them to its ``read`` stage)."""

    def __init__(
        self, *, reads: int, max_bytes: int, on_seconds: Callable[[float], None] | None = None
    ) -> None:
        if reads < 1 or max_bytes < 1:
            raise ValueError("reads and max_bytes must be at least 1")
        self.max_bytes = max_bytes
        self.lock = threading.Condition()
        self._on_seconds = on_seconds
        self._streams: list[StreamReadAhead] = []
        self._turn = 0  # rotates ties among the streams holding the fewest bytes
        self._held = self._peak = self._records = self._bytes = self._dropped = 0
        self._in_flight = 0
        self._seconds = 0.0
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._work, name=f"batchwire-readahead-{i}", daemon=True)
            for i in range(reads)
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def sized(
        cls, reads: int, mib: int, on_seconds: Callable[[float], None] | None = None
    ) -> ReadAhead | None:
        """A read-ahead of ``reads`` threads and ``mib`` MiB; None where ``reads`` is 0
        (each record is then read when its batch is)."""
        return cls(reads=reads, max_bytes=mib << 20, on_seconds=on_seconds) if reads else None

    def open(self, dataset: Records) -> StreamReadAhead:
        """A stream's read-ahead over ``dataset``; :meth:`StreamReadAhead.close` it."""
        stream = StreamReadAhead(self, dataset)
        with self.lock:
            self._streams.append(stream)
        return stream

    def stats(self) -> ReadAheadStats:
        with self.lock:
            return ReadAheadStats(
                records=self._records,
                bytes=self._bytes,
                dropped=self._dropped,
                seconds=self._seconds,
                streams=len(self._streams),
                held_bytes=self._held,
                peak_held_bytes=self._peak,
                in_flight=self._in_flight,
            )

    def free(self, stream: StreamReadAhead, size: int) -> None:
        """``size`` bytes of ``stream`` are no longer held (under the lock)."""
        stream.held_bytes -= size
        self._held -= size

    def close_stream(self, stream: StreamReadAhead) -> None:
        deadline = time.monotonic() + _CLOSE_WAIT_S
        with self.lock:
            stream.closed = True
            if stream in self._streams:
                self._streams.remove(stream)
            for size in stream.held.values():
                self.free(stream, size)
            stream.held.clear()
            self.lock.notify_all()
            while stream.in_flight and time.monotonic() < deadline:
                self.lock.wait(_WAIT_S)
            if stream.in_flight:
                log.warning(
                    "a stream's read-ahead still advised records %.0f s after it closed",
                    _CLOSE_WAIT_S,
                )

    def close(self) -> None:
        """Stop the threads (streams still open stop reading ahead)."""
        with self.lock:
            self._stopped = True
            self.lock.notify_all()
        for thread in self._threads:
            thread.join(_CLOSE_WAIT_S)

    # -- the threads -------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self.lock:
                task = self._next()
                while task is None:
                    if self._stopped:
                        return
                    self.lock.wait(_WAIT_S)
                    task = self._next()
                stream, seq, ids = task
                stream.in_flight += len(ids)
                self._in_flight += len(ids)
            started = time.perf_counter()
            try:
                self._advise(stream, seq, ids)
            except Exception:  # records the stream will find bad itself; never the thread
                log.debug("read-ahead of batch %d failed", seq, exc_info=True)
            finally:
                seconds = time.perf_counter() - started
                with self.lock:
                    stream.in_flight -= len(ids)
                    self._in_flight -= len(ids)
                    self._seconds += seconds
                    if stream.closed and not stream.in_flight:
                        self.lock.notify_all()  # its close waits for this
                if self._on_seconds is not None:
                    self._on_seconds(seconds)

    def _next(self) -> tuple[StreamReadAhead, int, np.ndarray] | None:
        """The next batch to advise (under the lock): of the stream holding the fewest
        bytes among those below their share and with no batch being advised, ties taken
        in turn."""
        if self._stopped or not self._streams or self._held >= self.max_bytes:
            return None
        share = self.max_bytes // len(self._streams)
        count = len(self._streams)
        order = sorted(
            range(count), key=lambda i: (self._streams[i].held_bytes, (i - self._turn) % count)
        )
        for index in order:
            stream = self._streams[index]
            if stream.held_bytes >= share and stream.held_bytes > 0:
                break  # the rest hold as much or more
            if stream.in_flight:
                continue  # a batch at a time: a stream's batches are held in its order
            batch = stream.next_batch()
            if batch is not None:
                self._turn = (index + 1) % count
                return stream, batch[0], batch[1]
        return None

    def _advise(self, stream: StreamReadAhead, seq: int, ids: np.ndarray) -> None:
        spans = stream.locate(ids)  # the shards' indexes, outside the lock
        if not spans:
            return  # missing: the stream's read reports them
        size = sum(length for _, _, length in spans)
        with self.lock:
            # The bound holds before the reads are started: wait for room (a batch larger
            # than the whole bound goes alone).
            while self._held and self._held + size > self.max_bytes and self._live(stream, seq):
                self.lock.wait(_WAIT_S)
            if not self._live(stream, seq):
                self._dropped += len(spans)
                return
            stream.held[seq] = size  # a batch is advised once: next_seq only moves on
            stream.held_bytes += size
            self._held += size
            self._peak = max(self._peak, self._held)
            self._records += len(spans)
            stream.records += len(spans)
            self._bytes += size
        for fd, offset, length in spans:
            if not self._live(stream, seq):  # read or closed meanwhile: the rest is late
                break
            advise(fd, offset, length)

    def _live(self, stream: StreamReadAhead, seq: int) -> bool:
        """Whether ``stream``'s batch ``seq`` is still worth advising (read without the
        lock between a batch's records: a stale answer costs one record's advice)."""
        return not (self._stopped or stream.closed or seq <= stream.read_seq)
