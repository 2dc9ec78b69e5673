"""The gRPC face of the engine: converts messages and maps errors to status codes.

Blocking work (LMDB reads, DALI runs, building messages) runs on a bounded
thread pool; the event loop only awaits it and writes to the wire, so a slow
client holds back only its own stream (the next batch is not computed until
the previous one is written).

A client that cancels its stream (or closes its channel, or exits) is normal
operation: the stream ends with one INFO line, ``status=CANCELLED``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from batchwire.common.batch_codec import encode_batch
from batchwire.common.stream import StreamSpec, output_format
from batchwire.common.stream import check_name as check_spec_name
from batchwire.common.tensors import to_proto
from batchwire.server.core._engine import DatasetSummary, Engine
from batchwire.server.core._errors import (
    Draining,
    InvalidRequest,
    NotFound,
    OverCapacity,
    ServiceError,
)
from batchwire.server.core._preprocess_request import PreprocessRequest, PreprocessResult
from batchwire.server.core._stream import Batch, BatchStream
from batchwire.server.data._dataset import DatasetError
from batchwire.server.serving._metrics import ServerMetrics
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

__all__ = ["BatchwireServicer"]

log = logging.getLogger(__name__)

# Domain error -> status code: the one place where the mapping lives.
STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    NotFound: grpc.StatusCode.NOT_FOUND,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    OverCapacity: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    DatasetError: grpc.StatusCode.DATA_LOSS,
}

# How long a stream whose write failed waits for gRPC to report the client gone (see write).
_HANGUP_NOTICE_S = 5.0


def status_for(exc: Exception) -> grpc.StatusCode:
    for kind, code in STATUS_CODES.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


class Malformed:
    """What a request that does not parse as its message becomes (see ``add_to_server``)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def check_message(request: Message | Malformed) -> None:
    """A request must parse and carry only fields this server knows."""
    if isinstance(request, Malformed):
        raise InvalidRequest(f"the request is not a valid protobuf message: {request.reason}")
    unknown = sorted({field.field_number for field in UnknownFieldSet(request)})
    if unknown:
        raise InvalidRequest(
            f"the request has fields this server does not know (numbers {unknown}); "
            "the client speaks a newer protocol: upgrade the server or drop those fields"
        )


def check_name(kind: str, name: str) -> None:
    """Dataset and pipeline names are plain names: never paths, never empty."""
    try:
        check_spec_name(kind, name)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def request_from_proto(request: pb.StreamBatchesRequest | Malformed) -> StreamSpec:
    """Convert a request message; anything malformed is InvalidRequest."""
    check_message(request)
    assert not isinstance(request, Malformed)
    try:
        return StreamSpec.from_proto(request)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


@dataclasses.dataclass(frozen=True)
class EncodedBatch:
    """One batch as the Batch messages that carry it (several parts if large)."""

    messages: list[bytes]
    samples: int
    nbytes: int
    skipped: int = 0  # samples left out of the batch (undecodable)


