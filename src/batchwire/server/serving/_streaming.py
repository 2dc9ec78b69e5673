"""Serving one opened stream: its batches encoded into messages (:func:`encode_parts`) and
written until its end, its end status, and its metrics; its start and end log lines are
``_stream_logs``'s.

Blocking work (LMDB reads, DALI runs, building messages) runs on the server's pipelines;
the event loop only awaits it and writes to the wire, so a slow client holds back only
its own stream (it asks for a few batches ahead of those written, no more).

A client that cancels its stream (or closes its channel, or exits) is normal
operation: the stream ends with one INFO line, ``status=CANCELLED``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import numpy as np

from batchwire.common.batch_codec import encode_batch, images_head
from batchwire.common.stream import StreamSpec
from batchwire.common.tensors import to_proto
from batchwire.server.engine import Batch, BatchStream
from batchwire.server.serving._messages import Lane, status_for
from batchwire.server.serving._metrics import ServerMetrics
from batchwire.server.serving._stream_logs import log_end, log_start
from batchwire.server.serving._stream_times import StreamClock
from batchwire.v1 import batchwire_pb2 as pb

__all__ = [
    "EncodedBatch",
    "StreamMetrics",
    "batch_header",
    "encode_elsewhere",
    "encode_parts",
    "serve_stream",
    "write",
]


# How long a stream whose write failed waits for gRPC to report the client gone (see write).
_HANGUP_NOTICE_S = 5.0


@dataclasses.dataclass(frozen=True)
class EncodedBatch:
    """One batch as the Batch messages that carry it (several parts if large)."""

    messages: list[bytes]
    samples: int
    nbytes: int
    skipped: int = 0  # samples left out of the batch (undecodable)
    shared: int = 0  # bytes of images in shared memory, not in the messages
    # The images, flat, to send on the stream's bulk connection after the messages.
    bulk: np.ndarray | None = None
    source_counts: tuple[int, ...] = ()  # a mixture's: samples of each source


def encode_parts(batch: Batch, max_message_bytes: int) -> EncodedBatch:
    """Batch message bytes, split into parts of at most ``max_message_bytes`` of
    images each (at least one sample per part); each image byte is copied once."""
    total, images = len(batch.ids), batch.images
    if not isinstance(images, np.ndarray):  # named outputs' payload: one part (Batch.outputs)
        header = batch_header(batch, slice(None), 0, 1)
        messages = [encode_batch(header, images, "")]
    else:
        step = max(1, max_message_bytes // max(1, images[:1].nbytes))
        parts = max(1, -(-total // step))
        messages = []
        for part in range(parts):
            lo, hi = part * step, min(total, (part + 1) * step)
            header = batch_header(batch, slice(lo, hi), part, parts)
            messages.append(encode_batch(header, images[lo:hi], batch.layout))
    return EncodedBatch(
        messages,
        total,
        sum(len(m) for m in messages),
        skipped=len(batch.skipped_ids),
        source_counts=batch.source_counts,
    )


def encode_elsewhere(
    batch: Batch, shared: pb.SharedImages | None = None, bulk: np.ndarray | None = None
) -> EncodedBatch:
    """``batch`` as one message whose images are not in it: in shared memory where
    ``shared`` says, or next on the stream's bulk connection (``bulk``, copied there)."""
    images = batch.images
    header = batch_header(batch, slice(None), 0, 1)
    header.images.CopyFrom(images_head(images, "" if batch.outputs else batch.layout))
    if shared is not None:
        header.shared_images.CopyFrom(shared)
    if bulk is not None:
        header.bulk_images.length = images.nbytes
    message = header.SerializeToString()
    return EncodedBatch(
        [message],
        len(batch.ids),
        len(message),
        skipped=len(batch.skipped_ids),
        shared=images.nbytes if shared is not None else 0,
        bulk=bulk,
        source_counts=batch.source_counts,
    )


def batch_header(batch: Batch, samples: slice, part: int, parts: int) -> pb.Batch:
    """The Batch message of part ``part`` of ``parts`` (its ``samples``), but its images."""
    last = part == parts - 1
    return pb.Batch(
        index=batch.index,
        ids=batch.ids[samples].tolist(),
        labels=to_proto("labels", batch.labels[samples], "N"),
        cursor=batch.cursor if last else 0,
        skipped_ids=batch.skipped_ids if last else (),
        normalized=batch.normalized,
        num_batches=batch.num_batches,
        part=part,
        parts=parts,
        samples=len(batch.ids),
        outputs=batch.outputs,
    )


