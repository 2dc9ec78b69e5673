"""Prometheus metrics of one server: a registry, the RPC error count, and ``/metrics`` over HTTP.

Each :class:`ServerMetrics` owns its own ``CollectorRegistry``, so several servers in
one process (tests, ``batchwire demo``) never share or clash over metric names.

What is measured (``dataset`` and ``pipeline`` labels only ever hold names the server
itself discovered or configured, so a hostile client cannot grow the label sets):

================================================  =========  =====================================
``batchwire_streams_started_total``               counter    streams opened
``batchwire_streams_ended_total``                 counter    streams ended, by ``status``: OK (every
                                                             batch asked for delivered), CANCELLED
                                                             (the client left early), UNAVAILABLE, ...
``batchwire_active_streams``                      gauge      streams open now
``batchwire_batches_sent_total``                  counter    batches handed to gRPC for clients
``batchwire_samples_sent_total``                  counter    samples in those batches
``batchwire_bytes_sent_total``                    counter    serialized bytes of those batches
``batchwire_shared_memory_bytes_total``           counter    image bytes of those batches sent
                                                             through shared memory (clients on
                                                             this host), not in their messages
``batchwire_bulk_bytes_total``                    counter    image bytes of those batches sent on
                                                             their streams' bulk connections
                                                             (clients on other hosts), not in
                                                             their messages
``batchwire_skipped_samples_total``               counter    undecodable samples left out
``batchwire_batches_with_skipped_samples_total``  counter    batches sent with a sample left out
                                                             (empty when all were)
``batchwire_pipeline_seconds``                    histogram  time to produce one batch (read,
                                                             DALI run, message build)
``batchwire_client_wait_seconds``                 histogram  time one batch waited for the client
                                                             to take it (gRPC flow control)
``batchwire_stream_seconds_total``,              counter    stream-seconds open, and those with a
``batchwire_stream_waiting_seconds_total``                   batch asked for and none ready (the
                                                             client waited on this server): see
                                                             :mod:`._stream_times`
``batchwire_stage_seconds_total``                 counter    seconds the pipelines' threads spent,
                                                             by ``stage``: ``read`` (LMDB, parse,
                                                             screen), ``pipeline`` (DALI's run),
                                                             ``encode`` (message build)
``batchwire_pipeline_*``,                         (see       what the pipeline slots do, how long
``batchwire_queue*``,                             below)     batches wait for them, pipeline
``batchwire_batches_failed_total``,                          faults and broken devices, by
``batchwire_device_healthy``                                 ``pipeline``: see :mod:`._collectors`
``batchwire_errors_total``                        counter    calls ended with a status other than
                                                             OK or CANCELLED (a client's choice),
                                                             by ``method`` and ``code``
``batchwire_dataset_rescans_total``               counter    rescans of the data directory (every
                                                             ``rescan_interval`` seconds, SIGHUP)
``batchwire_dataset_rescan_errors_total``         counter    rescans that failed (data directory
                                                             missing or unreadable)
``batchwire_datasets_changed_total``              counter    datasets a rescan found ``added``,
                                                             ``replaced`` or ``removed``, by
                                                             ``change``
``batchwire_datasets``                            gauge      datasets served now
``batchwire_serving``                             gauge      1 while health reports SERVING
``batchwire_server_info``                         info       version and devices
================================================  =========  =====================================
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import inspect
import logging
import socket
import socketserver
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, make_wsgi_app

from batchwire.server.engine import Engine, EngineStats
from batchwire.server.errors import MetricsError
from batchwire.server.serving._collectors import EngineCollector
from batchwire.server.serving._stream_times import StreamTimes
from batchwire.v1 import batchwire_pb2

__all__ = [
    "METHODS",
    "MetricsError",
    "MetricsHTTPServer",
    "MetricsInterceptor",
    "ServerMetrics",
    "server_info",
]

log = logging.getLogger(__name__)

# Methods whose errors are counted under their own name (anything else: "other").
METHODS = tuple(
    f"/{service.full_name}/{method.name}"
    for service in (
        batchwire_pb2.DESCRIPTOR.services_by_name["Batchwire"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
    )
    for method in service.methods
)

LABELS = ("dataset", "pipeline")
OTHER_METHOD = "other"
_NOT_ERRORS = frozenset({grpc.StatusCode.OK, grpc.StatusCode.CANCELLED})
_PIPELINE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 10.0, 30.0)


class ServerMetrics:
    """The metrics of one server, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._add_stream_metrics(self.registry)
        self._add_server_metrics(self.registry)
        # Stream-seconds open and waiting on the pipelines, counted up to each scrape.
        self.stream_times = StreamTimes()
        self.registry.register(self.stream_times)

    def _add_stream_metrics(self, r: CollectorRegistry) -> None:
        """The per-stream metrics, all labelled by dataset and pipeline."""
        counter = functools.partial(Counter, labelnames=LABELS, registry=r)
        histogram = functools.partial(Histogram, labelnames=LABELS, registry=r)
        self.streams_started = counter("batchwire_streams_started", "Streams opened.")
        self.streams_ended = counter(
            "batchwire_streams_ended",
            "Streams ended, by status: OK when every batch asked for was delivered.",
            labelnames=(*LABELS, "status"),
        )
        self.active_streams = Gauge(
            "batchwire_active_streams", "Streams open now.", LABELS, registry=r
        )
        self.batches_sent = counter(
            "batchwire_batches_sent", "Batches sent to clients (handed to gRPC)."
        )
        self.samples_sent = counter("batchwire_samples_sent", "Samples in the batches sent.")
        self.source_samples_sent = counter(
            "batchwire_mixture_samples_sent",
            "Samples of each dataset in the batches of mixtures sent (label dataset: the "
            "source's own).",
        )
        self.source_batches_sent = counter(
            "batchwire_mixture_batches_sent",
            "Batches of mixtures sent that held samples of the dataset (label dataset: the "
            "source's own).",
        )
        self.bytes_sent = counter(
            "batchwire_bytes_sent", "Serialized bytes of the batches sent (before gRPC framing)."
        )
        self.shared_memory_bytes = counter(
            "batchwire_shared_memory_bytes",
            "Image bytes of the batches sent through shared memory to clients on this host "
            "(not in their messages).",
        )
        self.bulk_bytes = counter(
            "batchwire_bulk_bytes",
            "Image bytes of the batches sent on their streams' bulk connections (TCP, beside "
            "the call; not in their messages).",
        )
        self.skipped_samples = counter(
            "batchwire_skipped_samples",
            "Samples left out of their batch because they could not be decoded.",
        )
        self.batches_with_skipped = counter(
            "batchwire_batches_with_skipped_samples",
            "Batches sent with at least one sample left out (empty when all were).",
        )
        self.pipeline_seconds = histogram(
            "batchwire_pipeline_seconds",
            "Seconds to produce one batch: LMDB read, DALI run, message build.",
            buckets=_PIPELINE_BUCKETS,
        )
        self.client_wait_seconds = histogram(
            "batchwire_client_wait_seconds",
            "Seconds one batch waited for the client to take it (flow control; "
            "high values mean slow or busy trainers).",
            buckets=_WAIT_BUCKETS,
        )

    def _add_server_metrics(self, r: CollectorRegistry) -> None:
        """The server's own metrics."""
        self.errors = Counter(
            "batchwire_errors",
            "Calls that ended with a status other than OK or CANCELLED.",
            ("method", "code"),
            registry=r,
        )
        self.serving = Gauge(
            "batchwire_serving", "1 while the health service reports SERVING.", registry=r
        )
        self.rescans = Counter(
            "batchwire_dataset_rescans", "Rescans of the data directory.", registry=r
        )
        self.rescan_errors = Counter(
            "batchwire_dataset_rescan_errors",
            "Rescans that failed: the data directory is missing or unreadable.",
            registry=r,
        )
        self.datasets_changed = Counter(
            "batchwire_datasets_changed",
            "Datasets a rescan found added, replaced (ingest --overwrite) or removed.",
            ("change",),
            registry=r,
        )
        for change in ("added", "replaced", "removed"):
            self.datasets_changed.labels(change=change)  # exported at 0 from the start
        self.datasets = Gauge("batchwire_datasets", "Datasets served now.", registry=r)
        self.info = Info("batchwire_server", "Version and devices of this server.", registry=r)

    def watch_engine(self, stats: Callable[[], EngineStats]) -> None:
        """Export the engine's figures (``batchwire_stage_seconds_total``,
        ``batchwire_pipeline_*``, ``batchwire_queue*``, ``batchwire_batches_failed_total``,
        ``batchwire_device_healthy``, ``batchwire_readahead_*``): ``stats()`` is read at
        each scrape."""
        self.registry.register(EngineCollector(stats))

    def interceptor(self, methods: Iterable[str]) -> MetricsInterceptor:
        """Counts ended calls by status code; ``methods`` are the full method names
        to label by name (anything else is counted as ``"other"``)."""
        return MetricsInterceptor(self.errors, methods)


