"""The client's one seam to the transport: channels to batchwire servers."""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import grpc

from batchwire.client._exceptions import InvalidArgumentError
from batchwire.client._security import ChannelSecurity
from batchwire.v1 import batchwire_pb2_grpc

__all__ = ["CHANNEL_OPTIONS", "ChannelCache", "check_target", "open_channel", "stub"]

# A batch (e.g. 512 x 3 x 224 x 224 uint8 = 77 MB) is one message, far above
# gRPC's 4 MB default; the server caps batch sizes, so the client need not.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    # Preprocess requests carry encoded images; the server bounds what it
    # accepts (max_request_bytes) and answers RESOURCE_EXHAUSTED beyond it.
    ("grpc.max_send_message_length", -1),
    ("grpc.so_reuseport", 0),
)


# host:port or [v6]:port; anything with a scheme (dns:///, unix:, ipv4:) is gRPC's to parse.
_HOST_PORT = re.compile(r"(\[[^\]]+\]|[^:\[\]/]+):\d{1,5}")
# Web URLs, which gRPC would take for a DNS name ("Misformatted domain name").
_URL_SCHEME = re.compile(r"(https?|grpcs?)://", re.IGNORECASE)


def check_target(target: str) -> str:
    """``target`` if it names a port; InvalidArgumentError if it is a bare host, which gRPC
    would dial on port 443, or a web URL (``http://host:port``), which gRPC cannot resolve."""
    scheme = _URL_SCHEME.match(target)
    if scheme:
        bare = target[scheme.end() :].rstrip("/")
        raise InvalidArgumentError(
            f"address {target!r} is a URL: write HOST:PORT without {scheme.group()!r}, "
            f"e.g. {bare or 'gpu-host:50051'}"
        )
    if ":/" in target or target.startswith(("unix:", "ipv4:", "ipv6:", "unix-abstract:")):
        return target
    if not _HOST_PORT.fullmatch(target):
        raise InvalidArgumentError(
            f"address {target!r} has no port: write HOST:PORT, e.g. gpu-host:50051 "
            "(batchwire serve's default port), or dns:///NAME:PORT"
        )
    return target


def open_channel(
    address: str, security: ChannelSecurity | None = None, *, tls_name: str | None = None
) -> grpc.Channel:
    """A channel to ``address`` ("host:port" or a gRPC target such as "dns:///name:port").

    With TLS, ``tls_name`` is the host name the server certificate must carry
    when ``address`` is an IP address resolved from that name.
    """
    check_target(address)
    credentials = security.channel_credentials() if security is not None else None
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
    if tls_name:
        options.append(("grpc.ssl_target_name_override", tls_name))
    return grpc.secure_channel(address, credentials, options=options)


def stub(channel: grpc.Channel) -> batchwire_pb2_grpc.BatchwireStub:
    """The client's one way to a ``Batchwire`` stub on ``channel``."""
    # protoc's gRPC gencode (batchwire_pb2_grpc) carries no annotations, and no stubs.
    return batchwire_pb2_grpc.BatchwireStub(channel)  # type: ignore[no-untyped-call]


class ChannelCache:
    """Channels opened on first use, one per address, and again after a fork: a forked
    process (a DataLoader worker) never uses its parent's channels."""

    def __init__(
        self,
        security: ChannelSecurity | None = None,
        on_open: Callable[[grpc.Channel], None] | None = None,
    ) -> None:
        self._security = security
        self._on_open = on_open
        self._channels: dict[tuple[str, str | None], grpc.Channel] = {}
        self._pid = os.getpid()

    def get(self, address: str, tls_name: str | None = None) -> grpc.Channel:
        if self._pid != os.getpid():
            self._channels, self._pid = {}, os.getpid()
        channel = self._channels.get((address, tls_name))
        if channel is None:
            channel = open_channel(address, self._security, tls_name=tls_name)
            if self._on_open is not None:
                self._on_open(channel)
            self._channels[address, tls_name] = channel
        return channel

    def __getstate__(self) -> dict[str, object]:
        # A copy (a spawned worker) opens channels of its own.
        return {"_security": self._security, "_on_open": self._on_open}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._channels, self._pid = {}, os.getpid()

    def close(self) -> None:
        """Close this process's channels (a parent's are left to the parent)."""
        if self._pid == os.getpid():
            for channel in self._channels.values():
                channel.close()
        self._channels = {}
