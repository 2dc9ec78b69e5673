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
from collections.abc import AsyncIterator

import grpc

from batchwire.common.tensors import to_proto
from batchwire.server._dataset import DatasetError
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


def request_from_proto(request: pb.StreamBatchesRequest) -> StreamRequest:
    """Convert a request message; malformed enums or empty names are InvalidRequest."""
    if not request.dataset:
        raise InvalidRequest("dataset must be named")
    if not request.pipeline:
        raise InvalidRequest("pipeline must be named")
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
        return pb.ListDatasetsResponse(
            datasets=[self._info(s) for s in self._engine.list_datasets()]
        )

    async def DescribeDataset(
        self, request: pb.DescribeDatasetRequest, context: grpc.aio.ServicerContext
    ) -> pb.DatasetInfo:
        try:
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
