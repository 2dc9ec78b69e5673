"""The client's one seam to the transport: channels to batchwire servers."""

from __future__ import annotations

import grpc

from batchwire.v1 import batchwire_pb2_grpc

__all__ = ["CHANNEL_OPTIONS", "open_channel", "stub"]

# A batch (e.g. 512 x 3 x 224 x 224 uint8 = 77 MB) is one message, far above
# gRPC's 4 MB default; the server caps batch sizes, so the client need not.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", 4 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
)


def open_channel(address: str) -> grpc.Channel:
    """A channel to ``address`` ("host:port" or a gRPC target such as "dns:///name:port")."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def stub(channel: grpc.Channel) -> batchwire_pb2_grpc.BatchwireStub:
    return batchwire_pb2_grpc.BatchwireStub(channel)
