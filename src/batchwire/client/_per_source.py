"""Per-source batching: a mixture whose every batch comes from one source, so that its
sources may differ in pipeline, image size or server.

A loader of such a mixture holds one *part* a source: a loader of that source alone (a
mixture of one dataset, ``counts[s]`` samples an epoch, seeded with
:func:`~batchwire.common.mixture.source_seed`), made with the source's own settings.
Each part keeps the whole contract for its source: its order, each rank's disjoint share,
ids and cursors, failover, its state and its elastic resume. What this module adds is the
order of the parts' batches: global step ``k`` of an epoch takes its batch from the source
that :func:`~batchwire.common.mixture.batch_schedule` names, the same on every rank.

A mixture's state is its parts' states. A pass that resumes one continues the schedule
where the saved pass stood (the batches each part has handed out say where); on another
world or batch size, whose batches are not those the schedule counted, the rest of the
epoch gets a schedule of its own, a pure function of the batches each part has left.
"""

from __future__ import annotations

import collections
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import torch

from batchwire.client._exceptions import BatchwireError, InvalidArgumentError
from batchwire.client._mixture import Described, Mixture
from batchwire.client._state import Place, Rank
from batchwire.common.mixture import batch_schedule, offsets_of

if TYPE_CHECKING:
    from batchwire.client._delivery import Tensors
    from batchwire.client._loader import RemoteLoader
    from batchwire.client._pass import StreamPass

__all__ = ["PerSource"]

# What a mixture's state holds of its parts, by source name.
PARTS = "parts"


class PerSource:
    """The parts of a per-source mixture's loader (see the module), one a source in the
    mixture's order."""

    def __init__(
        self, mixture: Mixture, parts: Sequence[RemoteLoader], *, seed: int, shuffle: bool
    ) -> None:
        self.mixture = mixture
        self.names = mixture.names
        self.parts = tuple(parts)
        self.seed, self.shuffle = seed, shuffle
        self._described: Described | None = None
        self._infos: list[Any] = []

    # -- what the sources are --------------------------------------------------------

    def describe(self, again: bool = False) -> Described:
        """The mixture as each part's servers describe its source; each part is given the
        count of samples an epoch that the sources' sizes plan for it."""
        infos = [part._describe(again=again).info for part in self.parts]
        if self._described is None or infos != self._infos:
            try:
                described = Described.mixture(self.mixture, infos)
            except ValueError as exc:
                raise InvalidArgumentError(f"{self.mixture!r}: {exc}") from None
            for part, source in zip(self.parts, described.sources, strict=True):
                part._use_count(source.count)
            self._described, self._infos = described, infos
        return self._described

    def num_batches(self, share: Rank) -> int:
        """Batches of a whole epoch on each rank: the parts' added up."""
        self.describe()
        return sum(part._plan(share, Place(0))[1].num_batches for part in self.parts)

    # -- where the parts stand -------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress or next: the earliest a part stands in (a
        part done with an epoch stands in the next)."""
        return min(part.epoch for part in self.parts)

    def set_epoch(self, epoch: int) -> None:
        for part in self.parts:
            part.set_epoch(epoch)

    def state_dict(self, share: Rank, identity: Mapping[str, Any]) -> dict[str, Any]:
        states = {
            name: part.state_dict() for name, part in zip(self.names, self.parts, strict=True)
        }
        return {
            **identity,
            "epoch": min(state["epoch"] for state in states.values()),
            "batch_size": self.parts[0].batch_size,
            "world_size": share.world_size,
            "rank": share.rank,
            PARTS: states,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        parts = state.get(PARTS)
        names = list(self.names)
        if not isinstance(parts, Mapping) or sorted(parts) != sorted(names):
            raise InvalidArgumentError(
                f"this state of a per-source mixture holds the states of "
                f"{sorted(parts) if isinstance(parts, Mapping) else parts!r}, not of its "
                f"sources {names}: it was not saved by a loader of this mixture"
            )
        if any(p.get("cursor") or p.get("origin") for p in parts.values()):
            self.describe()  # each part checks its saved count against what it plans
        for part, name in zip(self.parts, names, strict=True):
            part.load_state_dict(parts[name])

    # -- a pass --------------------------------------------------------------------------

    def schedule(self, share: Rank) -> np.ndarray:
        """The parts (by index) the rest of the next pass takes each step's batch from."""
        self.describe()
        upcoming = [part._upcoming(part._position.ledger.read(), share)[2] for part in self.parts]
        epoch = min(plan.epoch for plan in upcoming)
        whole, left = [], []
        resplit = False
        for part, plan in zip(self.parts, upcoming, strict=True):
            whole.append(part._plan(share, Place(epoch))[1].num_batches)
            if plan.epoch == epoch:
                left.append(plan.num_batches - plan.start // plan.batch_size)
                resplit = resplit or plan.origin > 0
            elif plan.epoch == epoch + 1 and plan.origin == plan.start == 0:
                left.append(0)  # done with this epoch
            else:
                raise InvalidArgumentError(
                    f"the mixture's sources stand in epochs {[p.epoch for p in upcoming]}: "
                    "a state of each source's own loader was loaded, not the mixture's. "
                    "Load the mixture's state_dict(), or call set_epoch"
                )
        if not resplit:
            schedule = batch_schedule(self.seed, epoch, whole, self.shuffle)
            taken = [w - n for w, n in zip(whole, left, strict=True)]
            at = sum(taken)
            if np.bincount(schedule[:at], minlength=len(whole)).tolist() == taken:
                return schedule[at:]
        return batch_schedule(self.seed, epoch, left, self.shuffle)

    def iterate(self, share: Rank, skipped: list[int]) -> Iterator[tuple[torch.Tensor, ...]]:
        """The batches of the next pass: every part that has batches left begins its
        pass at once (its streams start, and its ledger says the pass began), and each
        step takes the next batch of the part the schedule names."""
        steps = self.schedule(share).tolist()
        offsets = offsets_of(self.describe().sizes).tolist()
        if len(steps) == self.num_batches(share):
            skipped.clear()  # a whole epoch
        left = collections.Counter(steps)
        started: dict[int, tuple[StreamPass, Tensors]] = {}
        delivering: dict[int, Generator[tuple[torch.Tensor, ...]]] = {}
        try:
            for s in dict.fromkeys(steps):  # the parts of this pass, in their first step's order
                started[s] = self.parts[s]._start(share)
                delivering[s] = self.parts[s]._deliver(started[s][0], share, started[s][1])
            for s in steps:
                part = self.parts[s]
                before = len(part.skipped_ids)
                batch = next(delivering[s], None)
                if batch is None:
                    raise BatchwireError(
                        f"source {self.names[s]!r} ended its pass before the "
                        "batches planned for it: report this as a bug",
                        code=grpc.StatusCode.INTERNAL,
                    )
                left[s] -= 1
                if not left[s]:
                    next(delivering[s], None)  # its pass ends: its next is its next epoch
                skipped.extend(offsets[s] + i for i in part.skipped_ids[before:])
                yield _mixed(batch, offsets[s])
        finally:
            for generator in delivering.values():
                generator.close()
            for stream_pass, _ in started.values():
                stream_pass.stop()  # also of a part whose batches were never taken

    def close(self) -> None:
        for part in self.parts:
            part.close()


def _mixed(batch: tuple[torch.Tensor, ...], offset: int) -> tuple[torch.Tensor, ...]:
    """A part's batch with its ids (if it carries them) made mixed ids."""
    if len(batch) == 3 and offset:
        return (batch[0], batch[1], batch[2] + offset)
    return batch
