"""What makes two pipelines interchangeable: the :class:`RunnerKey`."""

from __future__ import annotations

import dataclasses

__all__ = ["RunnerKey"]


@dataclasses.dataclass(frozen=True)
class RunnerKey:
    """What makes two pipelines interchangeable."""

    pipeline: str
    params: tuple[tuple[str, float], ...]
    dtype: str
    layout: str
    batch_size: int
    device: str
    device_id: int | None