def encode_parts(batch: Batch, max_message_bytes: int) -> EncodedBatch:
    """Batch message bytes, split into parts of at most ``max_message_bytes`` of
    images each (at least one sample per part); each image byte is copied once."""
    total = len(batch.ids)
    per_sample = max(1, batch.images[:1].nbytes)
    step = max(1, max_message_bytes // per_sample)
    parts = max(1, -(-total // step))
    messages = []
    for part in range(parts):
        lo, hi = part * step, min(total, (part + 1) * step)
        last = part == parts - 1
        header = pb.Batch(
            index=batch.index,
            ids=batch.ids[lo:hi].tolist(),
            labels=to_proto("labels", batch.labels[lo:hi], "N"),
            cursor=batch.cursor if last else 0,
            skipped_ids=batch.skipped_ids if last else (),
            normalized=batch.normalized,
            num_batches=batch.num_batches,
            part=part,
            parts=parts,
            samples=total,
        )
        messages.append(encode_batch(header, batch.images[lo:hi], batch.layout))
    return EncodedBatch(
        messages, total, sum(len(m) for m in messages), skipped=len(batch.skipped_ids)
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


def preprocess_request_from_proto(request: pb.PreprocessRequest | Malformed) -> PreprocessRequest:
    """Convert a Preprocess request; anything malformed is InvalidRequest."""
    check_message(request)
    assert not isinstance(request, Malformed)
    check_name("pipeline", request.pipeline)
    try:
        dtype, layout = output_format(request.dtype, request.layout)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    return PreprocessRequest(
        pipeline=request.pipeline,
        images=request.images,
        dtype=dtype,
        layout=layout,
        params=dict(request.params),
    )


def preprocess_result_to_proto(result: PreprocessResult) -> pb.PreprocessResponse:
    return pb.PreprocessResponse(
        images=to_proto("images", result.images, result.layout if result.indices else ""),
        indices=result.indices,
        errors=[pb.ImageError(index=f.index, reason=f.reason) for f in result.failures],
        normalized=result.normalized,
        mean=result.mean,
        std=result.std,
    )


def _tolerant(parse: Callable[[bytes], Message]) -> Callable[[bytes], Message | Malformed]:
    def deserialize(data: bytes) -> Message | Malformed:
        try:
            return parse(data)
        except DecodeError as exc:
            return Malformed(str(exc) or "cannot parse")

    return deserialize


def add_to_server(servicer: BatchwireServicer, server: grpc.aio.Server) -> None:
    """Register the service so that unparsable requests reach the servicer as
    ``Malformed`` (answered INVALID_ARGUMENT) instead of grpc's INTERNAL."""
    handlers = {
        "ListDatasets": grpc.unary_unary_rpc_method_handler(
            servicer.ListDatasets,
            request_deserializer=_tolerant(pb.ListDatasetsRequest.FromString),
            response_serializer=pb.ListDatasetsResponse.SerializeToString,
        ),
        "DescribeDataset": grpc.unary_unary_rpc_method_handler(
            servicer.DescribeDataset,
            request_deserializer=_tolerant(pb.DescribeDatasetRequest.FromString),
            response_serializer=pb.DatasetInfo.SerializeToString,
        ),
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamBatches,
            request_deserializer=_tolerant(pb.StreamBatchesRequest.FromString),
            response_serializer=None,  # StreamBatches writes encoded bytes (encode_parts)
        ),
        "PullBatches": grpc.stream_stream_rpc_method_handler(
            servicer.PullBatches,
            request_deserializer=_tolerant(pb.PullRequest.FromString),
            response_serializer=None,  # encoded bytes, as StreamBatches
        ),
        "Preprocess": grpc.unary_unary_rpc_method_handler(
            servicer.Preprocess,
            request_deserializer=_tolerant(pb.PreprocessRequest.FromString),
            response_serializer=pb.PreprocessResponse.SerializeToString,
        ),
    }
    service = pb.DESCRIPTOR.services_by_name["Batchwire"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


class BatchwireServicer(pb_grpc.BatchwireServicer):
    def __init__(
        self,
        engine: Engine,
        executor: concurrent.futures.ThreadPoolExecutor,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self._engine = engine
        self._executor = executor
        self._metrics = metrics or ServerMetrics()

    def _info(self, summary: DatasetSummary) -> pb.DatasetInfo:
        pipelines = [
            pb.PipelineInfo(
                name=spec.name,
                description=spec.description,
                mean=spec.mean,
                std=spec.std,
                params={k: p.default for k, p in spec.params.items()},
            )
            for spec in self._engine.pipelines.values()
        ]
        return pb.DatasetInfo(
            name=summary.name,
            num_samples=summary.num_samples,
            classes=summary.classes,
            pipelines=pipelines,
            format_version=summary.format_version,
        )

    async def ListDatasets(
        self, request: pb.ListDatasetsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDatasetsResponse:
        try:
            check_message(request)
        except ServiceError as exc:
            await context.abort(status_for(exc), str(exc))
        return pb.ListDatasetsResponse(
            datasets=[self._info(s) for s in self._engine.list_datasets()]
        )

    async def DescribeDataset(
        self, request: pb.DescribeDatasetRequest, context: grpc.aio.ServicerContext
    ) -> pb.DatasetInfo:
        try:
            check_message(request)
            check_name("dataset", request.dataset)
            return self._info(self._engine.describe(request.dataset))
        except ServiceError as exc:
            await context.abort(status_for(exc), str(exc))
            raise  # unreachable: abort raises

    async def Preprocess(
        self, request: pb.PreprocessRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreprocessResponse:
        loop = asyncio.get_running_loop()
        try:
            core = preprocess_request_from_proto(request)
            # Screening the images' headers is CPU work: off the event loop.
            future = await loop.run_in_executor(self._executor, self._engine.preprocess, core)
            # Cancelling this await (the client went away) cancels the queued work.
            result = await asyncio.wrap_future(future)
            return await loop.run_in_executor(self._executor, preprocess_result_to_proto, result)
        except ServiceError as exc:
            await context.abort(status_for(exc), str(exc))
            raise  # unreachable: abort raises
        except Exception as exc:
            log.exception("preprocessing failed: pipeline=%s", request.pipeline)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"the server failed while preprocessing ({exc}); see its log",
            )
            raise

    def _close_opened(self, opening: asyncio.Future[BatchStream]) -> None:
        if opening.cancelled() or opening.exception() is not None:
            return
        try:
            self._executor.submit(opening.result().close)  # close drains: not on the loop
        except RuntimeError:  # the executor is shut down: the server is stopping
            opening.result().close()

    async def StreamBatches(
        self, request: pb.StreamBatchesRequest, context: grpc.aio.ServicerContext
    ) -> None:
        opened = await self._open(request, context, pull=False)
        if opened is not None:
            stream, stream_request = opened
            await self._serve(stream, stream_request, context)

    async def PullBatches(
        self,
        requests: AsyncIterator[pb.PullRequest | Malformed],
        context: grpc.aio.ServicerContext,
    ) -> None:
        try:
            first = await anext(aiter(requests), None)
            if first is None:
                raise InvalidRequest("the request stream ended before naming a stream")
            check_message(first)
            assert not isinstance(first, Malformed)
            if not first.HasField("stream"):
                raise InvalidRequest("the first PullRequest must name the stream (`stream`)")
        except ServiceError as exc:
            await context.abort(status_for(exc), str(exc))
            return
        opened = await self._open(first.stream, context, pull=True)
        if opened is None:
            return
        stream, stream_request = opened
        reading = asyncio.create_task(self._read_wants(first, requests, stream))
        try:
            await self._serve(stream, stream_request, context)
        finally:
            reading.cancel()

    @staticmethod
    async def _read_wants(
        first: pb.PullRequest,
        requests: AsyncIterator[pb.PullRequest | Malformed],
        stream: BatchStream,
    ) -> None:
        """Hand a pulling client's requests to its stream until it half-closes; a bad one
        ends the stream with its status."""
        try:
            stream.want(first.batches)
            async for message in requests:
                check_message(message)
                assert not isinstance(message, Malformed)
                if message.HasField("stream"):
                    raise InvalidRequest("only the first PullRequest names the stream")
                stream.want(message.batches)
            stream.end_wants()
        except ServiceError as exc:
            stream.end_wants(exc)
        except grpc.aio.AioRpcError:
            stream.end_wants()  # the call is over: the handler learns why from its writes

    async def _open(
        self,
        request: pb.StreamBatchesRequest | Malformed,
        context: grpc.aio.ServicerContext,
        *,
        pull: bool,
    ) -> tuple[BatchStream, StreamSpec] | None:
        """The request's stream, or None once the call was ended with the error's status."""
        loop = asyncio.get_running_loop()
        try:
            stream_request = request_from_proto(request)
            opening = loop.run_in_executor(
                self._executor,
                functools.partial(
                    self._engine.open_stream,
                    pull=pull,
                    encode=functools.partial(
                        encode_parts, max_message_bytes=self._engine.config.max_message_bytes
                    ),
                ),
                stream_request,
            )
            stream = await asyncio.shield(opening)
        except ServiceError as exc:
            await context.abort(status_for(exc), str(exc))
            return None
        except asyncio.CancelledError:
            # The client went away while its pipeline was being built: the stream
            # opens all the same, and must be closed or it holds a stream slot.
            log.info("client went away while its stream was opening; closing it when open")
            opening.add_done_callback(self._close_opened)
            raise
        return stream, stream_request

    async def _serve(
        self,
        stream: BatchStream,
        stream_request: StreamSpec,
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Write the stream's batches until its end, and close it. Writes with
        context.write rather than yielding: a client's hang-up then reaches this handler
        (as CancelledError, see write) instead of gRPC's write loop, and this handler's
        cleanup runs in its own task rather than when an abandoned generator is
        garbage-collected."""
        loop = asyncio.get_running_loop()
        peer = context.peer()
        # Structured copies of the start and end lines (JSON logs: --log-format json).
        fields = {
            "peer": peer,
            "dataset": stream_request.dataset,
            "pipeline": stream_request.pipeline,
            "rank": stream_request.rank,
            "world_size": stream_request.world_size,
            "lane": stream_request.lane,
            "lanes": stream_request.lanes,
            "pull": stream.pull,
            "epoch": stream_request.epoch,
            "start": stream_request.start,
        }
        log.info(
            "stream start peer=%s dataset=%s pipeline=%s rank=%d/%d %s epoch=%d start=%d",
            peer,
            stream_request.dataset,
            stream_request.pipeline,
            stream_request.rank,
            stream_request.world_size,
            "pull" if stream.pull else f"lane={stream_request.lane}/{stream_request.lanes}",
            stream_request.epoch,
            stream_request.start,
            extra={"event": "stream_start", **fields},
        )
        metrics = self._metrics.stream(stream_request.dataset, stream_request.pipeline)
        metrics.opened()
        # A pulled stream has no fixed length: its client half-closes when done.
        expected = None if stream.pull else stream.plan.lane_batches
        sent = 0
        batches = 0
        last_write = False
        status = "CANCELLED"  # unless the loop ends otherwise: the client went away
        started = time.monotonic()
        try:
            if stream.pull:
                # Tells the client the stream is open, so it asks this server for batches
                # only now: a server that is down or refuses never holds any. Inside the
                # try: a client gone by now still gets its stream closed below.
                await context.send_initial_metadata(())
            while True:
                computing = time.perf_counter()
                # The stream yields its batches encoded (encode_parts, given when it was
                # opened), their images copied once, from DALI's buffer into the messages.
                encoded: EncodedBatch | None
                if stream.awaitable:  # the server's pipelines: no thread waits for it
                    encoded = await stream.next_async()
                else:
                    encoded = await loop.run_in_executor(self._executor, next, stream, None)
                if encoded is None:
                    break
                metrics.produced(time.perf_counter() - computing, encoded.skipped)
                # Counted when handed to gRPC: a client can hold the batch (and hang up)
                # before this handler resumes after its last write.
                sent += encoded.samples
                batches += 1
                metrics.sent(encoded.samples, encoded.nbytes)
                waited = 0.0  # each write returns once gRPC has taken the message
                try:
                    for part, message in enumerate(encoded.messages):
                        writing = time.perf_counter()
                        # The share's last message is being handed over: a client that
                        # hangs up now has had every batch.
                        last_write = batches == expected and part == len(encoded.messages) - 1
                        await write(context, message)
                        waited += time.perf_counter() - writing
                finally:
                    # Also when the client hangs up before this handler resumes after
                    # the batch's last message, as the batch is counted sent above.
                    metrics.waited(waited)
            status = "OK"
        except (ServiceError, DatasetError) as exc:
            status = status_for(exc).name
            await context.abort(status_for(exc), str(exc))
        except Exception as exc:
            status = grpc.StatusCode.INTERNAL.name
            log.exception("stream failed: dataset=%s", stream_request.dataset)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"the server failed while streaming ({exc}); see its log"
            )
        finally:
            if status == "CANCELLED" and last_write:
                status = "OK"  # the client had every batch and hung up before the end
            metrics.closed(status)
            duration = time.monotonic() - started
            log.info(
                "stream end peer=%s dataset=%s pipeline=%s rank=%d samples=%d seconds=%.1f "
                "status=%s",
                peer,
                stream_request.dataset,
                stream_request.pipeline,
                stream_request.rank,
                sent,
                duration,
                status,
                extra={
                    "event": "stream_end",
                    **fields,
                    "samples": sent,
                    "batches": batches,
                    "duration_s": round(duration, 3),
                    "status": status,
                },
            )
            # Runs on cancellation too: the pipeline drains and returns to the pool. A
            # cancellation arriving during this await ends the handler here (the shielded
            # close goes on), so everything else is done before it.
            await asyncio.shield(loop.run_in_executor(self._executor, stream.close))
