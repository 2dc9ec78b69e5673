"""The gRPC face of the engine: converts messages and maps errors to status codes.

Blocking work (LMDB reads, DALI runs, building messages) runs on a bounded
thread pool; the event loop only awaits it and writes to the wire, so a slow
client holds back only its own stream (the next batch is not computed until
the previous one is written).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from batchwire.common.tensors import to_proto
from batchwire.server._dataset import NAME_PATTERN, DatasetError
from batchwire.server._engine import Batch, BatchStream, DatasetSummary, Engine, StreamRequest
from batchwire.server._errors import Draining, InvalidRequest, NotFound, OverCapacity, ServiceError
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

_DTYPES = {
    pb.DTYPE_UNSPECIFIED: "uint8",
    pb.UINT8: "uint8",
    pb.FLOAT16: "float16",
    pb.FLOAT32: "float32",
}
_LAYOUTS = {pb.LAYOUT_UNSPECIFIED: "NCHW", pb.NCHW: "NCHW", pb.NHWC: "NHWC"}


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
    if not name:
        raise InvalidRequest(f"{kind} must be named")
    if not NAME_PATTERN.match(name):
        raise InvalidRequest(
            f"{kind} {name[:80]!r} is not a valid name: use letters, digits, '.', '_' or '-'"
        )


def request_from_proto(request: pb.StreamBatchesRequest | Malformed) -> StreamRequest:
    """Convert a request message; anything malformed is InvalidRequest."""
    check_message(request)
    assert not isinstance(request, Malformed)
    check_name("dataset", request.dataset)
    check_name("pipeline", request.pipeline)
    dtype = _DTYPES.get(request.dtype)
    if dtype is None:
        raise InvalidRequest(
            f"dtype {request.dtype} is not an output dtype (UINT8, FLOAT16, FLOAT32)"
        )
    layout = _LAYOUTS.get(request.layout)
    if layout is None:
        raise InvalidRequest(f"layout {request.layout} is not NCHW or NHWC")
    return StreamRequest(
        dataset=request.dataset,
        pipeline=request.pipeline,
        batch_size=request.batch_size,
        seed=request.seed,
        epoch=request.epoch,
        shuffle=request.shuffle if request.HasField("shuffle") else True,
        drop_last=request.drop_last if request.HasField("drop_last") else True,
        rank=request.rank,
        world_size=request.world_size or 1,
        start=request.start,
        lanes=request.lanes or 1,
        lane=request.lane,
        dtype=dtype,
        layout=layout,
        params=dict(request.params),
    )


def batch_to_proto(batch: Batch) -> pb.Batch:
    return pb.Batch(
        index=batch.index,
        ids=batch.ids.tolist(),
        images=to_proto("images", batch.images, batch.layout),
        labels=to_proto("labels", batch.labels, "N"),
        cursor=batch.cursor,
        skipped_ids=batch.skipped_ids,
        normalized=batch.normalized,
        num_batches=batch.num_batches,
    )


def _next_message(stream: BatchStream) -> pb.Batch | None:
    batch = next(stream, None)
    return None if batch is None else batch_to_proto(batch)


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
            response_serializer=pb.Batch.SerializeToString,
        ),
    }
    service = pb.DESCRIPTOR.services_by_name["Batchwire"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


class BatchwireServicer(pb_grpc.BatchwireServicer):
    def __init__(self, engine: Engine, executor: concurrent.futures.ThreadPoolExecutor) -> None:
        self._engine = engine
        self._executor = executor

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

    async def StreamBatches(
        self, request: pb.StreamBatchesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Batch]:
        loop = asyncio.get_running_loop()
        try:
            stream_request = request_from_proto(request)
            stream = await loop.run_in_executor(
                self._executor, self._engine.open_stream, stream_request
            )
        except ServiceError as exc:
            await context.abort(status_for(exc), str(exc))
            return
        peer = context.peer()
        log.info(
            "stream start peer=%s dataset=%s pipeline=%s rank=%d/%d lane=%d/%d epoch=%d start=%d",
            peer,
            stream_request.dataset,
            stream_request.pipeline,
            stream_request.rank,
            stream_request.world_size,
            stream_request.lane,
            stream_request.lanes,
            stream_request.epoch,
            stream_request.start,
        )
        sent = 0
        started = time.monotonic()
        try:
            while True:
                message = await loop.run_in_executor(self._executor, _next_message, stream)
                if message is None:
                    break
                sent += len(message.ids)
                yield message
        except (ServiceError, DatasetError) as exc:
            await context.abort(status_for(exc), str(exc))
        except Exception as exc:
            log.exception("stream failed: dataset=%s", stream_request.dataset)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"the server failed while streaming ({exc}); see its log"
            )
        finally:
            # Runs on cancellation too: the pipeline drains and returns to the pool.
            await asyncio.shield(loop.run_in_executor(self._executor, stream.close))
            log.info(
                "stream end peer=%s dataset=%s pipeline=%s rank=%d samples=%d seconds=%.1f",
                peer,
                stream_request.dataset,
                stream_request.pipeline,
                stream_request.rank,
                sent,
                time.monotonic() - started,
            )
