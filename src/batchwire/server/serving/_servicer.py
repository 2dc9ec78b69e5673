"""The gRPC face of the engine: the servicer, and its registration with a server.

Each call's request is checked and converted (``_messages``), an error ends the call
with its status code (one decorator on every handler, ``_ends_with_status``), and an
opened stream is served by ``_streaming``. Both streaming RPCs open the same kind of
stream, which runs the batches asked of it: ``PullBatches`` hands it its client's
requests as they come, ``StreamBatches`` asks for its lane's batches when it opens.

No call ends UNKNOWN: a domain error ends it with its code (``STATUS_CODES``: a
pipeline that fails or cannot be built is UNAVAILABLE, so that the client goes on
elsewhere; a damaged dataset is DATA_LOSS), and anything else is a bug: INTERNAL,
logged with its traceback, "see the server log".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc

from batchwire.common import bulk as bulk_rules
from batchwire.common.sampler import Plan
from batchwire.common.shared_memory import GRANT_METADATA
from batchwire.common.stream import StreamSpec
from batchwire.server.engine import Batch, BatchStream, DatasetDescription, Engine
from batchwire.server.errors import InvalidRequest, OverCapacity, ServiceError
from batchwire.server.serving._bulk import BulkBroker, BulkLink
from batchwire.server.serving._messages import (
    Malformed,
    check_message,
    check_name,
    lane_from_proto,
    preprocess_request_from_proto,
    preprocess_result_to_proto,
    spec_from_proto,
    status_for,
    tolerant,
)
from batchwire.server.serving._metrics import ServerMetrics
from batchwire.server.serving._ring_broker import RingBroker
from batchwire.server.serving._shared_memory import SharedRing
from batchwire.server.serving._stream_times import StreamClock
from batchwire.server.serving._streaming import EncodedBatch, encode_parts, serve_stream
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

__all__ = ["MAX_PULL_AHEAD", "BatchwireServicer", "add_to_server"]

log = logging.getLogger(__name__)

# Batches a pulling client may have asked for and not yet received, per stream.
MAX_PULL_AHEAD = 1024

_Reply = TypeVar("_Reply")
_Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[_Reply]]


def add_to_server(servicer: BatchwireServicer, server: grpc.aio.Server) -> None:
    """Register the service so that unparsable requests reach the servicer as
    ``Malformed`` (answered INVALID_ARGUMENT) instead of grpc's INTERNAL."""
    handlers = {
        "ListDatasets": grpc.unary_unary_rpc_method_handler(
            servicer.ListDatasets,
            request_deserializer=tolerant(pb.ListDatasetsRequest.FromString),
            response_serializer=pb.ListDatasetsResponse.SerializeToString,
        ),
        "DescribeDataset": grpc.unary_unary_rpc_method_handler(
            servicer.DescribeDataset,
            request_deserializer=tolerant(pb.DescribeDatasetRequest.FromString),
            response_serializer=pb.DatasetInfo.SerializeToString,
        ),
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamBatches,
            request_deserializer=tolerant(pb.StreamBatchesRequest.FromString),
            response_serializer=None,  # StreamBatches writes encoded bytes (encode_parts)
        ),
        "PullBatches": grpc.stream_stream_rpc_method_handler(
            servicer.PullBatches,
            request_deserializer=tolerant(pb.PullRequest.FromString),
            response_serializer=None,  # encoded bytes, as StreamBatches
        ),
        "Preprocess": grpc.unary_unary_rpc_method_handler(
            servicer.Preprocess,
            request_deserializer=tolerant(pb.PreprocessRequest.FromString),
            response_serializer=pb.PreprocessResponse.SerializeToString,
        ),
    }
    service = pb.DESCRIPTOR.services_by_name["Batchwire"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, doing: str) -> NoReturn:
    """End the call with ``exc``'s status: its own message for a domain error, else
    INTERNAL (a bug), logged with its traceback."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("the server failed while %s", doing, exc_info=exc)
        message = (
            f"the server failed while {doing} ({type(exc).__name__}: {exc}); see the server log"
        )
    else:
        message = str(exc)
    # UNAVAILABLE from the server itself (draining, a pipeline fault) means "elsewhere":
    # a client's gRPC retry policy, which makes a call again on UNAVAILABLE, is told not
    # to make it here again (a negative pushback, gRPC's retry design).
    pushback = (("grpc-retry-pushback-ms", "-1"),) if code == grpc.StatusCode.UNAVAILABLE else ()
    await context.abort(code, message, trailing_metadata=pushback)
    raise AssertionError("unreachable: abort raises")


async def _first_pull(
    requests: AsyncIterator[pb.PullRequest | Malformed],
) -> tuple[pb.PullRequest, StreamSpec]:
    """A pull call's first request, and the stream it names: InvalidRequest unless it names
    one, of batches rather than lanes, and releases no buffer yet."""
    first = await anext(aiter(requests), None)
    if first is None:
        raise InvalidRequest("the request stream ended before naming a stream")
    check_message(first)
    assert not isinstance(first, Malformed)
    if not first.HasField("stream"):
        raise InvalidRequest("the first PullRequest must name the stream (`stream`)")
    spec = spec_from_proto(first.stream)
    if first.stream.lanes > 1 or first.stream.lane:
        raise InvalidRequest("a pulled stream names batches, not lanes: leave lane and lanes unset")
    if first.released_buffers:
        raise InvalidRequest("the first PullRequest cannot release shared memory buffers")
    return first, spec


def _ends_with_status(doing: str) -> Callable[[_Handler[_Reply]], _Handler[_Reply]]:
    """A handler (unary or streaming) whose exceptions end its call with their status
    (``STATUS_CODES``; anything else INTERNAL, "see the server log"); ``doing`` says
    what the server was doing, for INTERNAL. A cancelled call stays cancelled."""

    def decorate(handler: _Handler[_Reply]) -> _Handler[_Reply]:
        @functools.wraps(handler)
        async def handle(self: Any, request: Any, context: grpc.aio.ServicerContext) -> _Reply:
            try:
                return await handler(self, request, context)
            except grpc.aio.AbortError:
                raise  # the call is ended already
            except Exception as exc:
                await _abort(context, exc, doing)

        return handle

    return decorate


def _want(stream: BatchStream[EncodedBatch], indices: Sequence[int], clock: StreamClock) -> None:
    """A pulling client asks for ``indices``: OverCapacity beyond MAX_PULL_AHEAD waiting."""
    waiting = stream.waiting + len(indices)
    if waiting > MAX_PULL_AHEAD:
        raise OverCapacity(
            f"{waiting} batches asked for and not yet sent; a stream may hold at most "
            f"{MAX_PULL_AHEAD}: ask for more as batches arrive"
        )
    stream.want(indices)
    if indices:
        clock.asked()


class BatchwireServicer(pb_grpc.BatchwireServicer):
    def __init__(
        self,
        engine: Engine,
        executor: concurrent.futures.ThreadPoolExecutor,
        metrics: ServerMetrics | None = None,
        *,
        max_message_bytes: int,
        broker: RingBroker | None = None,
        bulk: BulkBroker | None = None,
        worker_ports: Sequence[int] = (),
    ) -> None:
        """``broker``: grants shared memory to the pulled streams that offer it (None:
        shared memory off); ``bulk``: bulk connections, likewise. ``worker_ports``: where
        this server is a worker of a unit, every worker's own port, announced in each
        ``DatasetInfo``."""
        self._engine = engine
        self._executor = executor
        self._metrics = metrics or ServerMetrics()
        self._encode = functools.partial(encode_parts, max_message_bytes=max_message_bytes)
        self._broker = broker
        self._bulk = bulk
        self._worker_ports = tuple(worker_ports)

    def _info(self, summary: DatasetDescription) -> pb.DatasetInfo:
        pipelines = [
            pb.PipelineInfo(
                name=spec.name,
                description=spec.description,
                mean=spec.mean,
                std=spec.std,
                params={k: p.default for k, p in spec.params.items()},
                param_ranges={k: p.to_proto() for k, p in spec.params.items()},
                outputs=[
                    pb.Tensor(name=o.name, kind=o.kind, layout=o.layout) for o in spec.outputs
                ],
                form=spec.form if spec.outputs else "",
            )
            for spec in self._engine.pipelines.values()
        ]
        return pb.DatasetInfo(
            name=summary.name,
            num_samples=summary.num_samples,
            classes=summary.classes,
            pipelines=pipelines,
            format_version=summary.format_version,
            version=summary.version,
            max_batch_size=self._engine.config.max_batch_size,
            worker_ports=self._worker_ports,
        )

    @_ends_with_status("listing its datasets")
    async def ListDatasets(
        self, request: pb.ListDatasetsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDatasetsResponse:
        check_message(request)
        return pb.ListDatasetsResponse(
            datasets=[self._info(s) for s in self._engine.list_datasets()]
        )

    @_ends_with_status("describing a dataset")
    async def DescribeDataset(
        self, request: pb.DescribeDatasetRequest, context: grpc.aio.ServicerContext
    ) -> pb.DatasetInfo:
        check_message(request)
        check_name("dataset", request.dataset)
        return self._info(self._engine.describe(request.dataset))

    @_ends_with_status("preprocessing")
    async def Preprocess(
        self, request: pb.PreprocessRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreprocessResponse:
        loop = asyncio.get_running_loop()
        wanted = preprocess_request_from_proto(request)
        # Screening the images' headers is CPU work: off the event loop.
        future = await loop.run_in_executor(self._executor, self._engine.preprocess, wanted)
        # Cancelling this await (the client went away) cancels the queued work.
        result = await asyncio.wrap_future(future)
        return await loop.run_in_executor(self._executor, preprocess_result_to_proto, result)

    @_ends_with_status("streaming")
    async def StreamBatches(
        self, request: pb.StreamBatchesRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """A lane of a share: a stream that asks for the lane's batches, in order, as it
        opens."""
        spec = spec_from_proto(request)
        lane = lane_from_proto(request)
        stream = await self._open(spec, lane.batches)
        await serve_stream(stream, spec, context, self._executor, self._metrics, lane)

    @_ends_with_status("streaming")
    async def PullBatches(
        self,
        requests: AsyncIterator[pb.PullRequest | Malformed],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Batches as its client asks for them: the first request names the stream (and
        may offer shared memory or a bulk connection), each later one asks for batches or
        releases the ring's buffers."""
        first, spec = await _first_pull(requests)
        ring, link, metadata = self._grant(first)
        try:
            # A batch goes in the ring if the client claimed it (on this host), else on the
            # bulk connection if it claimed that, else in its messages.
            encode = self._encode if link is None else link.encoder(self._encode)
            encode = encode if ring is None else ring.encoder(encode)
            stream = await self._open(spec, None, encode)
            clock = self._metrics.stream_times.clock(spec.name, spec.pipeline)
            reading = asyncio.create_task(self._read_wants(first, requests, stream, ring, clock))
            try:
                await serve_stream(
                    stream,
                    spec,
                    context,
                    self._executor,
                    self._metrics,
                    None,
                    shared_memory=ring is not None,
                    bulk=None if link is None else link.send,
                    metadata=metadata,
                    clock=clock,
                )
            finally:
                reading.cancel()
                clock.close()  # serve_stream did, unless it failed to start
        finally:
            await self._let_go(ring, link)

    def _grant(
        self, first: pb.PullRequest
    ) -> tuple[SharedRing | None, BulkLink | None, list[tuple[str, bytes]]]:
        """What a pull call's ``first`` request offers to take beside its messages and this
        server grants: a ring of shared memory, a bulk connection, and the call's initial
        metadata that grants them."""
        ring: SharedRing | None = None
        link: BulkLink | None = None
        metadata: list[tuple[str, bytes]] = []
        if self._broker is not None and first.HasField("shared_memory"):
            granted = self._broker.grant(first.shared_memory)
            if granted is not None:
                ring, grant = granted
                metadata.append((GRANT_METADATA, grant.SerializeToString()))
        if self._bulk is not None and first.bulk:
            offered = self._bulk.grant()
            if offered is not None:
                link, bulk_grant = offered
                metadata.append((bulk_rules.GRANT_METADATA, bulk_grant.SerializeToString()))
        return ring, link, metadata

    async def _let_go(self, ring: SharedRing | None, link: BulkLink | None) -> None:
        """A pull call's ring and bulk connection revoked once it ends, the ring closed."""
        if link is not None:
            assert self._bulk is not None
            self._bulk.revoke(link)
        if ring is not None:
            assert self._broker is not None
            self._broker.revoke(ring)
            # Unmapping a large ring takes milliseconds: not on the event loop. A
            # stopping server's executor takes no more work: it closes the ring here,
            # and any close left queued when it stops (BatchwireServer's close_rings).
            loop = asyncio.get_running_loop()
            try:
                closing = loop.run_in_executor(self._executor, self._broker.close_ring, ring)
            except RuntimeError:
                self._broker.close_ring(ring)
            else:
                await asyncio.shield(closing)

    @staticmethod
    async def _read_wants(
        first: pb.PullRequest,
        requests: AsyncIterator[pb.PullRequest | Malformed],
        stream: BatchStream[EncodedBatch],
        ring: SharedRing | None,
        clock: StreamClock,
    ) -> None:
        """Hand a pulling client's requests to its stream (and tell its ``clock`` a batch
        is asked for) until it half-closes; a bad one ends the stream with its status."""
        try:
            _want(stream, first.batches, clock)
            async for message in requests:
                check_message(message)
                assert not isinstance(message, Malformed)
                if message.HasField("stream"):
                    raise InvalidRequest("only the first PullRequest names the stream")
                if message.released_buffers:
                    if ring is None:
                        raise InvalidRequest(
                            "released shared memory buffers on a stream that sends its "
                            "batches in their messages"
                        )
                    ring.release(message.released_buffers)
                _want(stream, message.batches, clock)
            # A client that cancels ends the requests too; its cancellation comes from gRPC
            # with the same reads, so one turn of the loop lets it land before the stream
            # ends as if finished (the end line would say OK, not CANCELLED).
            await asyncio.sleep(0)
            stream.end_wants()
        except ServiceError as exc:
            stream.end_wants(exc)
        except grpc.aio.AioRpcError:
            stream.end_wants()  # the call is over: the handler learns why from its writes

    def _close_opened(self, opening: asyncio.Future[BatchStream[EncodedBatch]]) -> None:
        if opening.cancelled() or opening.exception() is not None:
            return
        try:
            self._executor.submit(opening.result().close)  # close drains: not on the loop
        except RuntimeError:  # the executor is shut down: the server is stopping
            opening.result().close()

    async def _open(
        self,
        spec: StreamSpec,
        batches: Callable[[Plan], Sequence[int]] | None,
        encode: Callable[[Batch], EncodedBatch] | None = None,
    ) -> BatchStream[EncodedBatch]:
        """``spec``'s stream, opened off the event loop (it may build a pipeline)."""
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(
            self._executor,
            functools.partial(
                self._engine.open_stream, spec, encode=encode or self._encode, batches=batches
            ),
        )
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The client went away while its pipeline was being built: the stream
            # opens all the same, and must be closed or it holds one of the --max-streams places.
            log.info("client went away while its stream was opening; closing it when open")
            opening.add_done_callback(self._close_opened)
            raise
