"""``batchwire serve --workers N``: N server processes behind one port.

One server process shares one interpreter lock between its record path (LMDB reads,
protobuf parsing), its message builds and gRPC, so one process cannot keep several
GPUs busy. A :class:`WorkerUnit` runs N :class:`BatchwireServer` processes on the
same port, as gRPC's own Python multiprocessing example does: the parent reserves
the port with a SO_REUSEPORT socket it never listens on, then spawns the workers,
each binding the port with ``grpc.so_reuseport``; the kernel spreads *connections*
(not calls) over them. The parent creates no gRPC object, and workers are spawned,
not forked (gRPC forbids a fork after it is initialized).

The kernel's spread is a hash: one trainer process, whose channels share a connection,
would land on one worker. So each worker also listens on a port of its own (reserved
by the parent the same way, ``worker_port`` and after), and every worker announces
them all in its dataset descriptions: a client that reaches them pulls from every
worker, as from the servers of a fleet.

Contracts:

* Any worker serves any stream: an epoch's order is a pure function of (seed, epoch),
  and a call lives on one connection, so on one worker.
* Health is one answer (see :class:`~batchwire.server.serving.WorkerStates`): SERVING only while every worker is.
* :meth:`WorkerUnit.stop` drains every worker (SIGTERM to each; each drains as a lone
  server does) and returns within ``grace`` plus a small margin.
* A worker that dies is not restarted: :meth:`WorkerUnit.failed` says so, and
  ``batchwire serve`` stops the others and exits non-zero, for the orchestrator to
  restart the whole unit (a half unit would report NOT_SERVING forever anyway).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import CollectorRegistry

from batchwire.server.config import ServerConfig
from batchwire.server.engine import DevicePlan, pipeline_threads, usable_cpus
from batchwire.server.errors import ServerError
from batchwire.server.serving import (
    Listening,
    MetricsError,
    MetricsHTTPServer,
    RingBudget,
    State,
    WorkerStates,
    check_port_free,
)
from batchwire.server.workers._metrics import WorkerMetricsCollector
from batchwire.server.workers._process import (
    LISTENING,
    WorkerSpec,
    run_worker,
)

__all__ = ["WorkerUnit", "plan_workers"]

log = logging.getLogger(__name__)

_START_TIMEOUT = 180.0  # seconds for every worker to import, open datasets and listen
_STOP_MARGIN = 5.0  # seconds past the grace for workers to close their engines
_KILL_WAIT = 5.0


# Worker processes a GPU gets by default, and the usable CPUs each needs: one process is
# bound by its interpreter lock well below what DALI alone does on a GPU, and four on 16
# cores came closest to it, eight no nearer (the figures: docs/performance.md, "On a GPU
# host").
WORKERS_PER_GPU = 4
CPUS_PER_WORKER = 4


def default_workers(gpus: int, usable: int) -> int:
    """Worker processes for ``gpus`` GPUs and ``usable`` CPUs: up to ``WORKERS_PER_GPU`` a
    GPU, one per ``CPUS_PER_WORKER`` CPUs, at least one a GPU."""
    per_gpu = max(1, min(WORKERS_PER_GPU, usable // (CPUS_PER_WORKER * max(1, gpus))))
    return max(1, gpus) * per_gpu


def plan_workers(
    config: ServerConfig, gpu_count: int | None = None, usable: int | None = None
) -> list[dict[str, Any]]:
    """What each worker changes of ``config``: one dict per worker.

    ``workers`` unset: on a host where a GPU is visible, :func:`default_workers` for the GPUs
    of the device plan and the CPUs this process may use, the GPUs dealt out in turn (each
    worker given one, ``devices`` narrowed to it); one worker on the CPU. ``workers`` set:
    that many; on a GPU host worker i takes every N-th GPU from the i-th (or GPU i mod count
    when workers outnumber GPUs). With ``num_threads`` unset each worker's DALI threads are
    its share of the CPUs the unit may use (``_cpus``; on GPUs at most ``GPU_THREADS_CAP``).
    ``gpu_count`` (None: ask CUDA) and ``usable`` (None: this process's CPUs) let this be
    tested anywhere. Raises ``DeviceError`` as ``DevicePlan.resolve`` does.
    """
    plan = DevicePlan.resolve(config.device, config.devices, gpu_count)
    usable = usable_cpus() if usable is None else usable
    if plan.kind == "gpu":
        ids = [i for i in plan.device_ids if i is not None]
        count = config.workers or default_workers(len(ids), usable)
        if count == 1:
            return [{}]
        threads = pipeline_threads(config.num_threads, "gpu", count, usable)
        return [
            {
                "device": "gpu",
                "devices": tuple(ids[i::count]) or (ids[i % len(ids)],),
                "num_threads": threads,
            }
            for i in range(count)
        ]
    count = config.workers or 1
    if count == 1:
        return [{}]
    threads = config.num_threads or max(1, usable // count)
    return [{"num_threads": threads} for _ in range(count)]


@dataclasses.dataclass(frozen=True)
class _Given:
    """A config source that is the config itself (no custom pipeline from a file)."""

    config: ServerConfig

    def __call__(self) -> ServerConfig:
        return self.config


class WorkerUnit(Listening):
    """N worker processes serving ``config`` on one port; ``start()``, ``failed()``,
    ``stop(grace)``, with ``port``, ``metrics_port`` and ``target`` once started.

    ``source`` rebuilds the config in each worker (default: ``config`` pickled, which
    holds only where no pipeline function was loaded from a file); ``setup(index)``
    configures a worker's logging.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        source: Callable[[], ServerConfig] | None = None,
        setup: Callable[[int], None] | None = None,
        gpu_count: int | None = None,
    ) -> None:
        self.config = config
        self._plans = plan_workers(config, gpu_count)
        self._source = source or _Given(config)
        self._setup = setup
        self._context = multiprocessing.get_context("spawn")
        self._states = WorkerStates.create(self._context, len(self._plans))
        # One budget of shared memory for the unit, not one a worker.
        self._ring_budget = RingBudget.for_unit(self._context, config.shared_memory_mib * 2**20)
        self._processes: list[BaseProcess] = []
        self._pipes: list[multiprocessing.connection.Connection] = []
        self._metrics_ports: list[int | None] = [None] * len(self._plans)
        self._reserved: socket.socket | None = None
        self._reserved_own: list[socket.socket] = []
        self._worker_ports: tuple[int, ...] = ()
        self._metrics_http: MetricsHTTPServer | None = None
        self._port = 0

    @property
    def workers(self) -> int:
        return len(self._plans)

    @property
    def worker_ports(self) -> tuple[int, ...]:
        """Each worker's own port, once started (empty for a unit of one)."""
        return self._worker_ports

    def start(self, timeout: float = _START_TIMEOUT) -> None:
        """Reserve the port, serve the unit's metrics, spawn the workers and return
        once every one listens (warm-up continues). ``ServerError`` when the port is
        taken or a worker cannot start (its message), with every worker stopped."""
        host = self.config.host
        check_port_free(host, self.config.port)
        self._reserved, self._port = _reserve_port(host, self.config.port)
        try:
            if self.workers > 1:
                self._reserve_own_ports()
            if self.config.metrics_port is not None:
                self._metrics_http = self._serve_metrics()
            for index, plan in enumerate(self._plans):
                self._spawn(index, plan)
            self._wait_listening(time.monotonic() + timeout)
        except BaseException:
            self.stop(grace=0)
            raise
        log.info(
            "%d workers on %s:%d (SO_REUSEPORT: connections spread over them)%s",
            self.workers,
            host,
            self._port,
            f", each also on its own port: {', '.join(map(str, self._worker_ports))}"
            if self._worker_ports
            else "",
        )

    def failed(self) -> str | None:
        """A description of the first worker whose process ended, else None."""
        for index, process in enumerate(self._processes):
            if process.exitcode is not None:
                self._states.set(index, State.EXITED)
                return f"worker {index} (pid {process.pid}) exited with status {process.exitcode}"
        return None

    def rescan(self) -> None:
        """Forward SIGHUP to every live worker: each rescans the data directory."""
        for process in self._processes:
            if process.exitcode is None and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGHUP)

    def stop(self, grace: float) -> bool:
        """Drain every worker (SIGTERM), wait ``grace`` seconds plus a margin, kill what
        is left; whether every worker exited with status 0."""
        for process in self._processes:
            if process.exitcode is None:
                process.terminate()  # SIGTERM: the worker drains
        deadline = time.monotonic() + grace + _STOP_MARGIN
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for index, process in enumerate(self._processes):
            if process.exitcode is None:
                log.error("worker %d did not stop within the grace period: killed", index)
                process.kill()
                process.join(_KILL_WAIT)
            self._states.set(index, State.EXITED)
        clean = all(process.exitcode == 0 for process in self._processes)
        for pipe in self._pipes:
            pipe.close()
        if self._metrics_http is not None:
            self._metrics_http.stop()
            self._metrics_http = None
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        for reserved in self._reserved_own:
            reserved.close()
        self._reserved_own = []
        return clean

    # -- internals --------------------------------------------------------------------

    def _serve_metrics(self) -> MetricsHTTPServer:
        registry = CollectorRegistry()
        registry.register(
            WorkerMetricsCollector(
                self._states,
                lambda: list(self._metrics_ports),
                lambda: sum(1 for process in self._processes if process.exitcode is None),
            )
        )
        try:
            return MetricsHTTPServer(registry, self.config.host, self.config.metrics_port or 0)
        except MetricsError as exc:
            raise ServerError(str(exc)) from exc

    def _reserve_own_ports(self) -> None:
        """Reserve each worker's own port: ``worker_port`` and the ones after it, by
        default those after the unit's port (any free ones where either is 0)."""
        host = self.config.host
        first = self.config.worker_port
        if first is None:
            first = self._port + 1 if self.config.port else 0
        if first and first <= self._port < first + self.workers:
            raise ServerError(
                f"the workers' own ports {first} to {first + self.workers - 1} include the "
                f"unit's port {self._port}: pick --worker-port outside it"
            )
        for index in range(self.workers):
            port = first + index if first else 0
            if port > 65535:
                raise ServerError(
                    f"worker {index}'s own port would be {port}: pick a lower --worker-port"
                )
            check_port_free(host, port, "--worker-port")
            reserved, _ = _reserve_port(host, port, "--worker-port")
            self._reserved_own.append(reserved)
        self._worker_ports = tuple(s.getsockname()[1] for s in self._reserved_own)

    def _spawn(self, index: int, plan: dict[str, Any]) -> None:
        overrides = {**plan, "port": self._port, "metrics_port": None, "workers": 1}
        spec = WorkerSpec(
            index=index,
            source=self._source,
            overrides=overrides,
            setup=self._setup,
            metrics=self.config.metrics_port is not None,
            ring_budget=self._ring_budget,
            worker_ports=self._worker_ports,
        )
        ours, theirs = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=run_worker,
            args=(spec, self._states, theirs),
            name=f"batchwire-worker-{index}",
            # Not daemonic: the parent stops its workers itself, draining them first.
            daemon=False,
        )
        process.start()
        theirs.close()  # the worker's end: EOF here when it exits
        self._processes.append(process)
        self._pipes.append(ours)

    def _wait_listening(self, deadline: float) -> None:
        waiting = dict(enumerate(self._pipes))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServerError(
                    f"workers {sorted(waiting)} did not listen within {_START_TIMEOUT:.0f}s"
                )
            ready = multiprocessing.connection.wait(list(waiting.values()), remaining)
            for index, pipe in list(waiting.items()):
                if pipe not in ready:
                    continue
                del waiting[index]
                try:
                    kind, value = pipe.recv()
                except EOFError:
                    self._processes[index].join(_KILL_WAIT)
                    code = self._processes[index].exitcode
                    raise ServerError(
                        f"worker {index} exited with status {code} before it listened "
                        "(its log is above)"
                    ) from None
                if kind != LISTENING:
                    raise ServerError(str(value))
                self._metrics_ports[index] = value


def _reserve_port(host: str, port: int, flag: str = "--port") -> tuple[socket.socket, int]:
    """A bound, never listening SO_REUSEPORT socket holding ``port`` (0: a free one) for
    the workers while the unit runs, and the port."""
    address = host.strip("[]") or None
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ServerError(f"cannot listen on {host}:{port}: {exc}") from exc
    # The first of the host's addresses this host has (``localhost``: 127.0.0.1 or ::1,
    # whichever comes first of those that are up; the workers bind every one).
    missing: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            reserved = socket.socket(family, kind, proto)
        except OSError as exc:
            missing = missing or exc
            continue
        try:
            reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            reserved.bind(sockaddr)
        except OSError as exc:
            reserved.close()
            if exc.errno == errno.EADDRNOTAVAIL:
                missing = missing or exc
                continue
            raise ServerError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc} (pick another with {flag})"
            ) from exc
        return reserved, reserved.getsockname()[1]
    if address == "::":
        # A host without IPv6: "[::]" means every IPv4 address, as gRPC takes it too.
        return _reserve_port("0.0.0.0", port, flag)
    raise ServerError(f"cannot listen on {host}:{port}: {missing}")
