"""Mixtures batched per source or stratified: streamed as one loader a source.

Per source, every batch comes from one source, so that the sources may differ in
pipeline, image size or server; stratified, every batch holds each source's share of it
(:func:`~batchwire.common.mixture.stratum_sizes`), the sources' samples one after the
other.

A loader of such a mixture holds one *part* a source: a loader of that source alone (a
mixture of one dataset, ``counts[s]`` samples an epoch, seeded with
:func:`~batchwire.common.mixture.source_seed`), made with the source's own settings, in
batches of the whole batch size (per source) or of its share (stratified). Each part keeps
the whole contract for its source: its order, each rank's disjoint share, ids and cursors,
failover, its state and its elastic resume. What this module adds is how the parts'
batches make the loader's: per source, global step ``k`` of an epoch takes its batch from
the source that :func:`~batchwire.common.mixture.batch_schedule` names, the same on every
rank; stratified, it takes one batch of every part, and the epoch ends when a part runs out
(the others' last batches are dropped, as ``drop_last`` drops an epoch's tail).

A mixture's state is its parts' states. A pass that resumes one continues where the saved
pass stood (the batches each part has handed out say where); per source, on another world
or batch size, whose batches are not those the schedule counted, the rest of the epoch
gets a schedule of its own, a pure function of the batches each part has left.
"""

from __future__ import annotations

import collections
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from batchwire.client._mixture import Described, Mixture
from batchwire.client._rank import Rank
from batchwire.client._state import Place
from batchwire.client._transport import BatchwireError, InvalidArgumentError, StatusCode
from batchwire.common.mixture import batch_schedule, offsets_of

if TYPE_CHECKING:
    from batchwire.client._delivery import Tensors
    from batchwire.client._pass import StreamPass
    from batchwire.common.sampler import Plan
    from batchwire.common.stream import StreamSpec

__all__ = ["Part", "PerSource"]


class Part(Protocol):
    """What a part is asked: a :class:`~batchwire.client.RemoteLoader` of one source."""

    skipped_ids: list[int]

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...

    def _describe(self, again: bool = False) -> Described: ...

    def _use_count(self, count: int) -> None: ...

    def _plan(self, rank: Rank, place: Place) -> tuple[StreamSpec, Plan]: ...

    def _next_plan(self, rank: Rank) -> Plan: ...

    def _skip_to(self, epoch: int) -> None: ...

    def _start(self, rank: Rank) -> tuple[StreamPass, Tensors]: ...

    def _deliver(
        self, stream_pass: StreamPass, rank: Rank, tensors: Tensors
    ) -> Generator[tuple[torch.Tensor, ...]]: ...


