"""The serving edge: the gRPC server around the engine, its security and its metrics."""

from __future__ import annotations

from batchwire.server.serving._malloc import tune_for_large_buffers
from batchwire.server.serving._messages import EncodedBatch, encode_parts
from batchwire.server.serving._server import BatchwireServer, ServerError

__all__ = [
    "BatchwireServer",
    "EncodedBatch",
    "ServerError",
    "encode_parts",
    "tune_for_large_buffers",
]
