"""``BatchwireServer``: the gRPC server around the engine, with health and reflection.

Usable in-process (tests, ``batchwire demo``) and from ``batchwire serve``::

    server = BatchwireServer(ServerConfig(data_dir="data", port=0))
    server.start()               # returns once listening; warm-up continues
    server.wait_serving(60)      # health reports SERVING
    print(server.target)         # "localhost:PORT"
    server.rescan()              # datasets added, replaced or removed since (also on a timer)
    server.stop(grace=10)        # NOT_SERVING, refuse new streams, drain, stop

The server runs its own event loop (:mod:`._event_loop`: uvloop where installed) in a
named thread. As one worker of ``batchwire serve --workers N`` (``member=``, see
:mod:`batchwire.server.workers`), it binds its port with SO_REUSEPORT beside its siblings
and its health service answers for the whole unit (:mod:`._health`).
TLS, mutual TLS and bearer tokens come from the config (:mod:`._security`); the constructor
reads those files, so a bad one is a ``ConfigError`` before anything is opened.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from batchwire.server.config import ServerConfig
from batchwire.server.engine import Change, Engine, wait_event
from batchwire.server.errors import ServerError
from batchwire.server.serving._bulk import bulk_broker
from batchwire.server.serving._event_loop import finish_tasks, new_loop
from batchwire.server.serving._health import UnitHealthServicer
from batchwire.server.serving._listening import Listening, announce, bind, check_port_free
from batchwire.server.serving._metrics import (
    METHODS,
    MetricsError,
    MetricsHTTPServer,
    ServerMetrics,
    server_info,
)
from batchwire.server.serving._rescans import Rescans
from batchwire.server.serving._ring_broker import ring_broker
from batchwire.server.serving._ring_budget import RingBudget
from batchwire.server.serving._security import ServerSecurity
from batchwire.server.serving._servicer import BatchwireServicer, add_to_server
from batchwire.server.serving._worker_states import State, UnitMember
from batchwire.v1 import batchwire_pb2

__all__ = ["SERVICE_NAME", "BatchwireServer"]

log = logging.getLogger(__name__)

SERVICE_NAME = batchwire_pb2.DESCRIPTOR.services_by_name["Batchwire"].full_name
_START_TIMEOUT = 30.0
_SHORT_TASK_THREADS = 8  # the pool's threads when no stream waits in one
# How often a worker of a unit reads its siblings' states: how long a probe may see
# another answer from one worker than from the next.
_UNIT_POLL_SECONDS = 0.25
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class BatchwireServer(Listening):
    def __init__(
        self,
        config: ServerConfig,
        *,
        member: UnitMember | None = None,
        ring_budget: RingBudget | None = None,
        worker_ports: Sequence[int] = (),
    ) -> None:
        """Raises ``ConfigError`` when a TLS or token file is missing or malformed.

        ``member``: this server is one worker of a unit sharing its port (SO_REUSEPORT):
        it publishes its state there and reports SERVING only while every worker of
        the unit does. ``ring_budget``: the shared memory its streams may hold, where it
        is the unit's (default: ``config.shared_memory_mib`` for this server alone).
        ``worker_ports``: a member's unit's own port of each worker, reserved by the unit
        (SO_REUSEPORT); this worker also listens on its own, and announces them all."""
        self.config = config
        self._member = member
        self._worker_ports = tuple(worker_ports) if member is not None else ()
        self._broker = ring_broker(config, ring_budget, 0 if member is None else member.index)
        self._reported: bool | None = None  # the serving state last set in health
        self.security = ServerSecurity.from_config(config)
        self._bulk = bulk_broker(config, self.security)
        self.engine = Engine(config)
        self.metrics = ServerMetrics()
        self.metrics.info.info(server_info(self.engine))
        self.metrics.watch_engine(self.engine.stats)
        self._metrics_http: MetricsHTTPServer | None = None
        # Streams are awaited on the event loop and only open, close and build Preprocess
        # replies here: a few threads, however many streams.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=_SHORT_TASK_THREADS, thread_name_prefix="batchwire-stream"
        )
        self._health = (
            health.aio.HealthServicer() if member is None else UnitHealthServicer(self._report)
        )
        self._warm = False  # warmed up with datasets: SERVING unless a device is broken
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._serving = threading.Event()
        self._start_error: BaseException | None = None
        self._stop_requested: asyncio.Event | None = None
        self._rescans: Rescans | None = None
        self._warm_lock: asyncio.Lock | None = None
        self._grace: float | None = None
        self._port = 0

    # -- public surface ----------------------------------------------------------------

    def start(self) -> None:
        """Open the datasets, listen, and warm a pipeline in the background."""
        self.engine.open_datasets()
        self.metrics.datasets.set(self.engine.num_datasets)
        if self.config.metrics_port is not None:
            try:
                self._metrics_http = MetricsHTTPServer(
                    self.metrics.registry, self.config.host, self.config.metrics_port
                )
            except MetricsError as exc:
                self.engine.close()
                raise ServerError(str(exc)) from exc
        self._thread = threading.Thread(target=self._run, name="batchwire-server", daemon=True)
        self._thread.start()
        if not self._listening.wait(_START_TIMEOUT):
            raise ServerError(f"the server did not start listening within {_START_TIMEOUT:.0f}s")
        if self._start_error is not None:
            raise ServerError(str(self._start_error)) from self._start_error

    def wait_serving(self, timeout: float) -> bool:
        """Whether health reached SERVING within ``timeout`` seconds."""
        return self._serving.wait(timeout)

    def rescan(self, timeout: float = 120.0) -> list[Change]:
        """Rescan the data directory now and return what changed, once served: new
        datasets listed and streamable, a replaced one's new version given to new
        streams, a removed one no longer listed. Where the server had no dataset yet,
        returns once the pipeline warm-up that follows is done (SERVING if it passed).

        Call it from any thread but the server's own; ``TimeoutError`` after
        ``timeout`` seconds. The server also rescans every ``rescan_interval`` seconds.
        """
        loop = self._loop
        rescans = self._rescans
        if loop is None or loop.is_closed() or rescans is None:
            raise ServerError("the server is not running")
        return asyncio.run_coroutine_threadsafe(rescans.once(), loop).result(timeout)

    def request_rescan(self) -> None:
        """Ask for a rescan soon, without waiting for it (safe in a signal handler)."""
        loop, rescans = self._loop, self._rescans
        if loop is None or rescans is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the server has stopped
            loop.call_soon_threadsafe(rescans.wanted.set)

    def stop(self, grace: float | None = 10.0) -> None:
        """Drain and stop: health NOT_SERVING, new streams refused, in-flight ones
        given ``grace`` seconds to finish before they are cancelled."""
        loop, requested = self._loop, self._stop_requested
        if loop is None or requested is None or loop.is_closed():
            return
        self._grace = grace
        self.engine.drain()
        loop.call_soon_threadsafe(requested.set)
        self.join((grace or 0) + _START_TIMEOUT)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the server to stop; whether it did within ``timeout``."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def __enter__(self) -> BatchwireServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(grace=1.0)

    # -- event loop thread -----------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop = new_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        except ServerError as exc:
            self._start_error = exc  # start() raises it, with a message that says enough
        except BaseException as exc:
            self._start_error = exc
            log.exception("server stopped with an error")
        finally:
            self._listening.set()
            # Let handlers still closing their streams finish (as asyncio.run
            # does), so none is destroyed pending when the loop closes.
            finish_tasks(loop)
            # Wait for stream threads (each at most one batch away from done)
            # before the datasets they read from are closed.
            self._executor.shutdown(wait=True, cancel_futures=True)
            if self._broker is not None:
                self._broker.close_rings()  # those whose streams' closes never ran
            if self._bulk is not None:
                self._bulk.shutdown()
            self.engine.close()
            if self._metrics_http is not None:
                self._metrics_http.stop()
            loop.close()

    async def _main(self) -> None:
        self._stop_requested = asyncio.Event()
        self._rescans = Rescans(
            self.engine,
            self.metrics,
            self._executor,
            interval=self.config.rescan_interval,
            changed=self._datasets_changed,
        )
        self._warm_lock = asyncio.Lock()
        server = self._server = self._grpc_server()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, _NOT_SERVING)
        loop = asyncio.get_running_loop()
        # Pipelines report a device broken or recovered from their own threads.
        self.engine.watch_devices(
            lambda: loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._report()))
        )
        await self._listen(server)
        if self._broker is not None:
            self._broker.start(self._port)  # else it grants nothing, and has said why
        if self._bulk is not None:
            port = self.config.bulk_port
            if port and self._member is not None:
                port += self._member.index
            self._bulk.start(self.config.host, port)  # else it grants nothing, as above
        self._listening.set()
        warm = asyncio.ensure_future(self._warm_up())
        rescans = asyncio.ensure_future(self._rescans.run())
        follow = None
        if self._member is not None:
            self._member.publish(State.WARMING)
            follow = asyncio.ensure_future(self._follow_unit())
        await self._stop_requested.wait()
        warm.cancel()
        rescans.cancel()
        if follow is not None:
            follow.cancel()
        await self._drain(server)
        if self._broker is not None:
            await self._broker.close()
        if self._bulk is not None:
            await self._bulk.close()

    def _grpc_server(self) -> grpc.aio.Server:
        """The gRPC server with its services (batchwire, health, reflection), not started."""
        server = grpc.aio.server(
            options=[
                # A unit's workers share the port; a lone server must find it free.
                ("grpc.so_reuseport", 0 if self._member is None else 1),
                ("grpc.max_send_message_length", -1),
                # Preprocess requests carry encoded images (config max_request_bytes).
                ("grpc.max_receive_message_length", self.config.max_request_bytes),
            ],
            # The metrics interceptor comes first, so it also counts the token check's refusals.
            interceptors=(self.metrics.interceptor(METHODS), *self.security.interceptors()),
        )
        servicer = BatchwireServicer(
            self.engine,
            self._executor,
            self.metrics,
            max_message_bytes=self.config.max_message_bytes,
            broker=self._broker,
            bulk=self._bulk,
            worker_ports=self._worker_ports,
        )
        add_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        return server

    async def _listen(self, server: grpc.aio.Server) -> None:
        """Bind the port and start ``server``; ServerError when the port is taken."""
        host = self.config.host
        if self._member is None:  # a unit's parent checked it, and holds it reserved
            check_port_free(host, self.config.port)
        credentials = self.security.server_credentials()
        self._port = bind(server, f"{host}:{self.config.port}", "--port", credentials)
        own = None
        if self._worker_ports and self._member is not None:
            own = f"{host}:{self._worker_ports[self._member.index]}"
            bind(server, own, "--worker-port", credentials)
        await server.start()
        devices = self.engine.devices
        announce(
            host,
            self._port,
            self.security,
            own=own,
            metrics_port=self.metrics_port,
            gpus=list(devices.device_ids) if devices.kind == "gpu" else None,
        )

    async def _warm_up(self) -> None:
        """Run the engine's warm-up unless warm already: SERVING once it passes with
        datasets. Runs at start and again after a rescan while not warm."""
        assert self._warm_lock is not None
        async with self._warm_lock:
            if self._warm or self.engine.draining:
                return
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self.engine.warm_up)
            except Exception:
                log.exception("pipeline warm-up failed: health stays NOT_SERVING")
                return
            if not self.engine.num_datasets:
                when = (
                    f"within {self.config.rescan_interval:g}s or on SIGHUP"
                    if self.config.rescan_interval
                    else "on SIGHUP (rescan_interval is 0)"
                )
                log.error(
                    "no datasets found under %s: health stays NOT_SERVING until one is "
                    "ingested there (`batchwire ingest`); the server sees it %s",
                    self.config.data_dir,
                    when,
                )
                return
            self._warm = True
        await self._report()
        log.info("SERVING %d datasets", self.engine.num_datasets)

    async def _datasets_changed(self) -> None:
        await self._warm_up()
        await self._report()

    async def _report(self) -> None:
        """Health as it stands: SERVING once warm, unless a device is broken (a CUDA
        error, or faults in a row: see ``PipelineHealth``), no dataset is left, or the
        server drains. As a unit's worker: this worker's state is published and the
        unit's reported (SERVING only while every worker is)."""
        if self.engine.draining:
            return  # NOT_SERVING already; draining keeps it so
        if not self._warm or self.engine.num_datasets == 0:
            own = State.WARMING  # not ready: warming up, or no dataset to serve yet
        else:
            own = State.BROKEN if self.engine.broken_devices() else State.SERVING
        if self._member is None:
            serving = own is State.SERVING
        else:
            self._member.publish(own)
            serving = self._member.unit_serving()
        if serving == self._reported:
            return
        previous, self._reported = self._reported, serving
        if self._member is not None and serving:
            log.info("the unit serves: every worker is SERVING")
        elif self._member is not None and previous:
            log.warning("the unit does not serve: a worker is warming, broken or draining")
        for service in ("", SERVICE_NAME):
            await self._health.set(service, _SERVING if serving else _NOT_SERVING)
        self.metrics.serving.set(1 if serving else 0)
        if serving:
            self._serving.set()

    async def _follow_unit(self) -> None:
        """Follow the siblings' states (they change in other processes) until stopped."""
        assert self._stop_requested is not None
        while not self._stop_requested.is_set():
            await self._report()
            await wait_event(self._stop_requested, _UNIT_POLL_SECONDS)

    async def _drain(self, server: grpc.aio.Server) -> None:
        """NOT_SERVING; new streams get UNAVAILABLE and streams in flight end with
        UNAVAILABLE at their next batch (clients resume elsewhere from their
        cursors); whatever is still running after ``grace`` seconds is cancelled."""
        log.info("draining: NOT_SERVING, refusing new streams, grace %ss", self._grace)
        self._serving.clear()
        self.metrics.serving.set(0)
        if self._member is not None:
            self._member.publish(State.DRAINING)
        await self._health.enter_graceful_shutdown()
        await server.stop(self._grace)
        log.info("stopped")
