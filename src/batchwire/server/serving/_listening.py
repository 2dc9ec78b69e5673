"""Where a server listens: whether its port is free before it binds (:func:`check_port_free`),
its gRPC server bound to an address (:func:`bind`), whether only this machine reaches it
(:func:`loopback_only`), what its start says of where it listens and who can reach it
(:func:`announce`), and its addresses once it listens (:class:`Listening`), for a lone
server and a unit alike."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Sequence

import grpc

from batchwire.server.errors import ServerError
from batchwire.server.serving._metrics import MetricsHTTPServer
from batchwire.server.serving._security import ServerSecurity

__all__ = ["Listening", "announce", "bind", "check_port_free", "loopback_only"]

# The server's logger, not this module's: the lines its start says (docs/operations.md,
# Logs) keep the logger operators filter them by.
log = logging.getLogger("batchwire.server.serving._server")
# Hosts that listen on every interface of the machine.
_EVERY_INTERFACE = frozenset({"", "[::]", "::", "0.0.0.0", "*"})
# What the start says of a host that only this machine reaches.
_THIS_MACHINE = "this machine only: --host 0.0.0.0 serves other hosts"


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


def bind(
    server: grpc.aio.Server, where: str, flag: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind ``server`` to ``where`` (HOST:PORT) with ``credentials`` (None: plaintext) and
    return the port bound; ServerError, naming the ``flag`` that picks another, where it
    cannot."""
    try:
        if credentials is None:
            return server.add_insecure_port(where)
        return server.add_secure_port(where, credentials)
    except RuntimeError as exc:
        raise ServerError(
            f"cannot listen on {where} (is another process using the port? pick "
            f"another with {flag})"
        ) from exc


def announce(
    host: str,
    port: int,
    security: ServerSecurity,
    *,
    own: str | None,
    metrics_port: int | None,
    gpus: Sequence[int | None] | None,
) -> None:
    """Log where a server that started listens (on ``host``'s ``port``, a unit worker's
    ``own`` address too, ``/metrics`` on ``metrics_port``), on which GPUs its pipelines run
    (None: not on GPUs), and warn where tokens travel in plaintext or anyone who reaches
    the host can read the datasets."""
    local = loopback_only(host)
    log.info(
        "listening on %s:%d (%s%s)",
        host,
        port,
        f"{_THIS_MACHINE}; " if local else "",
        security.describe(),
    )
    if own is not None:
        log.info("and on %s, this worker's own port", own)
    if metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", host, metrics_port)
    if gpus is not None:
        log.info("pipelines on GPUs %s; new streams spread over them", list(gpus))
    if security.tokens and not security.tls:
        log.warning("bearer tokens without TLS: anyone on the network path can read them")
    if not local and not (security.tls or security.tokens):
        log.warning(
            "listening on %s in plaintext with no token: anyone who can reach this host "
            "on port %d can read the datasets. Leave out --host (or pass --host "
            "localhost) to serve this machine only, or pass --tls-cert/--tls-key and "
            "--token-file (docs/security.md)",
            f"every interface ({host})" if host in _EVERY_INTERFACE else host,
            port,
        )
