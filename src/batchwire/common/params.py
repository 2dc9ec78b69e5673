"""What a server accepts of a stream request beyond its fields: the ranges of a pipeline's
parameters and the largest batch.

The server checks a request with these when it opens a stream. A client checks its request
with them too, from what DescribeDataset announces, so that a bad ``params`` or
``batch_size`` fails when the loader first asks the server about its dataset (``len()``,
``classes``, the first ``iter()``), with the words the server would use. The server stays
the authority: a request that passes here is checked there again, also against checks
that only the pipeline knows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["ParamRange", "check_batch_size", "check_params"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamRange:
    """The closed range a pipeline parameter may take; ``integer``: whole numbers only."""

    low: float
    high: float
    integer: bool = False

    def check(self, name: str, value: float) -> float:
        """``value``, checked (ValueError naming the parameter and its range)."""
        if not math.isfinite(value) or not self.low <= value <= self.high:
            low, high, got = _number(self.low), _number(self.high), _number(value)
            raise ValueError(f"parameter {name!r} must be in [{low}, {high}], got {got}")
        if self.integer:
            if value != int(value):
                raise ValueError(f"parameter {name!r} must be a whole number, got {value}")
            return float(int(value))
        return float(value)

    def to_proto(self) -> pb.ParamRange:
        return pb.ParamRange(low=self.low, high=self.high, integer=self.integer)

    @classmethod
    def from_proto(cls, message: pb.ParamRange) -> ParamRange:
        return cls(low=message.low, high=message.high, integer=message.integer)


def _number(value: float) -> str:
    """``value`` as a person writes it: 8 rather than 8.0, as both sides print it."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def check_params(
    pipeline: str, overrides: Mapping[str, float], ranges: Mapping[str, ParamRange]
) -> dict[str, float]:
    """``overrides`` checked against ``pipeline``'s parameter ranges: a name it lacks or a
    value out of range is a ValueError."""
    values = {}
    for name, value in overrides.items():
        allowed = ranges.get(name)
        if allowed is None:
            known = ", ".join(sorted(ranges)) or "none"
            raise ValueError(f"pipeline {pipeline!r} has no parameter {name!r} (it has: {known})")
        values[name] = allowed.check(name, float(value))
    return values


def check_batch_size(batch_size: int, limit: int) -> None:
    """A batch of ``batch_size`` fits the server's ``limit`` (0: no limit known)."""
    if limit and batch_size > limit:
        raise ValueError(
            f"batch_size {batch_size} exceeds this server's limit of {limit} "
            "(server flag --max-batch-size)"
        )
