"""The client's transport over gRPC: its channels and calls.

``GrpcTransport`` makes the calls of a loader's passes (``PullBatches``: a call, the
grants it reads, the ring and bulk connection it claims, the batches it decodes) and its
dataset descriptions, and a ``Preprocessor``'s, on channels of ``_channels`` (where
``check_health`` and ``list_datasets``, calls of their own, are too); what they raise
leaves them as the client's own exceptions (``_rpc_errors``).
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Generic, TypeVar

import grpc
import numpy as np

from batchwire.client._transport._base import (
    Claim,
    PullOptions,
    Server,
)
from batchwire.client._transport._bulk import BulkReader
from batchwire.client._transport._channels import open_channel, stub
from batchwire.client._transport._exceptions import (
    BatchwireError,
    StatusCode,
)
from batchwire.client._transport._rpc_errors import error_from, map_rpc_errors
from batchwire.client._transport._security import ChannelSecurity
from batchwire.client._transport._shared_memory import RingReader
from batchwire.common.batch_codec import DecodedBatch, decode_batch
from batchwire.common.bulk import GRANT_METADATA as BULK_GRANT_METADATA
from batchwire.common.shared_memory import GRANT_METADATA
from batchwire.common.tls import tls_context
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["GrpcTransport", "read_bulk_grant", "read_grant"]

_PULL_METHOD = "/batchwire.v1.Batchwire/PullBatches"


def read_grant(metadata: Iterable[tuple[str, str | bytes]] | None) -> pb.SharedMemoryGrant | None:
    """The grant of shared memory in a call's initial ``metadata``, if there is one."""
    value = _metadata_value(metadata, GRANT_METADATA)
    return None if value is None else pb.SharedMemoryGrant.FromString(value)


def read_bulk_grant(metadata: Iterable[tuple[str, str | bytes]] | None) -> pb.BulkGrant | None:
    """The grant of a bulk connection in a call's initial ``metadata``, if there is one."""
    value = _metadata_value(metadata, BULK_GRANT_METADATA)
    return None if value is None else pb.BulkGrant.FromString(value)


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, name: str) -> bytes | None:
    found = None
    for key, value in metadata or ():
        if key == name and isinstance(value, bytes):
            found = value
    return found


_T = TypeVar("_T")


class _Pending(Generic[_T]):
    """A unary call under way (``Pending``): its error, read, is the client's."""

    def __init__(self, future: grpc.Future, address: str) -> None:
        self._future = future
        self._address = address

    def result(self) -> _T:
        with map_rpc_errors(self._address):
            result: _T = self._future.result()
        return result

    def cancel(self) -> None:
        self._future.cancel()


def _requests(
    stream: pb.StreamBatchesRequest,
    claim: Claim,
    *,
    shared_memory: pb.SharedMemoryOffer | None = None,
    bulk: bool = False,
    accepted: threading.Event | None = None,
    released: Callable[[], Sequence[int]] | None = None,
) -> Iterator[pb.PullRequest]:
    """A call's request stream: the stream (with the offers of shared memory and of a
    bulk connection) and the first batches ``claim`` has room for without waiting, so
    that the server starts on them without a round trip; none until ``accepted`` is set
    where it is not yet (a ring being claimed, so that they go there too). Then the
    batches as the server has room, each request releasing the shared memory buffers
    copied out since the last (``released``). Ends (half-closes) when ``claim`` gives
    None."""
    first = claim(False) if accepted is None or accepted.is_set() else ()
    yield pb.PullRequest(stream=stream, shared_memory=shared_memory, bulk=bulk, batches=first or ())
    if accepted is not None:
        accepted.wait()
    while (batches := claim(True)) is not None:
        yield pb.PullRequest(batches=batches, released_buffers=released() if released else ())


class _PullCall:
    """A ``PullBatches`` call (``PullCall``) and what it offered beside it: the ring of
    the server's shared memory and a bulk connection, claimed once the call opened, let
    go of at the block's end. Its errors are mapped when they leave the ``with`` block,
    not message by message."""

    def __init__(
        self,
        call: grpc.Call,
        server: Server,
        ring: RingReader | None,
        bulk: BulkReader | None,
        accepted: threading.Event,
        shares_memory: dict[Server, bool],
    ) -> None:
        self._call = call
        self._server = server
        self._ring = ring
        self._bulk = bulk
        self._accepted = accepted
        self._shares_memory = shares_memory
        self._lock = threading.Lock()  # the bulk connection: read here, shut by cancel

    def __enter__(self) -> _PullCall:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._accepted.set()  # the request stream may wait for the claim
        if self._ring is not None:
            self._ring.close()
        with self._lock:
            bulk, self._bulk = self._bulk, None
        if bulk is not None:
            bulk.close()
        if isinstance(error, grpc.RpcError):
            raise error_from(error, self._server.address) from None

    def __iter__(self) -> Iterator[DecodedBatch]:
        self._claim()
        ring = self._ring
        view = None if ring is None else ring.view
        for raw in self._call:
            part = decode_batch(raw, view)
            shared = part.header.HasField("shared_images")
            lent = ring.lend(part) if ring is not None and shared else None
            if lent is not None:  # released once the loop lets go of it: not held here
                handed = [lent]
                del part, lent
                yield handed.pop()
                continue
            buffer = part.header.shared_images.buffer
            yield part
            del part  # its images are a view of the ring: gone before the buffer is released
            if shared and ring is not None:
                ring.copied(buffer)  # the next request releases it

    def _claim(self) -> None:
        """Claim what the server granted beside the call, once it opened: batches it
        finishes before then come in their messages."""
        metadata = self._call.initial_metadata()
        ring, address = self._ring, self._server.address
        if ring is not None:
            ring.claim(read_grant(metadata), address)
            self._shares_memory[self._server] = ring.claimed
        bulk = self._bulk
        if bulk is not None and not (ring is not None and ring.claimed):
            bulk.claim(read_bulk_grant(metadata), address, self._server.tls_name)
        self._accepted.set()

    def read_images(self, out: np.ndarray) -> None:
        bulk = self._bulk
        if bulk is None or not bulk.claimed:
            raise BatchwireError(
                "the server sent a batch on a bulk connection this call did not offer",
                code=StatusCode.INTERNAL,
            )
        bulk.read_into(out)  # the one copy: from the kernel, into the tensor

    def cancel(self) -> None:
        self._call.cancel()
        with self._lock:
            if self._bulk is not None:
                self._bulk.shut()  # a read of images waiting on it ends too


