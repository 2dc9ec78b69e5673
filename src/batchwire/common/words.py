"""Counts in messages, in words: "1 shard", "3 shards"."""

from __future__ import annotations

__all__ = ["counted"]


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, in the plural (``plural``, else ``noun`` + "s") unless
    ``count`` is 1."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {plural or noun + 's'}"
