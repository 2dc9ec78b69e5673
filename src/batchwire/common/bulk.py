"""How a server sends one stream's images on a TCP connection of their own, beside the
gRPC call: the rules both sides keep (``batchwire.server.serving._bulk`` grants and
writes, ``batchwire.client._transport._bulk`` claims and reads).

gRPC's Python server sends a message with the interpreter lock held and copies it once
more into its own buffers; for a stream of images that is most of what the server spends
beyond DALI's own run, and the most a trainer on another host can receive. The bulk
connection carries the images as they are: the server writes a batch's buffer with
``sendall`` (the lock released, no copy in user space) and the client reads it straight
into the tensor it hands to the user (``recv_into``). Everything else (the ids, labels,
cursor, the order, flow control, errors) stays in the call.

A client offers to read images that way (``PullRequest.bulk``); a server that grants it
answers in the call's initial metadata (:data:`GRANT_METADATA`, a ``BulkGrant``: a port
on the host the client called, and a one-time key of :data:`KEY_BYTES`). The client
connects, sends the key and reads :data:`ACK`; from then on a batch whose message has
``bulk_images`` has its ``length`` bytes of images next on the connection, in the order
of the messages. Each step of a claim takes at most :data:`CLAIM_TIMEOUT_S`. A client
that cannot claim (a firewall, a refusal) reads every batch from its message. A server with
TLS speaks TLS on the connection too, from its first byte (``batchwire.common.tls``): the
client's handshake, checked as the call's, comes before the key.
"""

from __future__ import annotations

import socket

__all__ = [
    "ACK",
    "CLAIM_TIMEOUT_S",
    "CONNECT_TIMEOUT_S",
    "GRANT_METADATA",
    "KEY_BYTES",
    "receive_into",
]

GRANT_METADATA = "batchwire-bulk-bin"  # the initial metadata key of a grant
KEY_BYTES = 32  # a grant's key, random
ACK = b"\x01"  # the server's answer to a good key
CLAIM_TIMEOUT_S = 5.0  # for the key and the answer, on either side
# For the connection itself: a port a firewall drops costs each call this long once.
CONNECT_TIMEOUT_S = 3.0


def receive_into(connection: socket.socket, buffer: memoryview) -> None:
    """Fill ``buffer`` from ``connection`` (blocking, within its timeout; ``recv_into``: no
    copy but the kernel's). EOFError where the peer closes first."""
    got = 0
    while got < len(buffer):
        more = connection.recv_into(buffer[got:])
        if not more:
            raise EOFError("the peer closed the connection")
        got += more
