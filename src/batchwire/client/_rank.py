"""Which rank of which world a loader streams for: the :class:`Rank` its :class:`Sharing`
resolves when a pass starts, which says the share it streams (``batchwire.common.sampler``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchwire.client._frameworks import distributed_rank_world
from batchwire.client._transport import InvalidArgumentError

__all__ = ["Rank", "Sharing"]


@dataclasses.dataclass(frozen=True)
class Rank:
    """Who a process streams for: a rank of a world (resolved when a pass starts)."""

    rank: int
    world_size: int


class Sharing:
    """Which rank of which world a loader streams for, resolved when asked (a pass
    starts): ``explicit`` (given to the loader), else torch.distributed's (``group``'s),
    else what the loader carried when it was pickled, else rank 0 of 1."""

    def __init__(self, explicit: Rank | None, group: Any) -> None:
        self.explicit, self.group = explicit, group
        # The share torch.distributed gave when the loader was pickled: spawned
        # DataLoader workers have no process group of their own.
        self.inherited: Rank | None = None

    def resolve(self) -> Rank:
        live = distributed_rank_world(self.group)
        explicit = self.explicit
        if explicit is not None:
            if live is not None and live != (explicit.rank, explicit.world_size):
                raise InvalidArgumentError(
                    f"rank={explicit.rank}, world_size={explicit.world_size} were given, but "
                    f"torch.distributed is initialized with rank {live[0]} of {live[1]}: this "
                    "process would train on another share than its rank's. Leave rank and "
                    "world_size unset to take them from torch.distributed, or pass "
                    "process_group= to shard over a subgroup"
                )
            return explicit
        if live is not None:
            return Rank(*live)
        return self.inherited or Rank(0, 1)

    def __getstate__(self) -> dict[str, Any]:
        # A copy carries the share torch.distributed gives here; process groups don't
        # pickle, so a subgroup's share becomes the copy's explicit one.
        live = distributed_rank_world(self.group)
        explicit = self.explicit
        if self.group is not None and explicit is None and live is not None:
            explicit = Rank(*live)
        inherited = Rank(*live) if live is not None else self.inherited
        return {"explicit": explicit, "group": None, "inherited": inherited}
