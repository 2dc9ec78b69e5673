"""Where a server listens: whether its port is free before it binds (:func:`check_port_free`),
whether only this machine reaches it (:func:`loopback_only`), and its addresses once it
listens (:class:`Listening`), for a lone server and a unit alike."""

from __future__ import annotations

import errno
import ipaddress
import socket

from batchwire.server.errors import ServerError
from batchwire.server.serving._metrics import MetricsHTTPServer

__all__ = ["Listening", "check_port_free", "loopback_only"]


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


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """ServerError if ``port`` is taken on ``host``: found before gRPC tries to bind, which
    would print a C++ error line of its own."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM)
    except OSError:
        return  # gRPC reports an unknown host itself
    # Every address of the host, as gRPC binds each (``localhost``: 127.0.0.1 and ::1).
    for family, kind, proto, _, sockaddr in dict.fromkeys(infos):
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this host lacks (IPv6 off): gRPC binds the others
        with probe:
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


def loopback_only(host: str) -> bool:
    """Whether a server on ``host`` is reached from this machine alone: ``localhost`` (which
    gRPC binds as 127.0.0.1 and ``::1``), a loopback address (``127.0.0.1``, ``[::1]``), or a
    name every address of which is one. Every interface (``[::]``, ``0.0.0.0``) and any
    other address are reached from other hosts."""
    name = host.strip("[]")
    if name.lower() == "localhost":
        return True
    if not name:
        return False
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # gRPC reports an unknown host itself
    addresses = {str(info[4][0]).partition("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
