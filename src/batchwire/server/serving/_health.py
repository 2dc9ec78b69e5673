"""The health service of a worker of a unit, which answers for the whole unit."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from grpc_health.v1 import health

__all__ = ["UnitHealthServicer"]


class UnitHealthServicer(health.aio.HealthServicer):
    """A unit worker's health service: it brings the unit's state up to date before it
    answers, so that every worker gives a probe the same answer (the siblings' states
    change in other processes; between two polls, workers could answer apart)."""

    def __init__(self, refresh: Callable[[], Awaitable[None]]) -> None:
        super().__init__()
        self._refresh = refresh

    async def Check(self, request: Any, context: Any) -> Any:
        await self._refresh()
        return await super().Check(request, context)

    async def Watch(self, request: Any, context: Any) -> None:
        await self._refresh()
        await super().Watch(request, context)
