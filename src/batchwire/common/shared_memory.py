"""How a server hands one stream's shared memory to the client on its host: the rules
both sides keep (``batchwire.server.serving._shared_memory`` grants and makes rings,
``batchwire.client._transport._shared_memory`` claims and maps them).

Shared memory has no name. A ring is a memfd (``memfd_create``): memory that no
directory lists, that only the processes holding its descriptor can reach, and that the
kernel frees when the last of them lets go, however they end. A client offers to take
its batches that way (``SharedMemoryOffer``, with its pid and uid); a server that grants
it answers in the call's initial metadata (:data:`GRANT_METADATA`, a
``SharedMemoryGrant``: a Unix socket and a one-time key). The client connects to the
socket, sends the key, and receives the ring's descriptor (``SCM_RIGHTS``), opened
read-only; it answers :data:`ACK`, and from then on the server may put the stream's
batches there. Before the server's first batch in the ring, it seals the memfd with
:data:`SEALS`: it can neither shrink (no ``SIGBUS`` under a mapping) nor grow, and no
process can map it writable or write to it any more, whoever opens it (even through
``/proc/<pid>/fd``): only the server's own mapping, made before the seal, writes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading

__all__ = [
    "ACK",
    "CLAIM_TIMEOUT_S",
    "GRANT_METADATA",
    "KEY_BYTES",
    "MAX_BUFFERS",
    "MEMFD_NAME",
    "SEALS",
    "log_once",
    "namespace",
    "socket_address",
    "warn_once",
]

GRANT_METADATA = "batchwire-shared-memory-bin"  # the initial metadata key of a grant
KEY_BYTES = 32  # a grant's key, random
ACK = b"\x01"  # the client's answer once it holds the descriptor
CLAIM_TIMEOUT_S = 5.0  # for each step of a claim, on either side
MEMFD_NAME = "batchwire-ring"  # what /proc/<pid>/fd shows (memfd names are not paths)
MAX_BUFFERS = 16  # batches one stream may hold in shared memory (a server grants no more)

# F_SEAL_FUTURE_WRITE (Linux 5.1) is not in Python 3.11's fcntl.
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


def socket_address(name: str) -> str:
    """The address to bind or connect a grant's ``socket`` at: a name starting with
    ``@`` is in the abstract namespace (Linux), anything else a path."""
    return "\0" + name[1:] if name.startswith("@") else name


def namespace(kind: str) -> str:
    """This process's ``kind`` ("pid", "user") namespace as ``/proc/self/ns`` names it,
    or "" where that cannot be read."""
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(
    log: logging.Logger, kind: str, message: str, *args: object, exc_info: bool = False
) -> None:
    """Log ``message`` as a warning, the first time this process meets ``kind`` of
    failure on ``log``'s side only: a transport that falls back says why once, not once
    a stream. ``exc_info``: with the exception being handled (a fault no code foresaw)."""
    log_once(log, logging.WARNING, kind, message, *args, exc_info=exc_info)


def log_once(
    log: logging.Logger,
    level: int,
    kind: str,
    message: str,
    *args: object,
    exc_info: bool = False,
) -> None:
    """Log ``message`` at ``level``, the first time this process meets ``kind`` on
    ``log``'s side only (see :func:`warn_once`)."""
    with _warned_lock:
        if (log.name, kind) in _warned:
            return
        _warned.add((log.name, kind))
    log.log(level, message, *args, exc_info=exc_info)
