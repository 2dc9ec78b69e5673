"""The client's one seam to the servers: channels, calls, and the errors they raise.

Every RPC the client makes goes through this module: the health check and the dataset
listing (``check_health``, ``list_datasets``), dataset descriptions
(``describe_dataset``), the workers of a unit (``find_workers``), and, through a
:class:`Transport`, the ``PullBatches`` calls of a loader's passes and a
``Preprocessor``'s calls. ``map_rpc_errors`` is the one place
where a ``grpc.RpcError`` becomes the client's own exception (see ``_exceptions``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchwire.client._exceptions import (
    BatchwireError,
    InvalidArgumentError,
    NotFoundError,
    error_for,
)
from batchwire.client._security import ChannelSecurity
from batchwire.client._servers import RETRIABLE, Server, ServerSet
from batchwire.common.params import ParamRange, check_batch_size, check_params
from batchwire.common.stream import StreamSpec
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc

__all__ = [
    "CHANNEL_OPTIONS",
    "Transport",
    "check_health",
    "check_target",
    "describe_dataset",
    "find_workers",
    "list_datasets",
    "map_rpc_errors",
    "open_channel",
    "rpc_details",
]

# A batch (e.g. 512 x 3 x 224 x 224 uint8 = 77 MB) is one message, far above
# gRPC's 4 MB default; the server caps batch sizes, so the client need not.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    # Preprocess requests carry encoded images; the server bounds what it
    # accepts (max_request_bytes) and answers RESOURCE_EXHAUSTED beyond it.
    ("grpc.max_send_message_length", -1),
    ("grpc.so_reuseport", 0),
)
_PULL_METHOD = "/batchwire.v1.Batchwire/PullBatches"

log = logging.getLogger(__name__)

# host:port or [v6]:port; anything with a scheme (dns:///, unix:, ipv4:) is gRPC's to parse.
_HOST_PORT = re.compile(r"(\[[^\]]+\]|[^:\[\]/]+):\d{1,5}")
# Web URLs, which gRPC would take for a DNS name ("Misformatted domain name").
_URL_SCHEME = re.compile(r"(https?|grpcs?)://", re.IGNORECASE)


@contextlib.contextmanager
def map_rpc_errors(address: str = "") -> Iterator[None]:
    """Raise a ``grpc.RpcError`` from the block as the ``BatchwireError`` that fits its
    status code, its message saying what to do where it can: a server at ``address`` that
    is down or refuses the TLS handshake, a request over the server's size limit. The
    original is the error's ``rpc_error``, not printed before it: a user's traceback
    starts with batchwire's error and its message."""
    try:
        yield
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
        error = error_for(code, _advice(code, details, address))
        error.rpc_error = exc
        raise error from None


def rpc_details(error: BatchwireError) -> str:
    """What gRPC or the server said, for an ``error`` from ``map_rpc_errors``, before it
    was worded for a user (a retried failure is logged as it was)."""
    cause = error.rpc_error
    return (cause.details() if isinstance(cause, grpc.Call) else None) or error.details


def _advice(code: grpc.StatusCode, details: str, address: str) -> str:
    if code == grpc.StatusCode.UNAVAILABLE and address:
        if "handshake" in details.lower():
            return (
                f"TLS handshake with {address} failed ({details}); does tls_ca hold the CA "
                "that signed the server's certificate, and does the address match a name in it?"
            )
        return f"server {address} is unavailable ({details}); is `batchwire serve` running there?"
    if code == grpc.StatusCode.NOT_FOUND and address:
        return f"server {address}: {details}"  # which server lacks it, as for a pipeline
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return (
            f"{details}: the request is larger than the server accepts (its "
            "max_request_bytes); an image this large cannot be sent, or ask the server's "
            "operator to raise the limit"
        )
    return details


def check_target(target: str) -> str:
    """``target`` if it names a port; InvalidArgumentError if it is a bare host, which gRPC
    would dial on port 443, or a web URL (``http://host:port``), which gRPC cannot resolve."""
    scheme = _URL_SCHEME.match(target)
    if scheme:
        bare = target[scheme.end() :].rstrip("/")
        raise InvalidArgumentError(
            f"address {target!r} is a URL: write HOST:PORT without {scheme.group()!r}, "
            f"e.g. {bare or 'gpu-host:50051'}"
        )
    if ":/" in target or target.startswith(("unix:", "ipv4:", "ipv6:", "unix-abstract:")):
        return target
    if not _HOST_PORT.fullmatch(target):
        raise InvalidArgumentError(
            f"address {target!r} has no port: write HOST:PORT, e.g. gpu-host:50051 "
            "(batchwire serve's default port), or dns:///NAME:PORT"
        )
    return target