async def write(context: grpc.aio.ServicerContext, message: bytes) -> None:
    """Write one message of a stream; returns once gRPC has taken it.

    A write fails (``grpc.aio.InternalError``) when the call ended under it, nearly
    always because the client went away mid-message; gRPC reports that a moment later
    by cancelling the handler's task. The write waits for that cancellation: raised
    first, gRPC would log the failure at ERROR with a traceback. A failed write that
    no cancellation follows is a real error and is raised.
    """
    try:
        await context.write(message)
    except grpc.aio.InternalError:
        await asyncio.sleep(_HANGUP_NOTICE_S)  # cancelled here when the client went away
        raise


@dataclasses.dataclass
class _Progress:
    """What a stream has handed to gRPC so far; its end line reports it."""

    sent: int = 0  # samples
    batches: int = 0
    # The share's last message is being handed over: a client that hangs up now has
    # had every batch.
    last_write: bool = False


class StreamMetrics:
    """The metrics of one stream, bound to its dataset and pipeline labels (a mixture's
    dataset label is its ``sources``' names joined by "+"; each source counts its own
    samples and batches too)."""

    def __init__(
        self, metrics: ServerMetrics, dataset: str, pipeline: str, sources: Sequence[str] = ()
    ) -> None:
        labels = {"dataset": dataset, "pipeline": pipeline}
        self._source_samples = [
            metrics.source_samples_sent.labels(dataset=name, pipeline=pipeline) for name in sources
        ]
        self._source_batches = [
            metrics.source_batches_sent.labels(dataset=name, pipeline=pipeline) for name in sources
        ]
        self._ended = metrics.streams_ended
        self._labels = labels
        self._active = metrics.active_streams.labels(**labels)
        self._started = metrics.streams_started.labels(**labels)
        self._batches = metrics.batches_sent.labels(**labels)
        self._samples = metrics.samples_sent.labels(**labels)
        self._bytes = metrics.bytes_sent.labels(**labels)
        self._shared = metrics.shared_memory_bytes.labels(**labels)
        self._bulk = metrics.bulk_bytes.labels(**labels)
        self._skipped = metrics.skipped_samples.labels(**labels)
        self._skipped_batches = metrics.batches_with_skipped.labels(**labels)
        self._pipeline = metrics.pipeline_seconds.labels(**labels)
        self._wait = metrics.client_wait_seconds.labels(**labels)

    def opened(self) -> None:
        self._started.inc()
        self._active.inc()

    def closed(self, status: str) -> None:
        """The stream ended with ``status`` (a ``grpc.StatusCode`` name)."""
        self._active.dec()
        self._ended.labels(**self._labels, status=status).inc()

    def produced(self, seconds: float, skipped: int) -> None:
        """A batch was computed in ``seconds``, leaving out ``skipped`` samples."""
        self._pipeline.observe(seconds)
        if skipped:
            self._skipped.inc(skipped)
            self._skipped_batches.inc()

    def sent(self, encoded: EncodedBatch) -> None:
        """A batch was handed to gRPC: its samples, its messages' bytes, its images'
        bytes in shared memory or on the bulk connection if not in the messages, and a
        mixture's samples of each source."""
        self._batches.inc()
        self._samples.inc(encoded.samples)
        self._bytes.inc(encoded.nbytes)
        if encoded.shared:
            self._shared.inc(encoded.shared)
        if encoded.bulk is not None:
            self._bulk.inc(len(encoded.bulk))
        source_counts = encoded.source_counts
        for count, source_samples, source_batches in zip(
            source_counts, self._source_samples, self._source_batches, strict=False
        ):
            if count:
                source_samples.inc(count)
                source_batches.inc()

    def waited(self, seconds: float) -> None:
        """gRPC took a batch's messages after ``seconds`` (flow control: a slow client)."""
        self._wait.observe(seconds)