# -- RPC errors by status code ---------------------------------------------------------


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call that ends with a status other than OK, whatever ended it:
    a servicer's abort, the token check, a failed handler. CANCELLED is left out:
    clients end streams that way when they stop early, or as soon as they hold the
    last batch (``batchwire_streams_ended_total`` tells those cases apart).

    It wraps the handler the rest of the chain returns, so it must come first
    in the server's interceptors."""

    def __init__(self, errors: Counter, methods: Iterable[str]) -> None:
        self._errors = errors
        self._methods = frozenset(methods)

    def _record(
        self, method: str, context: grpc.aio.ServicerContext, exc: BaseException | None
    ) -> None:
        code = context.code()
        if code is None and exc is not None:
            cancelled = isinstance(exc, asyncio.CancelledError | GeneratorExit)
            code = grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.UNKNOWN
        if code is None or code in _NOT_ERRORS:
            return
        label = method if method in self._methods else OTHER_METHOD
        self._errors.labels(method=label, code=code.name).inc()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._unary(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # request streaming (server reflection): not counted

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``behavior`` keeping its shape: an async generator stays one (the
        servicer's ``yield`` still waits for each write), a coroutine stays one."""
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                responses = behavior(request, context)
                try:
                    async for response in responses:
                        yield response
                except BaseException as exc:
                    self._record(method, context, exc)
                    raise
                else:
                    self._record(method, context, None)
                finally:
                    # Close the inner generator now, not at garbage collection: its
                    # ``finally`` returns the stream's pipeline to the pool.
                    await responses.aclose()

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                self._record(method, context, exc)
                raise
            self._record(method, context, None)
            return response

        return call


# -- /metrics over HTTP ----------------------------------------------------------------


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # seconds a scraper may take to send its request

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the server's log


class _Server(WSGIServer):
    def server_bind(self) -> None:
        # WSGIServer's own server_bind looks the host name up in DNS (getfqdn),
        # which can hang where DNS is slow; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name = "batchwire"
        self.server_port = self.socket.getsockname()[1]
        self.setup_environ()


def _http_host(host: str) -> str:
    """gRPC's ``[::]`` is HTTP's ``::``."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class MetricsHTTPServer:
    """Serves a registry at ``http://HOST:PORT/metrics`` from one named daemon thread.

    ``port=0`` picks a free port (see :attr:`port`). Raises :class:`MetricsError`
    when the address cannot be bound."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        address = _http_host(host)
        try:
            family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
            server_class = type("MetricsWSGIServer", (_Server,), {"address_family": family})
            self._httpd: WSGIServer = make_server(
                address, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
            )
        except OSError as exc:
            raise MetricsError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} "
                "(is another process using the port? choose another --metrics-port)"
            ) from exc
        self.host = host
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="batchwire-metrics",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket (waits for a scrape in progress)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(15)


def server_info(engine: Engine) -> dict[str, str]:
    """The labels of ``batchwire_server_info``: the version, the devices and threads."""
    try:
        version = importlib.metadata.version("batchwire")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    ids = engine.devices.device_ids
    return {
        "version": version,
        "device": engine.devices.kind,
        "gpus": ",".join(str(i) for i in ids if i is not None),
        "threads": str(engine.threads),
        "usable_cpus": str(engine.usable_cpus),
    }
