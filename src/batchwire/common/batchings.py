"""How a mixture's sources may share batches, by name (without NumPy: the command line
offers them as choices)."""

from __future__ import annotations

__all__ = ["BATCHINGS", "BATCHING_HELP"]

# "random": each batch a random mix of the sources, in the epoch's proportions;
# "stratified": each batch holds each source's share; "per_source": each batch of one.
BATCHINGS = ("random", "stratified", "per_source")

BATCHING_HELP = (
    "how a mixture's datasets share batches: random (each batch a random mix, the default), "
    "stratified (each batch holds each one's share) or per_source (each batch of one dataset)"
)