class PerSource:
    """The parts of a per-source mixture's loader (see the module), one a source in the
    mixture's order."""

    def __init__(
        self, mixture: Mixture, parts: Sequence[Part], *, seed: int, shuffle: bool
    ) -> None:
        self.mixture = mixture
        self.stratified = mixture.batching == "stratified"
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

    def num_batches(self, rank: Rank) -> int:
        """Batches of a whole epoch on each rank."""
        self.describe()
        return self._of_epoch([part._plan(rank, Place(0))[1].num_batches for part in self.parts])

    def _of_epoch(self, batches: Sequence[int]) -> int:
        """Batches of a whole epoch whose parts have ``batches`` each: added up
        (stratified: the fewest of a part)."""
        return min(batches) if self.stratified else sum(batches)

    # -- where the parts stand -------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress or next: the earliest a part stands in (a
        part done with an epoch stands in the next)."""
        return min(part.epoch for part in self.parts)

    def set_epoch(self, epoch: int) -> None:
        for part in self.parts:
            part.set_epoch(epoch)

    def state_dicts(self) -> dict[str, dict[str, Any]]:
        """Each part's state, by its source's name."""
        return {name: part.state_dict() for name, part in zip(self.names, self.parts, strict=True)}

    def load_state_dicts(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Load each part's state of ``states``, by its source's name (one for each)."""
        if any(state.get("cursor") or state.get("origin") for state in states.values()):
            self.describe()  # each part checks its saved count against what it plans
        for part, name in zip(self.parts, self.names, strict=True):
            part.load_state_dict(states[name])

    # -- a pass --------------------------------------------------------------------------

    def _standing(self, rank: Rank) -> tuple[int, list[int], list[int], bool]:
        """Where the parts stand for the next pass: its epoch, each part's batches of the
        whole epoch and left of it, and whether a part's rest is split anew (a state of
        another world or batch size)."""
        self.describe()
        upcoming = [part._next_plan(rank) for part in self.parts]
        epoch = min(plan.epoch for plan in upcoming)
        whole, left = [], []
        resplit = False
        for part, plan in zip(self.parts, upcoming, strict=True):
            whole.append(part._plan(rank, Place(epoch))[1].num_batches)
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
        return epoch, whole, left, resplit

    def steps(self, rank: Rank) -> tuple[int, list[tuple[int, ...]], list[int], bool]:
        """The next pass: its epoch, the parts (by index) each step takes a batch from,
        each part's batches left after it (a stratified epoch ends with the part that runs
        out first: the others' last batches are dropped, as drop_last drops a tail), and
        whether it is a whole epoch."""
        epoch, whole, left, resplit = self._standing(rank)
        complete = self._of_epoch(left) == self._of_epoch(whole)
        if self.stratified:
            steps = min(left)
            if not steps:  # the epoch is over: the parts' next passes start the next
                for part in self.parts:
                    part._skip_to(epoch + 1)
                epoch, whole, left, resplit = self._standing(rank)
                steps, complete = min(left), True
            everyone = tuple(range(len(self.parts)))
            return epoch, [everyone] * steps, [n - steps for n in left], complete
        none_dropped = [0] * len(whole)
        if not resplit:
            schedule = batch_schedule(self.seed, epoch, whole, self.shuffle)
            taken = [w - n for w, n in zip(whole, left, strict=True)]
            at = sum(taken)
            if np.bincount(schedule[:at], minlength=len(whole)).tolist() == taken:
                return epoch, [(s,) for s in schedule[at:].tolist()], none_dropped, complete
        schedule = batch_schedule(self.seed, epoch, left, self.shuffle)
        return epoch, [(s,) for s in schedule.tolist()], none_dropped, complete

    def iterate(self, rank: Rank, skipped: list[int]) -> Iterator[tuple[torch.Tensor, ...]]:
        """The batches of the next pass: every part that has batches left begins its
        pass at once (its streams start, and its ledger says the pass began), and each
        step takes the next batch of each part it names (one, or all when stratified)."""
        epoch, steps, dropped, complete = self.steps(rank)
        offsets = offsets_of(self.describe().sizes).tolist()
        if complete:
            skipped.clear()
        left = collections.Counter(s for step in steps for s in step)
        started: dict[int, tuple[StreamPass, Tensors]] = {}
        delivering: dict[int, Generator[tuple[torch.Tensor, ...]]] = {}
        try:
            for s in left:  # the parts of this pass, in their first step's order
                started[s] = self.parts[s]._start(rank)
                delivering[s] = self.parts[s]._deliver(started[s][0], rank, started[s][1])
            for step in steps:
                batches = []
                for s in step:
                    part = self.parts[s]
                    before = len(part.skipped_ids)
                    batch = next(delivering[s], None)
                    if batch is None:
                        raise BatchwireError(
                            f"source {self.names[s]!r} ended its pass before the "
                            "batches planned for it: report this as a bug",
                            code=StatusCode.INTERNAL,
                        )
                    left[s] -= 1
                    if not left[s] and dropped[s]:
                        part._skip_to(epoch + 1)  # its tail is dropped
                    elif not left[s]:
                        next(delivering[s], None)  # its pass ends: its next is its next epoch
                    skipped.extend(offsets[s] + i for i in part.skipped_ids[before:])
                    batches.append(_mixed(batch, offsets[s]))
                yield batches[0] if len(batches) == 1 else _joined(batches)
        finally:
            for generator in delivering.values():
                generator.close()
            for stream_pass, _ in started.values():
                stream_pass.stop()  # also of a part whose batches were never taken

    def close(self) -> None:
        for part in self.parts:
            part.close()


def _joined(batches: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    """One batch of the parts' batches of a step, one after the other; a pipeline's views
    view by view, its named outputs name by name (a ragged one's samples one list)."""
    return tuple(_join(values) for values in zip(*batches, strict=True))


def _join(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, list):  # the views form: one batch tensor a view
        return [_cat(views) for views in zip(*values, strict=True)]
    if isinstance(first, dict):  # the named form
        return {
            name: _cat([v[name] for v in values])
            if isinstance(output, torch.Tensor)
            else [sample for v in values for sample in v[name]]
            for name, output in first.items()
        }
    return _cat(values)


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors one after the other: on the CPU into NumPy's memory, as a part's own
    batch is (``batchwire.client._delivery``), where a fresh tensor of torch's costs page
    faults worth several times the copy."""
    if tensors[0].device.type != "cpu":
        return torch.cat(list(tensors))
    # NumPy's copy: torch's runs on its intra-op threads, whose spinning after each copy
    # cost more CPU than the copy.
    return torch.from_numpy(np.concatenate([t.numpy() for t in tensors]))


def _mixed(batch: tuple[torch.Tensor, ...], offset: int) -> tuple[torch.Tensor, ...]:
    """A part's batch with its ids (if it carries them) made mixed ids."""
    if len(batch) == 3 and offset:
        return (batch[0], batch[1], batch[2] + offset)
    return batch
