"""Where a stream stands in its epochs: the place of its next pass, kept and shared.

A **place** is a resume point: where a pass of an epoch starts or stands, the ``origin``
of the epoch's split it belongs to and its ``cursor`` in the share of each rank (the
offset a stream resumes at, as the wire's ``Batch.cursor`` says it). A stream's
:class:`Places` keep the place its next pass starts at in the :class:`Entry` of its ledger
(``batchwire.client._ledger``), which it shares with its loader's DataLoader workers, and
read the place a running pass stands at from that pass (``StreamPass.cursor``). The dict
that saves a place (``state_dict``) is ``batchwire.client._state_dict``'s.

A place is saved with the job's global position in the epoch. The ranks of a job move in
lockstep: global step ``k`` is the ``k``-th batch of every rank, and a DDP step is a
collective, so at a checkpoint every rank holds the same cursor ``c``. A pass whose split
began at ``origin`` (0 for a whole epoch) has then consumed elements
``[origin, origin + c·W)`` of the epoch order, all ranks together: the global position
``G = min(origin + c·W, N)``. A place thus loads on every rank of the job, and on a job of
another world size ``W'`` (or, with ``elastic_batch_size``, another batch size): its next
pass starts the split at ``origin = G``, and the ranks split the rest of the order as the
contract splits an epoch (``batchwire.common.sampler``).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING, Any

from batchwire.client._frameworks import worker_id
from batchwire.client._ledger import Ledger
from batchwire.client._rank import Rank
from batchwire.client._transport import InvalidArgumentError
from batchwire.common.sampler import Plan

if TYPE_CHECKING:
    from batchwire.client._mixture import Described
    from batchwire.client._pass import StreamPass
    from batchwire.common.stream import StreamSpec

__all__ = ["Entry", "Place", "Places"]

# An entry's bytes in the ledger (batchwire.client._ledger.SIZE of them), which a loader's
# DataLoader workers read: version, epoch, cursor, fresh, pass_id, in_workers, origin,
# world, batch.
_ENTRY = struct.Struct("<9q")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a pass of ``epoch`` starts or stands: ``cursor`` positions into each rank's
    share of the split that begins at ``origin``. ``world`` and ``batch`` are the world
    and batch size the cursor counts in (0: the loader's own)."""

    epoch: int
    origin: int = 0
    cursor: int = 0
    world: int = 0
    batch: int = 0


@dataclasses.dataclass
class Entry:
    """What a loader's ledger holds: the place its next pass starts at, and which pass
    began last.

    ``fresh`` set: the next pass starts exactly at ``place`` (a new loader,
    ``set_epoch``, ``load_state_dict``, or a pass that ran to its end). ``fresh`` clear:
    a pass of ``place.epoch`` began; the next one starts the epoch after it. ``pass_id``
    names the pass that began last (0: none since a directive). ``in_workers``: that pass
    ran in a DataLoader worker, so this process cannot know how far training got. A
    place counted in another world or batch size (a loaded state of a job of another
    shape) starts the next pass at its global position (see the module).
    """

    place: Place = Place(0)
    fresh: bool = True
    pass_id: int = 0
    in_workers: bool = False
    version: int = 1

    def start_at(self, place: Place, *, directive: bool = True) -> None:
        """Make ``place`` the place the next pass starts at; a ``directive`` (set_epoch,
        load_state_dict) also forgets the passes before it."""
        self.place, self.fresh = place, True
        if directive:
            self.pass_id, self.in_workers = 0, False

    def pack(self) -> bytes:
        place = self.place
        return _ENTRY.pack(
            self.version,
            place.epoch,
            place.cursor,
            self.fresh,
            self.pass_id,
            self.in_workers,
            place.origin,
            place.world,
            place.batch,
        )

    @classmethod
    def unpack(cls, data: bytes) -> Entry:
        fields = _ENTRY.unpack(data)
        version, epoch, cursor, fresh, pass_id, in_workers, origin, world, batch = fields
        place = Place(epoch, origin, cursor, world, batch)
        return cls(place, bool(fresh), pass_id, bool(in_workers), version)


