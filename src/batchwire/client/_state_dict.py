"""The dict a loader's ``state_dict()`` returns: its keys, the versions of its layout a
loader reads, and the checks a loaded one passes.

A stream's dict saves one :class:`~batchwire.client._state.Place` with the settings it
is counted in: ``epoch``, ``origin`` and ``cursor`` (the place), ``world_size`` and
``batch_size`` (the units its cursor counts in), the loader's identity (``dataset``,
``seed``, ``shuffle``, ``drop_last``), ``pipeline`` and ``rank`` for the reader, and
``position``, the job's global position in the epoch, derived from the place for the
reader and never read back (``origin + cursor · world_size``, see
``batchwire.client._state``). Once the loader described its dataset, ``dataset_version``
(one dataset) or ``sources`` (a mixture: ``[dataset, count, version]`` each) say what
the epoch was planned on.

A mixture batched per source or stratified saves its parts' dicts, each a stream's, by
source name under ``parts``, beside the mixture's identity, ``batching``, ``batch_size``,
``epoch`` (the earliest a part stands in), ``world_size`` and ``rank``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from batchwire.client._rank import Rank
from batchwire.client._state import Place
from batchwire.client._transport import InvalidArgumentError

if TYPE_CHECKING:
    from batchwire.client._mixture import Described
    from batchwire.common.stream import StreamSpec

__all__ = ["StateDicts"]

_STATE_VERSION = 3
# 1: batchwire 0.1, 2: the release after it. Same fields and meaning, without origin (0).
_READABLE_STATES = (1, 2, 3)
# A state loads into a loader only if these match (a mixture's "dataset" is its sources'
# names joined by "+"). The rank may differ (frameworks save rank 0's state and load it on
# every rank), and so may the world size (see batchwire.client._state).
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


@dataclasses.dataclass(frozen=True)
class StateDicts:
    """The state dicts of a stream of ``spec`` (or of a mixture's parts, ``batching``
    "per_source" or "stratified"): made from a place, and checked and read back."""

    spec: StreamSpec
    batching: str = "random"
    elastic_batch_size: bool = False

    def of_place(self, place: Place, rank: Rank, info: Described | None) -> dict[str, Any]:
        """A stream's dict: ``place`` (its cursor counted in shares of ``world_size``
        ranks of ``batch_size``) of ``rank``, and what ``info`` says it was planned on."""
        world = place.world or rank.world_size
        position = place.origin + place.cursor * world
        state = {
            "version": _STATE_VERSION,
            **self._identity(),
            "batch_size": place.batch or self.spec.batch_size,
            "world_size": world,
            "pipeline": self.spec.pipeline,
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

    def of_parts(self, rank: Rank, parts: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """A mixture's dict, batched per source or stratified: its settings, ``epoch``,
        the earliest a part stands in, and ``parts``, each part's dict by source name."""
        return {
            "version": _STATE_VERSION,
            **self._identity(),
            "batching": self.batching,
            "batch_size": self.spec.batch_size,
            "epoch": min(state["epoch"] for state in parts.values()),
            "world_size": rank.world_size,
            "rank": rank.rank,
            _PARTS: dict(parts),
        }

    def place_of(self, state: Mapping[str, Any]) -> Place:
        """The place a stream's ``state`` saves, once ``check_identity`` passed it."""
        self.check_identity(state)
        epoch, origin, cursor = (int(state.get(key, 0)) for key in ("epoch", "origin", "cursor"))
        place = Place(epoch, origin, cursor, int(state["world_size"]), int(state["batch_size"]))
        if min(place.epoch, place.origin, place.cursor) < 0 or min(place.world, place.batch) < 1:
            raise InvalidArgumentError(
                f"state has epoch={place.epoch}, origin={place.origin}, cursor={place.cursor} "
                f"(each must be >= 0), world_size={place.world}, batch_size={place.batch} "
                "(each must be >= 1): it was not saved by a RemoteLoader"
            )
        return place

    def check_served(self, state: Mapping[str, Any], describe: Callable[[], Described]) -> None:
        """Refuse a stream's ``state`` saved mid-epoch on other versions (or a mixture's
        on other counts) than this loader plans on what the server serves now, which
        ``describe`` asks."""
        if self.spec.sources:
            _check_sources(state.get(_SOURCES), describe)
        else:
            _check_dataset_version(self.spec.dataset, state.get(_DATASET_VERSION), describe)

    def parts_of(self, state: Mapping[str, Any], names: Sequence[str]) -> Mapping[str, Any]:
        """The parts' dicts of a mixture's ``state`` (see ``of_parts``), once
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
        if saved != self.batching:
            raise InvalidArgumentError(
                f"state was saved by a loader of batching={saved!r} but this loader has "
                f"batching={self.batching!r}; create the loader with the same mixture to "
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
        if state.get("batch_size") != self.spec.batch_size and not self.elastic_batch_size:
            raise InvalidArgumentError(
                f"state was saved with batch_size={state.get('batch_size')!r} but this loader "
                f"has batch_size={self.spec.batch_size}; create the loader with the same "
                "batch_size, or pass elastic_batch_size=True to resume at the same global "
                "position with batches of the new size"
            )

    def _identity(self) -> dict[str, Any]:
        return {
            key: self.spec.name if key == "dataset" else getattr(self.spec, key)
            for key in _IDENTITY
        }


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