def open_channel(
    address: str, security: ChannelSecurity | None = None, *, tls_name: str | None = None
) -> grpc.Channel:
    """A channel to ``address`` ("host:port" or a gRPC target such as "dns:///name:port").

    With TLS, ``tls_name`` is the host name the server certificate must carry
    when ``address`` is an IP address resolved from that name.
    """
    check_target(address)
    credentials = security.channel_credentials() if security is not None else None
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
    if tls_name:
        options.append(("grpc.ssl_target_name_override", tls_name))
    return grpc.secure_channel(address, credentials, options=options)


def _stub(channel: grpc.Channel) -> batchwire_pb2_grpc.BatchwireStub:
    # protoc's gRPC gencode (batchwire_pb2_grpc) carries no annotations, and no stubs.
    return batchwire_pb2_grpc.BatchwireStub(channel)  # type: ignore[no-untyped-call]


class Transport:
    """Calls to servers with one set of credentials (thread-safe). A channel per server
    opens on first use, and again after a fork: a forked process (a DataLoader worker)
    never uses its parent's channels. ``on_open`` sees each channel opened."""

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

    def open_pull(self, server: Server, requests: Iterator[pb.PullRequest]) -> grpc.Call:
        """A ``PullBatches`` call on ``server`` sending ``requests``. It yields each batch
        message as the bytes received (no deserializer): the client parses them without
        copying the image payload (``batchwire.common.batch_codec``). The caller maps
        its errors (``map_rpc_errors``): whether one is retried is the caller's to say."""
        pull = self.channel(server).stream_stream(
            _PULL_METHOD,
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=None,
        )
        return pull(requests, metadata=self.metadata)

    def describe(self, server: Server, dataset: str, *, timeout: float) -> pb.DatasetInfo:
        """``dataset`` as ``server`` describes it."""
        with map_rpc_errors(server.address):
            info: pb.DatasetInfo = self.describe_future(server, dataset, timeout=timeout).result()
        return info

    def describe_future(self, server: Server, dataset: str, *, timeout: float) -> grpc.Future:
        """A ``DescribeDataset`` call under way; read its result under ``map_rpc_errors``."""
        future: grpc.Future = _stub(self.channel(server)).DescribeDataset.future(
            pb.DescribeDatasetRequest(dataset=dataset), timeout=timeout, metadata=self.metadata
        )
        return future

    def preprocess(
        self, server: Server, request: pb.PreprocessRequest, *, timeout: float
    ) -> grpc.Future:
        """A ``Preprocess`` call under way; read its result under ``map_rpc_errors``."""
        call = _stub(self.channel(server)).Preprocess
        future: grpc.Future = call.future(request, timeout=timeout, metadata=self.metadata)
        return future

    def __getstate__(self) -> dict[str, object]:
        # A copy (a spawned worker) opens channels of its own.
        return {"_security": self._security, "_on_open": self._on_open}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._channels, self._pid, self.shares_memory = {}, os.getpid(), {}

    def close(self) -> None:
        """Close this process's channels (a parent's are left to the parent)."""
        if self._pid == os.getpid():
            for channel in self._channels.values():
                channel.close()
        self._channels = {}


def describe_dataset(
    transport: Transport, servers: ServerSet, spec: StreamSpec, *, timeout: float
) -> pb.DatasetInfo:
    """``spec``'s dataset as the first server that answers describes it, with ``spec``
    checked against what that server announces: NOT_FOUND if it has no such dataset or
    no such pipeline, INVALID_ARGUMENT (in the server's words) for a parameter the
    pipeline lacks or out of its range, or a batch over the server's limit."""
    error: BatchwireError | None = None
    for start in range(len(servers.servers())):
        server = servers.pick(start)
        try:
            info = transport.describe(server, spec.dataset, timeout=timeout)
        except BatchwireError as exc:
            if exc.code not in RETRIABLE:
                raise
            error = exc
            servers.mark_failed(server)
            continue
        pipeline = next((p for p in info.pipelines if p.name == spec.pipeline), None)
        if pipeline is None:
            known = ", ".join(p.name for p in info.pipelines)
            raise NotFoundError(
                f"server {server.address} has no pipeline {spec.pipeline!r} (it has: {known})"
            )
        try:
            check_params(spec.pipeline, spec.params, announced_ranges(pipeline))
            check_batch_size(spec.batch_size, info.max_batch_size)
        except ValueError as exc:
            raise InvalidArgumentError(f"{server.address}: {exc}") from None
        return info
    assert error is not None
    raise error


