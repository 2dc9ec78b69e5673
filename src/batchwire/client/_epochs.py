"""The passes of one stream, epoch after epoch: the stage that streams a loader of one
dataset (or of a mixture batched at random), and each part of a mixture batched per
source or stratified.

:class:`Epochs` owns what its stream is and where it stands: the dataset as a server
describes it (cached), its :class:`~batchwire.client._state.Places` (the place its next
pass starts at, in a ledger shared with DataLoader workers), the pass it began last
(``StreamPass``, whose cursor is where that pass stands, and whose book says which batch
is asked of whom) and the pass it started ahead of the next ``iter()``. Its
``state_dict`` is its place, as ``batchwire.client._state_dict`` lays it out, and
``load_state_dict`` makes a saved one the place its next pass starts at.

Each pass begins by claiming its place in the ledger, and delivers the batches of its
plan in order; the loop that takes them runs here (:meth:`Epochs.deliver`), so that a
batch's path through the client is this module, the pass, its book and the tensors.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Generator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from batchwire.client._delivery import LoaderOptions, Tensors, TransferStats
from batchwire.client._descriptions import describe_dataset, find_workers
from batchwire.client._frameworks import refuse_accelerate_wrappers, worker_id
from batchwire.client._mixture import Described, Mixture
from batchwire.client._pass import StreamPass
from batchwire.client._state import Place, Places
from batchwire.client._state_dict import StateDicts
from batchwire.client._transport import BatchwireError, InvalidArgumentError, StatusCode
from batchwire.common.words import counted

if TYPE_CHECKING:
    from batchwire.client._rank import Rank, Sharing
    from batchwire.client._servers import ServerSet
    from batchwire.client._transport import Transport
    from batchwire.common.sampler import Plan
    from batchwire.common.stream import StreamSpec

__all__ = ["Epochs"]

log = logging.getLogger(__name__)

# Seconds a unit and its workers get to say who they are, once a process: a worker's port
# that a firewall drops must not hold a pass for the loader's whole timeout.
_FIND_WORKERS_TIMEOUT_S = 10.0
# Servers whose credit the window makes room for twice; more share that room.
_WINDOW_SERVERS = 4


class Epochs:
    """The passes of the stream ``spec`` (rank, world, epoch and cursor filled in each
    pass) from ``servers`` through ``transport``, delivered as ``options`` say; a
    ``mixture`` of one source (a mixture's part) or of several batched at random is
    described source by source. ``skipped_ids`` gathers the ids of records the servers
    could not decode since the pass that began an epoch."""

    def __init__(
        self,
        spec: StreamSpec,
        options: LoaderOptions,
        *,
        servers: ServerSet,
        transport: Transport,
        transfer: TransferStats,
        mixture: Mixture | None = None,
        elastic_batch_size: bool = False,
    ) -> None:
        self.spec, self.options = spec, options
        self.servers, self.transfer = servers, transfer
        self._transport = transport
        self._mixture = mixture
        self._dicts = StateDicts(spec, elastic_batch_size=elastic_batch_size)
        self._places = Places(spec)
        self.skipped_ids: list[int] = []
        self._info: Described | None = None
        # The last pass begun, running or not: where it stood is the stream's place until
        # the next one begins (Places.place).
        self.current: StreamPass | None = None
        self._ahead: StreamPass | None = None  # the pass after this one, started early
        self._ahead_finalizer: weakref.finalize[Any, Any] | None = None
        self._passes_ended = 0  # passes of this stream (in this process) run to their end
        self._said_left_out = False  # what drop_last leaves out or padding repeats was logged

    # -- what the stream is ----------------------------------------------------------

    def describe(self, again: bool = False) -> Described:
        """The dataset, or each of a mixture's, as the first server that answers
        describes it (cached)."""
        if self._info is None or again:
            if self._mixture is None:
                info = describe_dataset(
                    self._transport, self.servers, self.spec, timeout=self.options.timeout
                )
                self._info = Described(info)
            else:
                infos = [
                    describe_dataset(
                        self._transport,
                        self.servers,
                        self.spec.replace(dataset=name, sources=()),
                        timeout=self.options.timeout,
                    )
                    for name in self._mixture.names
                ]
                try:
                    self._info = Described.mixture(self._mixture, infos)
                except ValueError as exc:
                    raise InvalidArgumentError(f"{self._mixture!r}: {exc}") from None
        return self._info

    def use_count(self, count: int) -> None:
        """This stream, a mixture's part, gives ``count`` samples an epoch (see
        PerSource.describe)."""
        assert self._mixture is not None
        name = self._mixture.names[0]
        if dict(self._mixture.counts or {}) != {name: count}:
            self._mixture = Mixture(counts={name: count})
            if self._info is not None:
                self._info = Described.mixture(self._mixture, [self._info.info])

    def plan(self, rank: Rank, place: Place) -> tuple[StreamSpec, Plan]:
        """The stream of ``rank`` from ``place`` (in this stream's units), and its plan."""
        return self._places.plan(rank, place, self.describe())

    def next_plan(self, rank: Rank) -> Plan:
        """The plan of the next pass of ``rank``, as the ledger places it now."""
        return self._places.upcoming(self._places.ledger.read(), rank, self.describe())[2]

    def num_batches(self, rank: Rank) -> int:
        """Batches of a whole epoch for ``rank``."""
        return self.plan(rank, Place(0))[1].num_batches

    # -- where it stands -------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the last pass, until it handed out its last batch; else the next
        pass's."""
        return self._places.place(self.current).epoch

    def set_epoch(self, epoch: int) -> None:
        """The next pass starts ``epoch`` (at the loaded place if a loaded state is about
        to resume ``epoch``); what is left of this one is dropped."""
        self._places.set_epoch(epoch)

    def state_dict(self, rank: Rank) -> dict[str, Any]:
        """The place of ``rank``'s stream as a dict (``batchwire.client._state_dict``)."""
        self._places.refuse_if_in_workers()
        return self._dicts.of_place(self._places.place(self.current), rank, self._info)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next pass starts at the place ``state`` saves, once checked (see
        RemoteLoader.load_state_dict); a DataLoader worker that streams nothing only
        checks it."""
        place = self._dicts.place_of(state)
        if worker_id() not in (None, 0):
            return  # workers other than 0 stream nothing (see RemoteLoader)
        if place.cursor > 0 or place.origin > 0:  # at an epoch's start nothing is left over
            # The dataset's version as the server serves it now, not as it served it before.
            self._dicts.check_served(state, lambda: self.describe(again=True))
        self._places.load(place)
        self.skipped_ids = []

    # -- passes ----------------------------------------------------------------------

    def iterate(self, sharing: Sharing) -> Iterator[Any]:
        """The batches of the next pass of the rank ``sharing`` resolves, as the loop
        takes them. A generator: nothing runs until it is first advanced, so frameworks
        that call iter() and drop the result start no pass."""
        refuse_accelerate_wrappers()
        if worker_id() not in (None, 0):
            return  # worker 0 streams the whole share, in order
        rank = sharing.resolve()
        stream_pass, tensors = self.start(rank)
        yield from self.deliver(stream_pass, rank, tensors)

    def start(self, rank: Rank) -> tuple[StreamPass, Tensors]:
        """Begin the next pass of ``rank``: its streams start at once."""
        pipeline = self.spec.pipeline
        info = next(p for p in self.describe().info.pipelines if p.name == pipeline)
        tensors = Tensors(self.options, info, self.spec.layout, self.transfer)
        # Once a process: a unit's workers in place of the unit, to pull from each.
        find_workers(
            self._transport,
            self.servers,
            self.spec.datasets[0],
            timeout=min(self.options.timeout, _FIND_WORKERS_TIMEOUT_S),
        )
        return self._begin(rank, tensors), tensors

    def _begin(self, rank: Rank, tensors: Tensors) -> StreamPass:
        """Stop the previous pass, claim the next one in the ledger, start its readers."""
        previous, self.current = self.current, None
        if previous is not None:
            previous.supersede()
        # A place that StatefulDataLoader loaded in this worker is for the pass made right
        # after it here, which uses it up only by running to its end: torchdata primes
        # the prefetch of a restored iterator before it finds the state was of a finished
        # pass and starts another, and that discarded pass must not count (Places.begin).
        with self._places.ledger.update() as entry:
            place, spec, plan = self._places.upcoming(entry, rank, self.describe())
            ahead = self._take_ahead()
            if ahead is not None and ahead.spec == spec.to_proto():
                stream_pass = ahead  # started as the last pass ended: its batches are coming
                stream_pass.book.widen(self._window())
            else:
                if ahead is not None:
                    ahead.stop()
                stream_pass = self._new_pass(spec, plan, tensors, self._window())
                stream_pass.start_readers()
            self._places.begin(entry, stream_pass.id, plan)
        self._say_what_is_left_out(plan)
        if place.cursor == 0:
            self.skipped_ids = []
        self.current = stream_pass
        return stream_pass

    def deliver(
        self, stream_pass: StreamPass, rank: Rank, tensors: Tensors
    ) -> Generator[tuple[torch.Tensor, ...]]:
        """The batches of ``stream_pass``, begun by :meth:`start`; the caller stops the
        pass if it never advances this."""
        ahead: StreamPass | None = None  # the next pass, if this iterator started it
        last = False  # this pass's last batch was handed out
        try:
            for index in range(stream_pass.first, stream_pass.plan.num_batches):
                if self._ahead is None and stream_pass.book.all_asked:
                    self._look_ahead(stream_pass, rank, tensors)
                    ahead = self._ahead
                try:
                    delivery = stream_pass.take(index)
                except BatchwireError as exc:
                    if exc.code == StatusCode.FAILED_PRECONDITION:
                        # The dataset was replaced: the next pass describes it again.
                        self._info = None
                    raise
                stream_pass.cursor = delivery.cursor
                self.skipped_ids.extend(delivery.skipped_ids)
                # Also a batch whose every sample was unreadable (empty): every rank takes
                # len(loader) steps, or DDP's collectives would wait for this one.
                # Frameworks that count batches by len() (Lightning) stop asking here.
                last = index == stream_pass.plan.num_batches - 1
                # Nothing here holds a batch once it is handed out: the loop's letting go of
                # it gives its memory back (shared memory lent to it, a buffer to reuse).
                handed = [delivery]
                del delivery
                yield tensors.output(handed.pop())
            self._passes_ended += 1
            self._places.end(stream_pass)  # the next pass starts the following epoch
        finally:
            stream_pass.stop()
            if not last and ahead is not None and self._ahead is ahead:
                self._take_ahead()
                ahead.stop()  # left mid-pass: not the pass that follows any more

    def _say_what_is_left_out(self, plan: Plan) -> None:
        """Once a stream: the samples of an epoch that drop_last leaves out, or that
        padding repeats so that every rank takes as many steps (as torch's
        ``DistributedSampler`` pads), if any. A warning without shuffle (an evaluation,
        whose accuracy would be off by them); with it, as training usually runs: INFO."""
        if self._said_left_out or plan.origin:
            return
        delivered = plan.share_size * plan.world_size
        if delivered == plan.num_samples:
            return
        self._said_left_out = True
        level = logging.INFO if plan.shuffle else logging.WARNING
        ranks = counted(plan.world_size, "rank")
        if plan.drop_last:
            log.log(
                level,
                "%s: drop_last=True leaves out %s of the %s of each epoch (batches of %d "
                "over %s); pass drop_last=False to keep them (a short last batch, ranks "
                "padded to the same number of steps)",
                self.spec.name,
                counted(plan.num_samples - delivered, "sample"),
                counted(plan.num_samples, "sample"),
                plan.batch_size,
                ranks,
            )
        else:
            log.log(
                level,
                "%s: padding %s to the same number of steps (as DistributedSampler pads) "
                "repeats %s of the %s of each epoch; return_ids=True tells them apart, and "
                "drop_last=True leaves out the epoch's rest instead",
                self.spec.name,
                ranks,
                counted(delivered - plan.num_samples, "sample"),
                counted(plan.num_samples, "sample"),
            )

    def _window(self) -> int:
        # Twice the servers' credit: with one credit's worth of room, a server at half
        # the others' speed held up the loop (bench --fleet: 0.75 of the sum of the
        # servers' rates, 0.95 with this). Past a few servers (a unit of many workers)
        # they share that room: what a loader holds stays bounded.
        servers = min(len(self.servers.servers()), _WINDOW_SERVERS)
        prefetch = self.options.prefetch
        return prefetch + 2 * (prefetch + 2) * servers

    def _new_pass(self, spec: StreamSpec, plan: Plan, tensors: Tensors, window: int) -> StreamPass:
        return StreamPass(
            plan=plan,
            spec=spec.to_proto(),
            transport=self._transport,
            tensors=tensors,
            servers=self.servers,
            window=window,
        )

    def _look_ahead(self, current: StreamPass, rank: Rank, tensors: Tensors) -> None:
        """Start the pass that follows ``current`` when it runs to its end (the next
        epoch, from its start), asking each server for its first ``prefetch`` batches
        only: the next ``iter()`` adopts it if it is that pass, so that a short epoch
        (a validation pass) starts without a round trip. Anything else the next pass
        turns out to be (``set_epoch`` to another epoch, a loaded state, another world
        size) stops it. Nothing of it is in the ledger until it is adopted. Only a
        stream that ran a pass to its end before looks ahead: one that runs a single
        epoch (an inference job) asks the servers for nothing more."""
        if not self._passes_ended:
            return
        try:
            spec, plan = self.plan(rank, Place(current.plan.epoch + 1))
        except BatchwireError:
            return  # the next pass raises it itself
        if plan.num_batches == 0:
            return
        ahead = self._new_pass(spec, plan, tensors, self.options.prefetch)
        ahead.start_readers()
        self._ahead = ahead
        # A stream dropped without close() stops it too (a finished pass's do end).
        self._ahead_finalizer = weakref.finalize(self, ahead.stop)

    def _take_ahead(self) -> StreamPass | None:
        """The pass started ahead, now the caller's to adopt or stop; None if none."""
        ahead, self._ahead = self._ahead, None
        if self._ahead_finalizer is not None:
            self._ahead_finalizer.detach()
            self._ahead_finalizer = None
        return ahead

    # -- life cycle ------------------------------------------------------------------

    def close(self) -> None:
        """Stop the pass in progress and the pass started ahead; the place stays."""
        if self.current is not None:
            self.current.stop()  # kept: its place is the stream's (Places.place)
        ahead = self._take_ahead()
        if ahead is not None:
            ahead.stop()

    def __getstate__(self) -> dict[str, Any]:
        """A copy without threads (spawned DataLoader workers, ``ddp_spawn``)."""
        return {**self.__dict__, "current": None, "_ahead": None, "_ahead_finalizer": None}
