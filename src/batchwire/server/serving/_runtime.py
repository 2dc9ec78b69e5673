"""What a server needs around its gRPC server: an event loop of its own, a free port, the
addresses it listens on, and a health service that answers for a unit of workers."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from grpc_health.v1 import health

from batchwire.server.serving._metrics import MetricsHTTPServer

__all__ = [
    "Listening",
    "ServerError",
    "UnitHealthServicer",
    "check_port_free",
    "finish_tasks",
    "new_loop",
]


class ServerError(RuntimeError):
    """The server could not start (port in use, bad data directory, ...)."""


class Listening:
    """A server's addresses once it listens: ``port``, ``metrics_port``, ``target``."""

    _port: int = 0
    _metrics_http: MetricsHTTPServer | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def metrics_port(self) -> int | None:
        """The port of ``/metrics`` once started, or ``None`` without ``metrics_port``."""
        return None if self._metrics_http is None else self._metrics_http.port

    @property
    def target(self) -> str:
        """An address clients on this host can use."""
        return f"localhost:{self._port}"


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on ``loop`` and run it to completion, then close async generators."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())


class UnitHealthServicer(health.aio.HealthServicer):
    """A unit worker's health service: it brings the unit's state up to date before it
    answers, so that every worker gives a probe the same answer (the siblings' states
    change in other processes; between two polls, workers could answer apart)."""

    def __init__(self, refresh: Callable[[], Awaitable[None]]) -> None:
        super().__init__()
        self._refresh = refresh

    async def Check(self, request: Any, context: Any) -> Any:
        await self._refresh()
        return await super().Check(request, context)

    async def Watch(self, request: Any, context: Any) -> None:
        await self._refresh()
        await super().Watch(request, context)


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """ServerError if ``port`` is taken on ``host``: found before gRPC tries to bind, which
    would print a C++ error line of its own."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM)
    except OSError:
        return  # gRPC reports an unknown host itself
    for family, kind, proto, _, sockaddr in infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: a port whose last server left connections in TIME_WAIT (a
            # restart) is free; one another process listens on is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ServerError(
                        f"cannot listen on {host}:{port}: another process is using the port "
                        f"(stop it, or pick another port with {flag})"
                    ) from None
