"""The servers a loader streams from, and which of them currently answer.

Targets are ``host:port`` strings or ``dns:///name:port``, which is resolved
here to one server per address so that a pass pulls from every server behind
the name (gRPC's own DNS resolver would send a channel to one of them), and
again during a pass (``refresh``) so that servers that join are used. A server
that is a unit of workers (``batchwire serve --workers N``) is replaced by its workers'
own addresses once they are known (``expand``), so that a pass pulls from each. A server
that fails is avoided for ``cooldown`` seconds by the calls that pick one
(``pick``: dataset descriptions). This module makes no calls: a transport does.
"""

from __future__ import annotations

import functools
import random
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from batchwire.client._transport import (
    InvalidArgumentError,
    Server,
    StatusCode,
    UnavailableError,
    check_target,
)

__all__ = ["RETRIABLE", "ServerSet", "backoff", "checked_targets", "resolve"]

# Codes after which the same stream may continue elsewhere from its cursor.
RETRIABLE = frozenset(
    {
        StatusCode.UNAVAILABLE,
        StatusCode.DEADLINE_EXCEEDED,
        StatusCode.CANCELLED,
        StatusCode.RESOURCE_EXHAUSTED,
    }
)
_DNS = "dns:///"


def checked_targets(address: str | Sequence[str]) -> tuple[str, ...]:
    """The targets a loader is given as ``address``: one, or a list of them, each checked."""
    addresses = (address,) if isinstance(address, str) else tuple(address)
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise InvalidArgumentError("address must be 'host:port', a gRPC target, or a list of them")
    return tuple(check_target(target) for target in addresses)


def resolve(targets: Sequence[str]) -> list[Server]:
    """Servers behind ``targets``, in a stable order (resolved addresses sorted)."""
    servers: list[Server] = []
    for target in targets:
        if not target.startswith(_DNS):
            servers.append(Server(target))
            continue
        host, _, port = target[len(_DNS) :].rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgumentError(f"{target!r} is not dns:///host:port")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            raise UnavailableError(f"cannot resolve {host!r} ({exc}); is the name right?") from exc
        ips = sorted({str(info[4][0]) for info in infos})
        servers += [Server(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}", host) for ip in ips]
    unique = list(dict.fromkeys(servers))
    if not unique:
        raise UnavailableError(f"no server address in {targets!r}")
    return unique


def backoff(attempt: int, base: float = 0.1, cap: float = 2.0) -> float:
    """Seconds to wait before retry ``attempt`` (0, 1, ...): capped exponential, jittered."""
    return min(cap, base * 2.0**attempt) * random.uniform(0.5, 1.0)


class ServerSet:
    """The servers behind a loader's targets, and which of them failed lately; shared by
    its pullers, thread-safe."""

    def __init__(self, targets: Sequence[str], *, cooldown: float = 5.0) -> None:
        self._targets = tuple(targets)
        self._cooldown = cooldown
        self._lock = threading.Lock()
        self._servers: list[Server] | None = None
        self._failed_at: dict[Server, float] = {}
        # What each server was found to be: [] where it is one server, else its workers.
        self._workers: dict[Server, list[Server]] = {}
        # Servers whose streams failed and have not delivered since: when the outage
        # began, and the failures counted in it (by every pass of the loader).
        self._outages: dict[Server, tuple[float, int]] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (spawned DataLoader workers, ddp_spawn) knows the targets, not what was
        # learned of them: it resolves them, and finds a unit's workers, again.
        return (functools.partial(ServerSet, cooldown=self._cooldown), (self._targets,))

    def servers(self) -> list[Server]:
        """The servers to pull from: a unit's workers in place of the unit."""
        with self._lock:
            if self._servers is None:
                self._servers = resolve(self._targets)
            return self._expanded(self._servers)

    def _expanded(self, servers: list[Server]) -> list[Server]:
        out: list[Server] = []
        for server in servers:
            out += self._workers.get(server) or [server]
        return list(dict.fromkeys(out))

    def unexplored(self) -> list[Server]:
        """The servers behind the targets not yet asked whether they are units."""
        with self._lock:
            if self._servers is None:
                self._servers = resolve(self._targets)
            return [server for server in self._servers if server not in self._workers]

    def expand(self, server: Server, workers: Sequence[Server]) -> None:
        """``server`` is a unit whose ``workers`` this process reaches (none: use
        ``server`` itself, which hands a connection to one of its workers)."""
        with self._lock:
            self._workers[server] = list(workers)

    @property
    def dynamic(self) -> bool:
        """Whether a target is a name whose addresses may change."""
        return any(t.startswith(_DNS) for t in self._targets)

    def refresh(self) -> list[Server]:
        """The servers behind the targets now (resolved again)."""
        servers = resolve(self._targets)
        with self._lock:
            self._servers = servers
            return self._expanded(servers)

    def pick(self, start: int) -> Server:
        """Server ``start`` (modulo their number) if it has not failed lately, else the
        next one that has not."""
        servers = self.servers()
        now = time.monotonic()
        with self._lock:
            start %= len(servers)
            ordered = servers[start:] + servers[:start]
            for server in ordered:
                failed = self._failed_at.get(server)
                if failed is None or now - failed >= self._cooldown:
                    return server
            # All cooling down: the one that failed longest ago.
            return min(ordered, key=lambda s: self._failed_at.get(s, 0.0))

    def mark_failed(self, server: Server) -> None:
        with self._lock:
            self._failed_at[server] = time.monotonic()
            if any(t.startswith(_DNS) for t in self._targets):
                self._servers = None  # the name may point elsewhere by now

    def outage(self, server: Server) -> int:
        """Count a failure of a stream from ``server``: the failures of its outage so far,
        this one included (1: this one began it). The outage ends at ``mark_ok``."""
        with self._lock:
            began, failures = self._outages.get(server, (time.monotonic(), 0))
            self._outages[server] = (began, failures + 1)
            return failures + 1

    def mark_ok(self, server: Server) -> tuple[float, int] | None:
        """``server`` delivered: the seconds and failures of the outage this ends, if it
        was in one."""
        with self._lock:
            self._failed_at.pop(server, None)
            outage = self._outages.pop(server, None)
        if outage is None:
            return None
        return time.monotonic() - outage[0], outage[1]
