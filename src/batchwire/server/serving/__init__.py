"""The serving edge: the gRPC server around the engine, its security and its metrics, and
the unit of worker processes behind one port (``batchwire serve --workers N``)."""

from __future__ import annotations

from batchwire.server.serving._malloc import tune_for_large_buffers
from batchwire.server.serving._server import BatchwireServer, ServerError
from batchwire.server.serving._streaming import EncodedBatch, encode_parts
from batchwire.server.serving._workers import WorkerUnit, plan_workers

__all__ = [
    "BatchwireServer",
    "EncodedBatch",
    "ServerError",
    "WorkerUnit",
    "encode_parts",
    "plan_workers",
    "tune_for_large_buffers",
]