class Places:
    """Where a stream of ``spec`` stands in its epochs (see the module): the place its
    next pass starts at, kept in ``ledger``, and the place its running pass stands at.
    The stream passes in what that depends on (the pass running, the rank, the
    dataset's description).
    """

    def __init__(self, spec: StreamSpec) -> None:
        self.ledger = Ledger(Entry())
        self._spec = spec
        # A loaded place in this DataLoader worker: see Epochs.begin.
        self.loaded_in_worker = False

    def place(self, current: StreamPass | None) -> Place:
        """After the last batch ``current``, the loader's last pass, handed out (running,
        left or stopped: the place is the same), unless a directive or another pass came
        after it; else where the next pass starts."""
        entry = self.ledger.read()
        if current is not None and entry.pass_id == current.id:
            plan = current.plan
            if current.cursor == plan.share_size:
                return Place(plan.epoch + 1)  # after the last batch: see Epochs.begin
            return Place(plan.epoch, plan.origin, current.cursor, plan.world_size)
        return entry.place if entry.fresh else Place(entry.place.epoch + 1)

    def upcoming(self, entry: Entry, rank: Rank, info: Described) -> tuple[Place, StreamSpec, Plan]:
        """Where the next pass of ``rank`` starts, as the ledger's ``entry`` places it,
        its stream and its plan (of the dataset or mixture ``info`` describes)."""
        place = self._next_place(entry, rank, info.num_samples)
        spec, plan = self.plan(rank, place, info)  # validates a loaded cursor
        if plan.num_batches == 0 or 0 < plan.share_size == place.cursor:
            # The end of an epoch is the start of the next: frameworks that count
            # batches by len() (Lightning) never ask past the last one, so their
            # checkpoint at an epoch's end is this, and the next pass is a new epoch.
            # So is a rest of an epoch that drop_last leaves no batch of.
            place = Place(place.epoch + 1)
            spec, plan = self.plan(rank, place, info)
        return place, spec, plan

    def _next_place(self, entry: Entry, rank: Rank, num_samples: int) -> Place:
        """Where the next pass of ``rank`` starts, in its own units: a place counted in
        another world or batch size starts the split at its global position."""
        at = entry.place
        if not entry.fresh:
            return Place(at.epoch + 1)
        world, batch = at.world or rank.world_size, at.batch or self._spec.batch_size
        if (world, batch) == (rank.world_size, self._spec.batch_size):
            return Place(at.epoch, at.origin, at.cursor)
        origin = min(at.origin, num_samples)
        saved = Plan(
            num_samples=num_samples,
            batch_size=batch,
            world_size=world,
            drop_last=self._spec.drop_last,
            origin=origin,
        )
        if at.cursor >= saved.share_size:
            # The saved job's epoch was over; the tail it dropped stays dropped.
            return Place(at.epoch + 1)
        return Place(at.epoch, min(origin + at.cursor * world, num_samples))

    def begin(self, entry: Entry, pass_id: int, plan: Plan) -> None:
        """Pass ``pass_id`` starts as ``plan`` plans it; unless it only tries a state
        loaded in a DataLoader worker (see Epochs.begin), it uses the place up."""
        if not self.loaded_in_worker:
            entry.place, entry.fresh = Place(plan.epoch, plan.origin, plan.start), False
        self.loaded_in_worker = False
        entry.pass_id, entry.in_workers = pass_id, worker_id() is not None

    def end(self, stream_pass: StreamPass) -> None:
        """A pass that ran to its end: the next one starts the following epoch."""
        with self.ledger.update() as entry:
            if entry.pass_id == stream_pass.id:
                entry.start_at(Place(stream_pass.plan.epoch + 1), directive=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "loaded_in_worker": False}

    def plan(self, rank: Rank, place: Place, info: Described) -> tuple[StreamSpec, Plan]:
        """The stream of ``rank`` from ``place`` (in the loader's units) of the dataset
        or mixture ``info`` describes, and its plan."""
        try:
            # The version the share is planned on (a mixture's counts and versions): a
            # server that serves another one refuses the stream (FAILED_PRECONDITION)
            # rather than mix versions.
            spec = self._spec.replace(
                rank=rank.rank,
                world_size=rank.world_size,
                epoch=place.epoch,
                origin=place.origin,
                start=place.cursor,
                **info.planned(),
            )
            plan = spec.plan(info.sizes if info.sources else info.num_samples)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from exc
        if plan.num_batches == 0 and place.origin == 0:
            raise InvalidArgumentError(
                f"batch_size {spec.batch_size} is larger than this rank's share of the "
                f"dataset ({plan.num_samples} samples over {spec.world_size} "
                f"{'rank' if spec.world_size == 1 else 'ranks'}) and "
                "drop_last=True leaves no batch: every epoch would be empty. Lower batch_size "
                "or pass drop_last=False"
            )
        return spec, plan

    def set_epoch(self, epoch: int) -> None:
        """The next pass starts ``epoch`` (at the loaded position if a loaded state is
        about to resume ``epoch``)."""
        if epoch < 0:
            raise InvalidArgumentError(f"epoch must be >= 0, got {epoch}")
        with self.ledger.update() as entry:
            if not (entry.fresh and entry.place.epoch == epoch):
                entry.start_at(Place(epoch))

    def load(self, place: Place) -> None:
        """The next pass starts at ``place``, a loaded one: in a DataLoader worker, only
        the pass made right after it uses it up (see ``begin``)."""
        with self.ledger.update() as entry:
            entry.start_at(place)
        self.loaded_in_worker = worker_id() is not None

    def refuse_if_in_workers(self) -> None:
        """Raise outside DataLoader workers if the last pass ran in them: this process
        cannot know how far training got."""
        if worker_id() is None and self.ledger.read().in_workers:
            raise InvalidArgumentError(
                "this loader's last pass ran in DataLoader worker processes, so this process "
                "cannot tell how many of its batches training has used. Checkpoint through "
                "torchdata's StatefulDataLoader(loader, batch_size=None, num_workers=N) (Lightning "
                "saves its state_dict() itself), or use num_workers=0, where the server does the "
                "work all the same"
            )