class GrpcTransport:
    """Calls to servers over gRPC with one set of credentials (a ``Transport``;
    thread-safe). A channel per server opens on first use, and again after a fork: a
    forked process (a DataLoader worker) never uses its parent's channels. ``on_open``
    sees each channel opened."""

    def __init__(
        self,
        security: ChannelSecurity | None = None,
        on_open: Callable[[grpc.Channel], None] | None = None,
    ) -> None:
        self._security = security
        self._on_open = on_open
        self._channels: dict[Server, grpc.Channel] = {}
        self._pid = os.getpid()
        # Whether a server's last call gave this process its shared memory (it is on this
        # host): a call to one that did not asks for batches without waiting for a ring.
        self.shares_memory: dict[Server, bool] = {}
        self._tls: ssl.SSLContext | None = None  # for bulk connections, made when first used

    @property
    def metadata(self) -> Sequence[tuple[str, str]]:
        return self._security.metadata() if self._security is not None else ()

    def channel(self, server: Server) -> grpc.Channel:
        if self._pid != os.getpid():
            self._channels, self._pid = {}, os.getpid()
        channel = self._channels.get(server)
        if channel is None:
            channel = open_channel(server.address, self._security, tls_name=server.tls_name)
            if self._on_open is not None:
                self._on_open(channel)
            self._channels[server] = channel
        return channel

    def tls_context(self) -> ssl.SSLContext | None:
        if self._security is None or not self._security.tls:
            return None
        if self._tls is None:
            security = self._security
            self._tls = tls_context(
                server=False, cert=security.tls_cert, key=security.tls_key, ca=security.tls_ca
            )
        return self._tls

    def open_pull(
        self, server: Server, stream: pb.StreamBatchesRequest, claim: Claim, options: PullOptions
    ) -> _PullCall:
        """A ``PullBatches`` call on ``server`` for ``stream``. Each call offers shared
        memory anew (a server on this host grants it) and a bulk connection to a server
        named by its host, if it can be reached. Where the server may be on this host (its
        shared memory was taken before, or this is the first call to it), the first
        batches are asked for once the ring is claimed, so that they go there too; else
        with the call's first message. Its batch messages come as the bytes received (no
        deserializer): the client parses them without copying the images
        (``batchwire.common.batch_codec``)."""
        ring = RingReader.offer(options.buffers, options.lend) if options.shared_memory else None
        bulk = None
        if options.bulk and BulkReader.offered(server.address):
            bulk = BulkReader(options.timeout, self.tls_context())
        accepted = threading.Event()
        if ring is None or not self.shares_memory.get(server, True):
            accepted.set()
        requests = _requests(
            stream,
            claim,
            shared_memory=None if ring is None else ring.message(),
            bulk=bulk is not None,
            accepted=accepted,
            released=None if ring is None else ring.take_released,
        )
        try:
            with map_rpc_errors(server.address):
                pull = self.channel(server).stream_stream(
                    _PULL_METHOD,
                    request_serializer=pb.PullRequest.SerializeToString,
                    response_deserializer=None,
                )
                call = pull(requests, metadata=self.metadata)
        except BaseException:
            for side in (ring, bulk):
                if side is not None:
                    side.close()
            raise
        return _PullCall(call, server, ring, bulk, accepted, self.shares_memory)

    def describe(self, server: Server, dataset: str, *, timeout: float) -> _Pending[pb.DatasetInfo]:
        """A ``DescribeDataset`` call for ``dataset`` on ``server``."""
        future = stub(self.channel(server)).DescribeDataset.future(
            pb.DescribeDatasetRequest(dataset=dataset), timeout=timeout, metadata=self.metadata
        )
        return _Pending(future, server.address)

    def preprocess(
        self, server: Server, request: pb.PreprocessRequest, *, timeout: float
    ) -> _Pending[pb.PreprocessResponse]:
        """A ``Preprocess`` call on ``server``."""
        call = stub(self.channel(server)).Preprocess
        future = call.future(request, timeout=timeout, metadata=self.metadata)
        return _Pending(future, server.address)

    def __getstate__(self) -> dict[str, object]:
        # A copy (a spawned worker) opens channels of its own.
        return {"_security": self._security, "_on_open": self._on_open}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._channels, self._pid, self.shares_memory = {}, os.getpid(), {}
        self._tls = None

    def close(self) -> None:
        """Close this process's channels (a parent's are left to the parent)."""
        if self._pid == os.getpid():
            for channel in self._channels.values():
                channel.close()
        self._channels = {}
