"""The serving edge: the gRPC server around the engine, its security and its metrics.

What the worker unit (:mod:`batchwire.server.workers`) runs and shares is exported here
too: the server, its port check and metrics endpoint, the health states the workers of a
unit share, and the budget of shared memory they hold together.
"""

from __future__ import annotations

from batchwire.server.serving._listening import Listening, check_port_free
from batchwire.server.serving._malloc import tune_for_large_buffers
from batchwire.server.serving._metrics import MetricsError, MetricsHTTPServer
from batchwire.server.serving._ring_budget import RingBudget
from batchwire.server.serving._server import BatchwireServer
from batchwire.server.serving._streaming import EncodedBatch, encode_parts
from batchwire.server.serving._worker_states import State, UnitMember, WorkerStates

__all__ = [
    "BatchwireServer",
    "EncodedBatch",
    "Listening",
    "MetricsError",
    "MetricsHTTPServer",
    "RingBudget",
    "State",
    "UnitMember",
    "WorkerStates",
    "check_port_free",
    "encode_parts",
    "tune_for_large_buffers",
]
