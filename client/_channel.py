"""The client's one seam to the transport: channels to batchwire servers."""

from __future__ import annotations

import grpc

from batchwire.client._security import ChannelSecurity
from batchwire.v1 import batchwire_pb2_grpc

__all__ = ["CHANNEL_OPTIONS", "open_channel", "stub"]

# A batch (e.g. 512 x 3 x 224 x 224 uint8 = 77 MB) is one message, far above
# gRPC's 4 MB default; the server caps batch sizes, so the client need not.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    # Preprocess requests carry encoded images; the server bounds what it
    # accepts (max_request_bytes) and answers RESOURCE_EXHAUSTED beyond it.
    ("grpc.max_send_message_length", -1),
    ("grpc.so_reuseport", 0),
)


def open_channel(
    address: str, security: ChannelSecurity | None = None, *, tls_name: str | None = None
) -> grpc.Channel:
    """A channel to ``address`` ("host:port" or a gRPC target such as "dns:///name:port").

    With TLS, ``tls_name`` is the host name the server certificate must carry
    when ``address`` is an IP address resolved from that name.
    """
    credentials = security.channel_credentials() if security is not None else None
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
    if tls_name:
        options.append(("grpc.ssl_target_name_override", tls_name))
    return grpc.secure_channel(address, credentials, options=options)


def stub(channel: grpc.Channel) -> batchwire_pb2_grpc.BatchwireStub:
    return batchwire_pb2_grpc.BatchwireStub(channel)