async def serve_stream(
    stream: BatchStream[EncodedBatch],
    spec: StreamSpec,
    context: grpc.aio.ServicerContext,
    executor: concurrent.futures.ThreadPoolExecutor,
    server_metrics: ServerMetrics,
    lane: Lane | None,
    *,
    shared_memory: bool = False,
    bulk: Callable[[np.ndarray], Awaitable[None]] | None = None,
    metadata: Sequence[tuple[str, str | bytes]] = (),
    clock: StreamClock | None = None,
) -> None:
    """Write the stream's batches until its end, and close it: the batches of ``lane``
    (asked for as the stream opened), or, with None, a pulled stream's (its client asks
    as it goes, and half-closes when done). An error is raised once the stream is closed
    and its end logged. Writes with context.write rather than yielding: a client's
    hang-up then reaches this handler (as CancelledError, see write) instead of gRPC's
    write loop, and this handler's cleanup runs in its own task rather than when an
    abandoned generator is garbage-collected. A pulled stream's initial metadata is
    ``metadata`` (grants of shared memory, with ``shared_memory``, and of a bulk
    connection, whose ``bulk`` sends a batch's images there once its message is written).
    ``clock`` times the stream's waits (a pulled stream's, made when it opened, which its
    requests tell when batches are asked for); closed here."""
    loop = asyncio.get_running_loop()
    pulled = lane is None
    expected = None if pulled else stream.waiting
    fields = log_start(spec, context.peer(), lane, shared_memory, bulk is not None)
    sources = [source.dataset for source in spec.sources]
    metrics = StreamMetrics(server_metrics, spec.name, spec.pipeline, sources)
    metrics.opened()
    if clock is None:
        clock = server_metrics.stream_times.clock(spec.name, spec.pipeline)
    progress = _Progress()
    status = "CANCELLED"  # unless the loop ends otherwise: the client went away
    started = time.monotonic()
    try:
        if pulled:
            # Tells the client the stream is open, so it asks this server for batches
            # only now: a server that is down or refuses never holds any. Inside the
            # try: a client gone by now still gets its stream closed below.
            await context.send_initial_metadata(metadata)
        await _write_batches(stream, context, metrics, clock, expected, progress, bulk)
        status = "OK"
    except Exception as exc:  # the handler's decorator ends the call with its status
        status = status_for(exc).name
        raise
    finally:
        if status == "CANCELLED" and progress.last_write:
            status = "OK"  # the client had every batch and hung up before the end
        metrics.closed(status)
        clock.close()
        log_end(fields, spec, progress.sent, progress.batches, time.monotonic() - started, status)
        # Runs on cancellation too: the pipeline drains and returns to the pool. A
        # cancellation arriving during this await ends the handler here (the shielded
        # close goes on), so everything else is done before it.
        await asyncio.shield(loop.run_in_executor(executor, stream.close))


async def _write_batches(
    stream: BatchStream[EncodedBatch],
    context: grpc.aio.ServicerContext,
    metrics: StreamMetrics,
    clock: StreamClock,
    expected: int | None,
    progress: _Progress,
    bulk: Callable[[np.ndarray], Awaitable[None]] | None,
) -> None:
    """Compute and write the stream's batches until it has no more (a batch's images
    that go on the bulk connection, there after its message)."""
    while True:
        computing = time.perf_counter()
        # The client waits on this server from now, if it asked for a batch, until the
        # batch is here: the measure of trainers waiting (batchwire_stream_waiting_seconds).
        clock.awaiting(stream.waiting > 0)
        try:
            # The stream hands out its batches encoded (encode_parts, given when it was
            # opened), their images copied once, from DALI's buffer into the messages.
            encoded = await stream.next_async()
        finally:
            clock.took()
        if encoded is None:
            return
        metrics.produced(time.perf_counter() - computing, encoded.skipped)
        # Counted when handed to gRPC: a client can hold the batch (and hang up)
        # before this handler resumes after its last write.
        progress.sent += encoded.samples
        progress.batches += 1
        metrics.sent(encoded)
        waited = 0.0  # each write returns once gRPC has taken the message
        try:
            for part, message in enumerate(encoded.messages):
                writing = time.perf_counter()
                last_part = part == len(encoded.messages) - 1 and encoded.bulk is None
                progress.last_write = progress.batches == expected and last_part
                await write(context, message)
                waited += time.perf_counter() - writing
            if encoded.bulk is not None:
                assert bulk is not None  # only a stream with a bulk link encodes for one
                writing = time.perf_counter()
                progress.last_write = progress.batches == expected
                await bulk(encoded.bulk)
                waited += time.perf_counter() - writing
        finally:
            # Also when the client hangs up before this handler resumes after
            # the batch's last message, as the batch is counted sent above.
            metrics.waited(waited)
