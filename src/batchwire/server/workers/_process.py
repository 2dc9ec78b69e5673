"""One worker process of ``batchwire serve --workers N``: a whole :class:`BatchwireServer`
in its own interpreter, on the port its siblings share.

:func:`run_worker` is the target of a *spawned* process (gRPC must not be initialized
in a process that forks afterwards; a spawned child starts clean). It tells the parent
over a pipe whether it listens, drains on SIGTERM or SIGINT like a lone server, rescans
the data directory on SIGHUP (forwarded by the parent), and
drains too when its parent is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from batchwire.server.config import ConfigError, ServerConfig
from batchwire.server.engine import DeviceError
from batchwire.server.errors import DatasetError, ServerError
from batchwire.server.serving import (
    BatchwireServer,
    MetricsError,
    MetricsHTTPServer,
    RingBudget,
    State,
    WorkerStates,
    tune_for_large_buffers,
)

__all__ = ["LISTENING", "START_FAILED", "WorkerSpec", "run_worker"]

log = logging.getLogger(__name__)

# What a worker sends its parent once: (LISTENING, metrics port or None) or
# (START_FAILED, message).
LISTENING = "listening"
START_FAILED = "error"
_CHECK_SECONDS = 0.5  # how often a worker looks at its server and its parent
# Worker metrics are for the parent to collect, never for the network.
_LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker needs; picklable.

    ``source`` builds the unit's config in the worker (a config file's custom
    pipeline functions cannot travel by pickle: the worker loads them itself), then
    ``overrides`` apply (its port, its GPUs). ``setup(index)`` configures logging.
    ``metrics``: serve the worker's registry on a loopback port for the parent.
    ``ring_budget``: the shared memory the unit's workers hold together.
    ``worker_ports``: each worker's own port, reserved by the unit; this one listens on
    its own (``worker_ports[index]``) too, and announces them all.
    """

    index: int
    source: Callable[[], ServerConfig]
    overrides: Mapping[str, Any]
    setup: Callable[[int], None] | None = None
    metrics: bool = False
    ring_budget: RingBudget | None = None
    worker_ports: tuple[int, ...] = ()


def run_worker(spec: WorkerSpec, states: WorkerStates, parent: Connection) -> None:
    """Serve until SIGTERM/SIGINT (drain, exit 0), a server failure (exit 1) or a
    start-up error (its message to the parent, exit 2)."""
    stop = threading.Event()
    rescan: list[Callable[[], None]] = []  # the server's, once it exists

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    def on_hangup(signum: int, frame: object) -> None:
        for request in rescan:
            request()  # a wake-up for the server's rescan task

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)  # the parent forwards its SIGHUP
    if spec.setup is not None:
        spec.setup(spec.index)
    tune_for_large_buffers()
    parent_pid = os.getppid()
    member = states.member(spec.index)
    metrics: MetricsHTTPServer | None = None
    try:
        config = dataclasses.replace(spec.source(), **spec.overrides)
        server = BatchwireServer(
            config, member=member, ring_budget=spec.ring_budget, worker_ports=spec.worker_ports
        )
        server.start()
        rescan.append(server.request_rescan)
    except (ConfigError, ServerError, DatasetError, DeviceError) as exc:
        parent.send((START_FAILED, str(exc)))
        sys.exit(2)
    if spec.metrics:
        try:
            metrics = MetricsHTTPServer(server.metrics.registry, _LOOPBACK, 0)
        except MetricsError as exc:
            server.stop(grace=0)
            parent.send((START_FAILED, str(exc)))
            sys.exit(2)
    parent.send((LISTENING, None if metrics is None else metrics.port))
    code = 0
    while not stop.wait(_CHECK_SECONDS):
        if server.join(timeout=0):
            log.error("the server stopped unexpectedly")
            code = 1
            break
        if os.getppid() != parent_pid:
            # Orphaned (the parent was killed): drain rather than serve unsupervised.
            log.error("the parent process is gone: draining")
            break
    member.publish(State.DRAINING)
    server.stop(grace=config.grace)
    if metrics is not None:
        metrics.stop()
    parent.close()
    sys.exit(code)
