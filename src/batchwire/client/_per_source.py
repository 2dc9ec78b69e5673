"""Mixtures batched per source or stratified: streamed as one stage a source.

Per source, every batch comes from one source, so that the sources may differ in
pipeline, image size or server; stratified, every batch holds each source's share of it
(:func:`~batchwire.common.mixture.stratum_sizes`), the sources' samples one after the
other.

A loader of such a mixture holds one *part* a source: the :class:`~batchwire.client.
_epochs.Epochs` of that source alone (a mixture of one dataset, ``counts[s]`` samples an
epoch, seeded with :func:`~batchwire.common.mixture.source_seed`), with the source's own
settings, in batches of the whole batch size (per source) or of its share (stratified).
Each part keeps the whole contract for its source: its order, each rank's disjoint share,
ids and cursors, failover, its place and its elastic resume. What this module adds is how
the parts' batches make the loader's: per source, global step ``k`` of an epoch takes its
batch from the source that :func:`~batchwire.common.mixture.batch_schedule` names, the
same on every rank; stratified, it takes one batch of every part, and the epoch ends when
a part runs out (the others' last batches are dropped, as ``drop_last`` drops an epoch's
tail).

A mixture's state is its parts' states, by source name (``batchwire.client._state_dict``).
A pass that resumes one continues where the saved pass stood (the batches each part has
handed out say where); per source, on another world or batch size, whose batches are not
those the schedule counted, the rest of the epoch gets a schedule of its own, a pure
function of the batches each part has left.
"""

from __future__ import annotations

import collections
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from batchwire.client._epochs import Epochs
from batchwire.client._frameworks import refuse_accelerate_wrappers, worker_id
from batchwire.client._mixture import Described, Mixture
from batchwire.client._servers import ServerSet, checked_targets
from batchwire.client._state import Place
from batchwire.client._state_dict import StateDicts
from batchwire.client._transport import BatchwireError, InvalidArgumentError, StatusCode
from batchwire.common.mixture import batch_schedule, offsets_of, source_seed, stratum_sizes
from batchwire.common.stream import Source

if TYPE_CHECKING:
    from batchwire.client._delivery import LoaderOptions, Tensors, TransferStats
    from batchwire.client._pass import StreamPass
    from batchwire.client._rank import Rank, Sharing
    from batchwire.client._transport import Transport
    from batchwire.common.stream import StreamSpec

__all__ = ["PerSource"]


