"""A served stream's start and end lines (:func:`log_start`, :func:`log_end`), each with
a structured copy of its fields for JSON logs (``--log-format json``).

They are logged under ``batchwire.server.serving._servicer``, not this module's name:
operators find and filter them under that logger, which docs/operations.md (Logs) shows
in a JSON line and ``tests/test_ops.py`` checks.
"""

from __future__ import annotations

import logging
from typing import Any

from batchwire.common.stream import StreamSpec
from batchwire.server.serving._messages import Lane

__all__ = ["log_end", "log_start"]

# The servicer's logger, not this module's: see the module docstring.
log = logging.getLogger("batchwire.server.serving._servicer")


def log_start(
    spec: StreamSpec, peer: str, lane: Lane | None, shared_memory: bool, bulk: bool
) -> dict[str, Any]:
    """Log the stream's start line; returns the fields its start and end lines share."""
    # Structured copies of the start and end lines (JSON logs: --log-format json).
    fields = {
        "peer": peer,
        "dataset": spec.name,
        "pipeline": spec.pipeline,
        "rank": spec.rank,
        "world_size": spec.world_size,
        "lane": 0 if lane is None else lane.lane,
        "lanes": 1 if lane is None else lane.lanes,
        "pull": lane is None,
        "shared_memory": shared_memory,
        "bulk": bulk,
        "epoch": spec.epoch,
        "start": spec.start,
    }
    log.info(
        "stream start peer=%s dataset=%s pipeline=%s rank=%d/%d %s epoch=%d start=%d",
        peer,
        spec.name,
        spec.pipeline,
        spec.rank,
        spec.world_size,
        " ".join(
            ("pull", *(["shared-memory"] if shared_memory else []), *(["bulk"] if bulk else []))
        )
        if lane is None
        else f"lane={lane.lane}/{lane.lanes}",
        spec.epoch,
        spec.start,
        extra={"event": "stream_start", **fields},
    )
    return fields


def log_end(
    fields: dict[str, Any],
    spec: StreamSpec,
    samples: int,
    batches: int,
    duration: float,
    status: str,
) -> None:
    """Log the stream's end line: ``samples`` in ``batches`` sent in ``duration`` seconds,
    and the ``status`` it ended with."""
    log.info(
        "stream end peer=%s dataset=%s pipeline=%s rank=%d samples=%d seconds=%.1f status=%s",
        fields["peer"],
        spec.name,
        spec.pipeline,
        spec.rank,
        samples,
        duration,
        status,
        extra={
            "event": "stream_end",
            **fields,
            "samples": samples,
            "batches": batches,
            "duration_s": round(duration, 3),
            "status": status,
        },
    )
