"""Where a loader's next pass starts, shared with the loader's DataLoader worker processes.

A ``RemoteLoader`` handed to ``DataLoader(num_workers=N)`` is copied into each
worker (by fork, or by pickling for spawn and forkserver), and a worker's copy
runs the pass. Without something shared, the loader in the training process
would never learn that a pass happened, and every epoch would replay the
first. The ledger is that shared thing: a few integers in a small file
(``/dev/shm`` where it exists), read and written under ``flock``, which works
across fork, spawn and forkserver alike. The file is removed when its loader goes; the
files of processes killed before they could (``kill -9``) are removed by the next
process that makes a ledger: a creator holds a POSIX lock on its file for life, and a
file nobody holds is a dead process's.

Only the process that created a ledger and the DataLoader workers of that
process share it. Any other process holding a copy of the loader (a spawned
DDP rank, a forked child that is not a DataLoader worker) gets a ledger of its
own, starting from the values the copy carried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import struct
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import torch.utils.data

__all__ = ["Ledger", "Record"]

_FORMAT = struct.Struct("<9q")
_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
_PREFIX = "batchwire-loader-"  # then the creating process's pid, "-" and mkstemp's letters
_LIVE = _FORMAT.size  # the byte its creator holds a read lock on while it lives
_swept = False  # this process removed the files of dead processes already


@dataclasses.dataclass
class Record:
    """The ledger's values.

    ``fresh`` set: the next pass starts exactly at ``(epoch, cursor)`` (a new
    loader, ``set_epoch``, ``load_state_dict``, or a pass that ran to its end).
    ``fresh`` clear: a pass of ``epoch`` began; the next one starts the epoch
    after it. ``pass_id`` names the pass that began last (0: none since a
    directive). ``in_workers``: that pass ran in a DataLoader worker, so this
    process cannot know how far training got. ``origin`` is where in the epoch order
    the split of that pass begins; ``world`` and ``batch``, where not 0, are the world
    and batch size ``cursor`` counts in (a loaded state of a job of another shape: the
    next pass starts at its global position, see ``batchwire.client._state``).
    """

    epoch: int = 0
    cursor: int = 0
    fresh: bool = True
    pass_id: int = 0
    in_workers: bool = False
    version: int = 1
    origin: int = 0
    world: int = 0
    batch: int = 0

    def pack(self) -> bytes:
        return _FORMAT.pack(
            self.version,
            self.epoch,
            self.cursor,
            self.fresh,
            self.pass_id,
            self.in_workers,
            self.origin,
            self.world,
            self.batch,
        )

    @classmethod
    def unpack(cls, data: bytes) -> Record:
        version, epoch, cursor, fresh, pass_id, in_workers, *place = _FORMAT.unpack(data)
        return cls(epoch, cursor, bool(fresh), pass_id, bool(in_workers), version, *place)


_ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()


def _settle_before_fork() -> None:
    # A forked DataLoader worker shares the ledger its parent has open. A copy that its
    # parent never opened (unpickled in a spawned DDP rank, say) would lead the worker
    # to the file the copy came from, another process's: open them all here first.
    for ledger in list(_ledgers):
        with contextlib.suppress(Exception):
            ledger._handle()


os.register_at_fork(before=_settle_before_fork)


def _sweep(directory: str) -> None:
    """Remove the ledger files no live process holds: one killed (``kill -9``, an
    out-of-memory kill) never ran the finalizer that removes its file. Each creator holds
    a POSIX read lock on a byte past its record for life (``_LIVE``); the kernel drops it
    with the process. This process holds no ledger yet: closing a file here releases no
    lock of its own."""
    for name in os.listdir(directory):
        if not name.startswith(_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:  # gone already, or another user's
            continue
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _LIVE)
        except OSError:  # its creator is alive
            continue
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
        finally:
            os.close(fd)


def _remove(path: str, owner: int) -> None:
    # Finalizers are inherited by forked children: only the creator removes the file.
    if os.getpid() == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class Ledger:
    """A ``Record`` shared between a loader and its DataLoader workers; see the module."""

    def __init__(self, initial: Record | None = None) -> None:
        self._create(initial or Record())
        _ledgers.add(self)

    def _create(self, initial: Record) -> None:
        global _swept
        if not _swept:
            _swept = True
            with contextlib.suppress(OSError):
                _sweep(_DIR or tempfile.gettempdir())
        # Locked before it takes the name a sweep looks for, so that no sweep finds it
        # unheld. The lock is for life: the kernel releases it when this process goes,
        # however it goes (POSIX locks are independent of the flock that guards the record).
        fd, made = tempfile.mkstemp(prefix=f".{_PREFIX}{os.getpid()}-", dir=_DIR)
        fcntl.lockf(fd, fcntl.LOCK_SH, 1, _LIVE)
        self._path = os.path.join(os.path.dirname(made), os.path.basename(made)[1:])
        os.rename(made, self._path)
        os.write(fd, initial.pack())
        self._fd = fd
        self._snapshot = initial
        self._pid = self._owner = os.getpid()
        self._finalizer = weakref.finalize(self, _remove, self._path, self._owner)

    def _handle(self) -> int:
        """This process's descriptor (flock needs one per process: fork shares them)."""
        if self._pid == os.getpid():
            return self._fd
        if torch.utils.data.get_worker_info() is None:
            # Not a DataLoader worker of the owner: continue on a ledger of our own.
            self._create(self._read_from_path())
            return self._fd
        try:
            self._fd = os.open(self._path, os.O_RDWR)
        except FileNotFoundError:
            raise RuntimeError(
                "the RemoteLoader this DataLoader worker copied was closed in the training "
                "process; close() the loader only after its DataLoader is done"
            ) from None
        self._pid = os.getpid()
        return self._fd

    def _read_from_path(self) -> Record:
        try:
            with open(self._path, "rb") as file:
                return Record.unpack(file.read(_FORMAT.size))
        except (FileNotFoundError, struct.error):
            return self._snapshot

    @contextlib.contextmanager
    def update(self) -> Iterator[Record]:
        """The record, locked against the other processes; changes are written back."""
        fd = self._handle()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            record = Record.unpack(os.pread(fd, _FORMAT.size, 0))
            before = dataclasses.replace(record)
            yield record
            if record != before:
                os.pwrite(fd, record.pack(), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def read(self) -> Record:
        with self.update() as record:
            return dataclasses.replace(record)

    def close(self) -> None:
        """Remove the file (in the process that created it); idempotent."""
        self._finalizer()

    def __getstate__(self) -> dict[str, Any]:
        # A pickled copy (spawned workers, spawned DDP ranks) carries the path and
        # the values, so that whichever way _handle goes, it has what it needs. Read
        # first: a copy this process never opened moves onto a ledger of its own there,
        # and its spawned workers must share that one, not the file it was copied from.
        snapshot = self.read()
        return {"path": self._path, "snapshot": snapshot}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._path = state["path"]
        self._snapshot = state["snapshot"]
        self._fd = -1
        self._pid = self._owner = -1
        self._finalizer = weakref.finalize(self, _remove, self._path, -1)  # not ours: no-op
        _ledgers.add(self)
