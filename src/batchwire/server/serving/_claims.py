"""What the server's two claim ports share: the shared memory broker's Unix socket and the
bulk connections' TCP port each accept connections that claim a grant with its key."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from batchwire.common.shared_memory import warn_once

__all__ = ["MAX_CLAIMING", "accept_claims", "receive"]

MAX_CLAIMING = 64  # claims a port serves at once; more connections are closed


async def accept_claims(
    listening: socket.socket,
    claim: Callable[[socket.socket], Coroutine[Any, Any, None]],
    claiming: set[asyncio.Task[None]],
    log: logging.Logger,
    what: str,
) -> None:
    """Accept connections on ``listening`` (non-blocking) until cancelled, each claimed in
    a task of its own (``claim``, which closes it), at most MAX_CLAIMING at once."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            connection, _ = await loop.sock_accept(listening)
        except OSError as exc:  # no descriptors left, say: try again shortly
            warn_once(log, "accept", "could not accept a %s (%s)", what, exc)
            await asyncio.sleep(0.1)
            continue
        if len(claiming) >= MAX_CLAIMING:
            connection.close()
            continue
        task = loop.create_task(claim(connection))
        claiming.add(task)
        task.add_done_callback(claiming.discard)


async def receive(loop: asyncio.AbstractEventLoop, connection: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes from ``connection``; EOFError if it closes first."""
    data = b""
    while len(data) < size:
        more = await loop.sock_recv(connection, size - len(data))
        if not more:
            raise EOFError("the client closed the connection")
        data += more
    return data
