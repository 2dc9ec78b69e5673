"""Where a loader stands in its epochs, and how that is kept and saved.

A pass starts at a :class:`Place`: an epoch, the origin of its split and a cursor. A
loader's :class:`LoaderState`, which :class:`~batchwire.client.RemoteLoader` holds, keeps
the place its next pass starts at in the :class:`Entry` of its ledger
(``batchwire.client._ledger``), which it shares with its own DataLoader workers; it
builds a pass's place from the pass's plan and cursor, and saves (``state_dict``) and
restores (``load_state_dict``) it.

A state records the job's global position in the epoch besides the rank's cursor. The
ranks of a job move in lockstep: global step ``k`` is the ``k``-th batch of every rank,
and a DDP step is a collective, so at a checkpoint every rank holds the same cursor
``c``. A pass whose split began at ``origin`` (0 for a whole epoch) has then consumed
elements ``[origin, origin + c·W)`` of the epoch order, all ranks together: the global
position ``G = min(origin + c·W, N)``. A state thus loads on every rank of the job, and
on a job of another world size ``W'`` (or, with ``elastic_batch_size``, another batch
size): its next pass starts the split at ``origin = G``, and the ranks split the rest of
the order as the contract splits an epoch (``batchwire.common.sampler``).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Mapping, Sequence
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

__all__ = ["Entry", "LoaderState", "Place"]

_STATE_VERSION = 3
# 1: batchwire 0.1, 2: the release after it. Same fields and meaning, without origin (0).
_READABLE_STATES = (1, 2, 3)
# A state loads into a loader only if these match (a mixture's "dataset" is its sources'
# names joined by "+"). The rank may differ (frameworks save rank 0's state and load it on
# every rank), and so may the world size (see the module).
_IDENTITY = ("dataset", "seed", "shuffle", "drop_last")
# The version of the dataset's content a state was saved on (DatasetInfo.version): a
# state loads only where the server serves that version. Absent in states saved by
# earlier releases, or before the loader described its dataset: not checked.
_DATASET_VERSION = "dataset_version"
# A mixture's sources as its state's epoch was planned: [dataset, count, version] each.
# The rest of that epoch is the same order only where the server serves those versions
# and the loader plans those counts.
_SOURCES = "sources"
# A mixture's state batched per source or stratified: its parts' states, by source name.
_PARTS = "parts"
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


class LoaderState:
    """Where a loader stands in its epochs (see the module): kept in ``ledger``; its
    ``state_dict``'s ``position`` is the job's global position in an epoch.

    The loader passes in what that depends on (the pass running, the rank,
    the dataset's description); ``spec`` gives the loader's settings, ``batching`` its
    mixture's batching ("random" for one dataset).
    """

    def __init__(
        self, spec: StreamSpec, *, batching: str = "random", elastic_batch_size: bool = False
    ) -> None:
        self.ledger = Ledger(Entry())
        self._spec = spec
        self._batching = batching
        self._elastic_batch_size = elastic_batch_size
        # load_state_dict ran in this DataLoader worker: see RemoteLoader._begin.
        self.loaded_in_worker = False

    def place(self, current: StreamPass | None) -> Place:
        """After the last batch ``current``, the loader's last pass, handed out (running,
        left or stopped: the place is the same), unless a directive or another pass came
        after it; else where the next pass starts."""
        entry = self.ledger.read()
        if current is not None and entry.pass_id == current.id:
            plan = current.plan
            if current.cursor == plan.share_size:
                return Place(plan.epoch + 1)  # after the last batch: see RemoteLoader._begin
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
        loaded in a DataLoader worker (see RemoteLoader._begin), it uses the place up."""
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

    def state_dict(
        self, current: StreamPass | None, rank: Rank, info: Described | None
    ) -> dict[str, Any]:
        """The state of RemoteLoader.state_dict: ``epoch``, ``origin``, ``cursor`` in
        shares of ``world_size`` ranks of ``batch_size``, and ``position``, the samples of
        the epoch the job consumed (all ranks together)."""
        if worker_id() is None and self.ledger.read().in_workers:
            raise InvalidArgumentError(
                "this loader's last pass ran in DataLoader worker processes, so this process "
                "cannot tell how many of its batches training has used. Checkpoint through "
                "torchdata's StatefulDataLoader(loader, batch_size=None, num_workers=N) (Lightning "
                "saves its state_dict() itself), or use num_workers=0, where the server does the "
                "work all the same"
            )
        place = self.place(current)
        world = place.world or rank.world_size
        position = place.origin + place.cursor * world
        state = {
            "version": _STATE_VERSION,
            **self._identity(),
            "batch_size": place.batch or self._spec.batch_size,
            "world_size": world,
            "pipeline": self._spec.pipeline,
            "rank": rank.rank,
            "epoch": place.epoch,
            "origin": place.origin,
            "cursor": place.cursor,
            "position": min(position, info.num_samples) if info is not None else position,
        }
        # Known once the loader described its dataset, which every pass does first.
        if info is not None and info.version:
            state[_DATASET_VERSION] = info.version
        if info is not None and info.sources:
            state[_SOURCES] = _sources_of(info)
        return state

    def _identity(self) -> dict[str, Any]:
        return {
            key: self._spec.name if key == "dataset" else getattr(self._spec, key)
            for key in _IDENTITY
        }

    def mixture_state(self, rank: Rank, parts: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """The state of RemoteLoader.state_dict of a mixture batched per source or
        stratified: its settings, ``epoch``, the earliest a part stands in, and ``parts``,
        each part's state by its source's name."""
        return {
            "version": _STATE_VERSION,
            **self._identity(),
            "batching": self._batching,
            "batch_size": self._spec.batch_size,
            "epoch": min(state["epoch"] for state in parts.values()),
            "world_size": rank.world_size,
            "rank": rank.rank,
            _PARTS: dict(parts),
        }

    def parts_of(self, state: Mapping[str, Any], names: Sequence[str]) -> Mapping[str, Any]:
        """The parts' states of a mixture's ``state`` (see ``mixture_state``), once
        ``check_identity`` passed it: one for each of ``names``, its sources' names."""
        self.check_identity(state)
        parts = state.get(_PARTS)
        if not isinstance(parts, Mapping) or sorted(parts) != sorted(names):
            raise InvalidArgumentError(
                f"this state of a per-source mixture holds the states of "
                f"{sorted(parts) if isinstance(parts, Mapping) else parts!r}, not of its "
                f"sources {list(names)}: it was not saved by a loader of this mixture"
            )
        return parts

    def check_identity(self, state: Mapping[str, Any]) -> None:
        """Refuse a state of a loader of another batching, of another version of the
        format, or of a loader of another dataset, seed, shuffle or drop_last, or (unless
        elastic) batch size."""
        saved = state.get("batching", "random")
        if saved != self._batching:
            raise InvalidArgumentError(
                f"state was saved by a loader of batching={saved!r} but this loader has "
                f"batching={self._batching!r}; create the loader with the same mixture to "
                "resume"
            )
        if state.get("version") not in _READABLE_STATES:
            raise InvalidArgumentError(
                f"state version {state.get('version')!r} is not one of {_READABLE_STATES}"
            )
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise InvalidArgumentError(
                    f"state was saved with {key}={state.get(key)!r} but this loader has "
                    f"{key}={value!r}; create the loader with the same settings to resume"
                )
        if state.get("batch_size") != self._spec.batch_size and not self._elastic_batch_size:
            raise InvalidArgumentError(
                f"state was saved with batch_size={state.get('batch_size')!r} but this loader "
                f"has batch_size={self._spec.batch_size}; create the loader with the same "
                "batch_size, or pass elastic_batch_size=True to resume at the same global "
                "position with batches of the new size"
            )

    def load_state_dict(self, state: Mapping[str, Any], describe: Callable[[], Described]) -> bool:
        """Check ``state`` (see RemoteLoader.load_state_dict) and make it the place the
        next pass starts at; False in a DataLoader worker that streams nothing.
        ``describe`` asks a server for the dataset as it is served now."""
        self.check_identity(state)
        epoch, origin, cursor = (int(state.get(key, 0)) for key in ("epoch", "origin", "cursor"))
        place = Place(epoch, origin, cursor, int(state["world_size"]), int(state["batch_size"]))
        if min(place.epoch, place.origin, place.cursor) < 0 or min(place.world, place.batch) < 1:
            raise InvalidArgumentError(
                f"state has epoch={place.epoch}, origin={place.origin}, cursor={place.cursor} "
                f"(each must be >= 0), world_size={place.world}, batch_size={place.batch} "
                "(each must be >= 1): it was not saved by a RemoteLoader"
            )
        worker = worker_id()
        if worker not in (None, 0):
            return False  # workers other than 0 stream nothing (see RemoteLoader)
        if place.cursor > 0 or place.origin > 0:  # at an epoch's start nothing is left over
            if self._spec.sources:
                _check_sources(state.get(_SOURCES), describe)
            else:
                _check_dataset_version(self._spec.dataset, state.get(_DATASET_VERSION), describe)
        with self.ledger.update() as entry:
            entry.start_at(place)
        self.loaded_in_worker = worker is not None
        return True


def _sources_of(info: Described) -> list[list[Any]]:
    return [[source.dataset, source.count, source.version] for source in info.sources]


def _check_sources(saved: object, describe: Callable[[], Described]) -> None:
    """Refuse a mixture's state whose epoch was planned on other counts, or on other
    versions of its datasets, than this loader plans on what the server serves now."""
    if saved is None:
        raise InvalidArgumentError(
            "this state of a mixture does not say its sources' counts and versions: it was "
            "not saved by a RemoteLoader of a mixture"
        )
    now = _sources_of(describe())
    try:
        if [list(source) for source in saved] == now:  # type: ignore[attr-defined]
            return
    except TypeError:
        pass  # not a list of lists: refused below
    raise InvalidArgumentError(
        f"state was saved on the mixture's sources {saved} ([dataset, samples per epoch, "
        f"version]) but this loader plans {now} on what the server serves now: a dataset "
        "was replaced (re-ingested) or the weights changed, and the rest of the saved "
        "epoch no longer exists. Start the epoch again (load no state, or call set_epoch), "
        "or serve the old versions with the same weights"
    )


def _check_dataset_version(dataset: str, saved: object, describe: Callable[[], Described]) -> None:
    """Refuse a state saved on another version of the dataset than the server's."""
    if not saved:
        return
    serving = describe().version
    if serving and saved != serving:
        raise InvalidArgumentError(
            f"state was saved on version {saved} of dataset {dataset!r} but the server now "
            f"serves version {serving}: the dataset was replaced (re-ingested). Start the "
            "epoch again (load no state, or call set_epoch) or serve the old version"
        )
