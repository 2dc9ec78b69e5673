"""``IngestError``: an ingest cannot proceed, for a reason the user can fix."""

from __future__ import annotations

__all__ = ["IngestError"]


class IngestError(Exception):
    """An ingest cannot proceed; the message says what to change."""
