"""Where a loader stands: its rank (resolved when a pass starts) and its position, saved
and restored (``state_dict``, ``load_state_dict``, ``set_epoch``) in the loader's ledger,
which it shares with its own DataLoader workers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc

from batchwire.client._exceptions import InvalidArgumentError
from batchwire.client._frameworks import (
    distributed_rank_world,
    refuse_accelerate_wrappers,
    worker_id,
)
from batchwire.client._ledger import Ledger, Record

if TYPE_CHECKING:
    from batchwire.client._pass import StreamPass
    from batchwire.common.stream import StreamSpec
    from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["Rank", "Resumable"]

_STATE_VERSION = 2
_READABLE_STATES = (1, 2)  # version 1: saved by batchwire 0.1, same fields and meaning
# A state loads into a loader only if these match (the rank may differ: ranks move in
# lockstep, and frameworks save rank 0's state and load it on every rank).
_IDENTITY = ("dataset", "batch_size", "seed", "shuffle", "drop_last", "world_size")
# The version of the dataset's content a state was saved on (DatasetInfo.version): a
# state loads only where the server serves that version. Absent in states saved by
# earlier releases, or before the loader described its dataset: not checked.
_DATASET_VERSION = "dataset_version"


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclasses.dataclass(frozen=True)
class Rank:
    """Who a process streams for: a rank of a world (resolved when a pass starts)."""

    rank: int
    world_size: int


class Resumable:
    """The state methods of :class:`~batchwire.client.RemoteLoader` (a mixin: it reads
    the loader's ledger, pass, spec and share)."""

    _ledger: Ledger
    _pass: StreamPass | None
    _info: pb.DatasetInfo | None
    _spec: StreamSpec
    _group: Any
    _explicit: Rank | None
    _inherited: Rank | None
    _loaded_in_worker: bool
    skipped_ids: list[int]

    def _share(self) -> Rank:
        """This process's rank and world size, as of now (explicit, else torch.distributed's, else
        what the loader carried when it was pickled, else rank 0 of 1)."""
        live = distributed_rank_world(self._group)
        if self._explicit is not None:
            if live is not None and live != (self._explicit.rank, self._explicit.world_size):
                raise _invalid(
                    f"rank={self._explicit.rank}, world_size={self._explicit.world_size} were "
                    f"given, but torch.distributed is initialized with rank {live[0]} of "
                    f"{live[1]}: this process would train on another share than its rank's. "
                    "Leave rank and world_size unset to take them from torch.distributed, or "
                    "pass process_group= to shard over a subgroup"
                )
            return self._explicit
        if live is not None:
            return Rank(*live)
        return self._inherited or Rank(0, 1)

    @property
    def rank(self) -> int:
        return self._share().rank

    @property
    def world_size(self) -> int:
        return self._share().world_size

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next pass if none is."""
        return int(self._position(self._ledger.read())[0])

    def set_epoch(self, epoch: int) -> None:
        """The next pass starts ``epoch`` (at the loaded position if a loaded state is
        about to resume ``epoch``, as after ``load_state_dict``)."""
        refuse_accelerate_wrappers()
        if epoch < 0:
            raise _invalid(f"epoch must be >= 0, got {epoch}")
        with self._ledger.update() as record:
            if record.fresh and record.epoch == epoch:
                return
            record.epoch, record.cursor, record.fresh = epoch, 0, True
            record.pass_id, record.in_workers = 0, False

    def _position(self, record: Record) -> tuple[int, int]:
        """(epoch, cursor) after the last batch handed out, or where the next pass starts."""
        current = self._pass
        if current is not None and record.pass_id == current.id:
            if current.cursor == current.share_size:
                return current.epoch + 1, 0  # after the last batch: see _begin
            return current.epoch, current.cursor
        if record.fresh:
            return record.epoch, record.cursor
        return record.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: the position after the last batch handed out
        (prefetched ones don't count), or where the next pass starts.

        ``cursor`` is a position in a rank's share of ``epoch``; it is the same on
        every rank, so the state loads on any rank of the job.
        """
        record = self._ledger.read()
        if worker_id() is None and record.in_workers:
            raise _invalid(
                "this loader's last pass ran in DataLoader worker processes, so this process "
                "cannot tell how many of its batches training has used. Checkpoint through "
                "torchdata's StatefulDataLoader(loader, batch_size=None, num_workers=N) (Lightning "
                "saves its state_dict() itself), or use num_workers=0, where the server does the "
                "work all the same"
            )
        epoch, cursor = self._position(record)
        share = self._share()
        state = {
            "version": _STATE_VERSION,
            **self._identity(share),
            "pipeline": self._spec.pipeline,
            "rank": share.rank,
            "epoch": epoch,
            "cursor": cursor,
        }
        # Known once the loader described its dataset, which every pass does first.
        if self._info is not None and self._info.version:
            state[_DATASET_VERSION] = self._info.version
        return state

    def _check_dataset_version(self, saved: object) -> None:
        """Refuse a state saved on another version of the dataset than the server's."""
        if not saved:
            return
        self._info = None  # what the server serves now, not what it served before
        serving = self._describe().version
        if serving and saved != serving:
            raise _invalid(
                f"state was saved on version {saved} of dataset {self._spec.dataset!r} but "
                f"the server now serves version {serving}: the dataset was replaced "
                "(re-ingested). Start the epoch again (load no state, or call set_epoch) or "
                "serve the old version"
            )

    def _describe(self) -> pb.DatasetInfo:
        raise NotImplementedError  # RemoteLoader's

    def _identity(self, share: Rank) -> dict[str, Any]:
        """The settings a state must share with a loader to load into it (_IDENTITY)."""
        return {
            "dataset": self._spec.dataset,
            "batch_size": self._spec.batch_size,
            "seed": self._spec.seed,
            "shuffle": self._spec.shuffle,
            "drop_last": self._spec.drop_last,
            "world_size": share.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next pass continues from ``state``: exactly the rest of its epoch.

        Refuses a state of another dataset, seed, batch size, shuffle, drop_last or
        world size, with a message; and a state saved on another version of the dataset
        than the server serves now (the dataset was replaced: the rest of its epoch no
        longer exists). That check describes the dataset, so the server must answer;
        a state without ``dataset_version`` (earlier releases), or at an epoch's start
        (``cursor`` 0), is not checked.
        """
        if state.get("version") not in _READABLE_STATES:
            raise _invalid(
                f"state version {state.get('version')!r} is not one of {_READABLE_STATES}"
            )
        mine = self._identity(self._share())
        for key in _IDENTITY:
            if state.get(key) != mine[key]:
                hint = "create the loader with the same settings to resume"
                if key == "world_size" and distributed_rank_world(self._group) is None:
                    hint = "load it after torch.distributed is initialized"
                raise _invalid(
                    f"state was saved with {key}={state.get(key)!r} but this loader has "
                    f"{key}={mine[key]!r}; {hint}"
                )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or cursor < 0:
            raise _invalid(f"state has epoch={epoch}, cursor={cursor}; both must be >= 0")
        worker = worker_id()
        if worker not in (None, 0):
            return  # workers other than 0 stream nothing (see the class docstring)
        if cursor > 0:  # at an epoch's start nothing of the old version is left to finish
            self._check_dataset_version(state.get(_DATASET_VERSION))
        with self._ledger.update() as record:
            record.epoch, record.cursor, record.fresh = epoch, cursor, True
            record.pass_id, record.in_workers = 0, False
        self._loaded_in_worker = worker is not None
        self.skipped_ids = []