def find_workers(transport: Transport, servers: ServerSet, dataset: str, *, timeout: float) -> None:
    """Ask each server not yet asked whether it is a unit of workers (``batchwire serve
    --workers N``): one that announces its workers' own ports is replaced in ``servers``
    by those of them that answer from here, so that a pass pulls from every worker rather
    than from the one the unit's port hands this process's connection to. Where none
    answers (a firewall, a container that publishes the unit's port alone), the unit's
    own address is kept, with a warning once. A server that does not answer now is
    taken as it is."""
    for server in servers.unexplored():
        host = server.address.rpartition(":")[0]
        if not _HOST_PORT.fullmatch(server.address):
            servers.expand(server, ())  # a gRPC target (unix:, ipv4:) names no host to reuse
            continue
        try:
            info = transport.describe(server, dataset, timeout=timeout)
        except BatchwireError:
            servers.expand(server, ())
            continue
        workers = [Server(f"{host}:{port}", server.tls_name) for port in info.worker_ports]
        futures = [transport.describe_future(w, dataset, timeout=timeout) for w in workers]
        reached, missed = [], []
        for worker, future in zip(workers, futures, strict=True):
            try:
                with map_rpc_errors(worker.address):
                    future.result()
                reached.append(worker)
            except BatchwireError as exc:
                missed.append(f"{worker.address} ({rpc_details(exc)})")
        servers.expand(server, reached)
        if missed:
            log.warning(
                "%s is a unit of %d workers, and %s did not answer from here: %s; open "
                "the workers' own ports (batchwire serve --worker-port) to this host to pull "
                "from every worker",
                server.address,
                len(workers),
                ", ".join(missed),
                "this process pulls from the others"
                if reached
                else "this process pulls through the unit's port, from the worker it hands "
                "this connection to",
            )


def announced_ranges(pipeline: pb.PipelineInfo) -> dict[str, ParamRange]:
    """The ranges of ``pipeline``'s parameters as its server announces them; a server that
    names a parameter without its range (an older one) leaves only finite values checked."""
    unknown = ParamRange(low=-math.inf, high=math.inf)
    return {
        name: ParamRange.from_proto(pipeline.param_ranges[name])
        if name in pipeline.param_ranges
        else unknown
        for name in pipeline.params
    }


def check_health(
    address: str,
    *,
    service: str = "",
    timeout: float = 5.0,
    security: ChannelSecurity | None = None,
    tls_name: str | None = None,
) -> str:
    """The status ``address`` reports for ``service`` ("" is the whole server), e.g. "SERVING".

    Raises the ``BatchwireError`` that fits, e.g. ``UnavailableError`` when nothing
    answers and ``AuthenticationError`` when the server refuses the credentials.
    """
    with open_channel(address, security, tls_name=tls_name) as channel, map_rpc_errors(address):
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=timeout,
            metadata=security.metadata() if security is not None else (),
        )
    status: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return status


def list_datasets(
    address: str,
    *,
    timeout: float = 5.0,
    security: ChannelSecurity | None = None,
    tls_name: str | None = None,
) -> list[str]:
    """The names of the datasets ``address`` serves, sorted; ``[]`` for a server that found
    none under its data directory (its health then stays NOT_SERVING).

    Raises the ``BatchwireError`` that fits, as ``check_health`` does.
    """
    with open_channel(address, security, tls_name=tls_name) as channel, map_rpc_errors(address):
        response = _stub(channel).ListDatasets(
            pb.ListDatasetsRequest(),
            timeout=timeout,
            metadata=security.metadata() if security is not None else (),
        )
    return sorted(dataset.name for dataset in response.datasets)