class PerSource:
    """The parts of a per-source or stratified mixture's loader (see the module), one a
    source in the mixture's order; ``spec`` is the loader's stream, ``elastic_batch_size``
    whether a state of another batch size loads."""

    def __init__(
        self,
        mixture: Mixture,
        parts: Sequence[Epochs],
        *,
        spec: StreamSpec,
        elastic_batch_size: bool = False,
    ) -> None:
        self.mixture = mixture
        self.stratified = mixture.batching == "stratified"
        self.names = mixture.names
        self.parts = tuple(parts)
        self.seed, self.shuffle = spec.seed, spec.shuffle
        self._dicts = StateDicts(
            spec, batching=mixture.batching, elastic_batch_size=elastic_batch_size
        )
        # The mixed ids of the records the servers could not decode (see RemoteLoader).
        self.skipped_ids: list[int] = []
        self._described: Described | None = None
        self._infos: list[Any] = []

    @classmethod
    def build(
        cls,
        mixture: Mixture,
        spec: StreamSpec,
        options: LoaderOptions,
        *,
        addresses: tuple[str, ...],
        transport: Transport,
        transfer: TransferStats,
        elastic_batch_size: bool = False,
    ) -> PerSource:
        """The parts of ``mixture`` for a loader of ``spec`` and ``options``: each
        source's stream with its own settings and seed (and, stratified, its share of
        the batch), from its own servers, through the loader's one ``transport``."""
        strata = _strata(mixture, spec)
        parts = []
        for source, name in enumerate(mixture.names):
            settings = mixture.settings_of(name)
            try:
                part = spec.replace(
                    sources=(Source(name, 1),),
                    pipeline=settings.pipeline or spec.pipeline,
                    batch_size=strata[source],
                    seed=source_seed(spec.seed, source),
                    params={**spec.params, **dict(settings.params or ())},
                )
            except (ValueError, RuntimeError) as exc:
                raise InvalidArgumentError(str(exc)) from exc
            # Its count of samples an epoch is set once the sources are described.
            parts.append(
                Epochs(
                    part,
                    options,
                    servers=ServerSet(checked_targets(settings.address or addresses)),
                    transport=transport,
                    transfer=transfer,
                    mixture=Mixture(counts={name: 1}),
                    elastic_batch_size=elastic_batch_size,
                )
            )
        return cls(mixture, parts, spec=spec, elastic_batch_size=elastic_batch_size)

    # -- what the sources are --------------------------------------------------------

    def describe(self, again: bool = False) -> Described:
        """The mixture as each part's servers describe its source; each part is given the
        count of samples an epoch that the sources' sizes plan for it."""
        infos = [part.describe(again=again).info for part in self.parts]
        if self._described is None or infos != self._infos:
            try:
                described = Described.mixture(self.mixture, infos)
            except ValueError as exc:
                raise InvalidArgumentError(f"{self.mixture!r}: {exc}") from None
            for part, source in zip(self.parts, described.sources, strict=True):
                part.use_count(source.count)
            self._described, self._infos = described, infos
        return self._described

    def num_batches(self, rank: Rank) -> int:
        """Batches of a whole epoch on each rank."""
        self.describe()
        return self._of_epoch([part.num_batches(rank) for part in self.parts])

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

    def state_dict(self, rank: Rank) -> dict[str, Any]:
        """The mixture's state: each part's, by its source's name, with the mixture's
        settings (``batchwire.client._state_dict``)."""
        parts = {
            name: part.state_dict(rank) for name, part in zip(self.names, self.parts, strict=True)
        }
        return self._dicts.of_parts(rank, parts)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load each part's state of the mixture's ``state``, by its source's name."""
        states = self._dicts.parts_of(state, self.names)
        if any(part.get("cursor") or part.get("origin") for part in states.values()):
            self.describe()  # each part checks its saved count against what it plans
        for part, name in zip(self.parts, self.names, strict=True):
            part.load_state_dict(states[name])
        self.skipped_ids = []

    # -- a pass --------------------------------------------------------------------------

    def _standing(self, rank: Rank) -> tuple[int, list[int], list[int], bool]:
        """Where the parts stand for the next pass: its epoch, each part's batches of the
        whole epoch and left of it, and whether a part's rest is split anew (a state of
        another world or batch size)."""
        self.describe()
        upcoming = [part.next_plan(rank) for part in self.parts]
        epoch = min(plan.epoch for plan in upcoming)
        whole, left = [], []
        resplit = False
        for part, plan in zip(self.parts, upcoming, strict=True):
            whole.append(part.plan(rank, Place(epoch))[1].num_batches)
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
                    part.set_epoch(epoch + 1)
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

    def iterate(self, sharing: Sharing) -> Iterator[tuple[torch.Tensor, ...]]:
        """The batches of the next pass of the rank ``sharing`` resolves (a generator, as
        Epochs.iterate): every part that has batches left begins its pass at once (its
        streams start, and its ledger says the pass began), and each step takes the next
        batch of each part it names (one, or all when stratified)."""
        refuse_accelerate_wrappers()
        if worker_id() not in (None, 0):
            return  # worker 0 streams the whole share, in order
        rank = sharing.resolve()
        epoch, steps, dropped, complete = self.steps(rank)
        offsets = offsets_of(self.describe().sizes).tolist()
        if complete:
            self.skipped_ids.clear()
        left = collections.Counter(s for step in steps for s in step)
        started: dict[int, tuple[StreamPass, Tensors]] = {}
        delivering: dict[int, Generator[tuple[torch.Tensor, ...]]] = {}
        try:
            for s in left:  # the parts of this pass, in their first step's order
                started[s] = self.parts[s].start(rank)
                delivering[s] = self.parts[s].deliver(started[s][0], rank, started[s][1])
            for step in steps:
                batches = []
                for s in step:
                    batches.append(self._take(s, delivering[s], offsets[s]))
                    left[s] -= 1
                    if not left[s] and dropped[s]:
                        self.parts[s].set_epoch(epoch + 1)  # its tail is dropped
                    elif not left[s]:
                        next(delivering[s], None)  # its pass ends: its next is its next epoch
                handed = [batches[0] if len(batches) == 1 else _joined(batches)]
                batches.clear()  # held here no longer once handed out (as Epochs.deliver)
                yield handed.pop()
        finally:
            for generator in delivering.values():
                generator.close()
            for stream_pass, _ in started.values():
                stream_pass.stop()  # also of a part whose batches were never taken

    def _take(
        self, s: int, delivering: Generator[tuple[torch.Tensor, ...]], offset: int
    ) -> tuple[torch.Tensor, ...]:
        """Part ``s``'s next batch, its ids (and those it skipped) made mixed ids."""
        part = self.parts[s]
        before = len(part.skipped_ids)
        batch = next(delivering, None)
        if batch is None:
            raise BatchwireError(
                f"source {self.names[s]!r} ended its pass before the batches planned for "
                "it: report this as a bug",
                code=StatusCode.INTERNAL,
            )
        self.skipped_ids.extend(offset + i for i in part.skipped_ids[before:])
        return _mixed(batch, offset)

    def close(self) -> None:
        """Stop each part's pass in progress and its pass started ahead."""
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


def _strata(mixture: Mixture, spec: StreamSpec) -> tuple[int, ...]:
    """Each source's samples in a batch: the batch size for each batch of one source,
    or the source's share of it when stratified."""
    names = mixture.names
    if mixture.batching != "stratified":
        return (spec.batch_size,) * len(names)
    if not spec.drop_last:
        raise InvalidArgumentError(
            "stratified batches are all full, each holding each source's share: pass "
            "drop_last=True (the default for stratified batching), or batching='random'"
        )
    try:
        return stratum_sizes(spec.batch_size, mixture.shares)
    except ValueError as exc:
        raise InvalidArgumentError(f"{mixture!r}: {exc}") from None
