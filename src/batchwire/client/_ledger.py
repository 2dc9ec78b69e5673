"""An entry shared between a loader and its DataLoader worker processes: where the
loader's next pass starts (``batchwire.client._state``'s ``Entry``).

A ``RemoteLoader`` handed to ``DataLoader(num_workers=N)`` is copied into each
worker (by fork, or by pickling for spawn and forkserver), and a worker's copy
runs the pass. Without something shared, the loader in the training process
would never learn that a pass happened, and every epoch would replay the
first. The ledger is that shared thing: an entry of ``SIZE`` bytes in a small file,
read and written under ``flock``, which works across fork, spawn and forkserver
alike. The file is removed when its loader goes; the files of processes killed
before they could (``kill -9``) are removed by the next process that makes a
ledger in the same directory: a creator holds a POSIX lock on its file for life,
and a file nobody holds is a dead process's.

The file goes in ``/dev/shm`` where it can, else in ``tempfile.gettempdir()``
(``TMPDIR``): a directory that refuses it (full, out of inodes, read-only, not
writable by this user) is left, with nothing in it, for the next. The file's
bytes are reserved when it is made, so that writing the entry later never
fails for space. Where no directory takes it (a container's full 64 MiB
``/dev/shm`` and no writable temporary directory), the ledger is kept in
memory, of this process alone, and a warning says so once per process: the
training process then never sees the passes that DataLoader workers run, so
each epoch must be set with ``set_epoch``.

Only the process that created a ledger and the DataLoader workers of that
process share it. Any other process holding a copy of the loader (a spawned
DDP rank, a forked child that is not a DataLoader worker) gets a ledger of its
own, starting from the values the copy carried.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any, Generic, Protocol, Self, TypeVar

import torch.utils.data

__all__ = ["SIZE", "Entry", "Ledger"]

_log = logging.getLogger(__name__)

# The bytes of an entry: a loader's file and its workers' reads of it agree on this, and
# so do the files of other processes (releases) that a sweep locks past it.
SIZE = 72
_SHM = "/dev/shm"
_PREFIX = "batchwire-loader-"  # then the creating process's pid, "-" and mkstemp's letters
_LIVE = SIZE  # the byte its creator holds a read lock on while it lives
# posix_fallocate's errors that mean "this file system cannot", not "no room".
_NO_FALLOCATE = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_swept: set[str] = set()  # the directories this process removed dead processes' files from
_warned = 0  # the pid of the process that logged that its ledgers are in memory


class Entry(Protocol):
    """What a ledger holds: a value packed into ``SIZE`` bytes, and read back from them."""

    def pack(self) -> bytes: ...

    @classmethod
    def unpack(cls, data: bytes) -> Self: ...


R = TypeVar("R", bound=Entry)


_ledgers: weakref.WeakSet[Ledger[Any]] = weakref.WeakSet()


def _settle_before_fork() -> None:
    # A forked DataLoader worker shares the ledger its parent has open. A copy that its
    # parent never opened (unpickled in a spawned DDP rank, say) would lead the worker
    # to the file the copy came from, another process's: open them all here first.
    for ledger in list(_ledgers):
        with contextlib.suppress(Exception):
            ledger._handle()


os.register_at_fork(before=_settle_before_fork)


def _directories() -> tuple[list[str], list[str]]:
    """Where a ledger file may go, best first: ``/dev/shm`` (memory) where it exists,
    then the temporary directory; and why one is missing."""
    candidates, missing = [_SHM] if os.path.isdir(_SHM) else [], []
    try:
        candidates.append(tempfile.gettempdir())
    except OSError as exc:  # none of TMPDIR, /tmp, /var/tmp, ... took its probe file
        missing.append(str(exc))
    # By real path: a sweep of a directory this process already has a file in (under
    # another name) would take that file for a dead process's (POSIX locks of one
    # process never conflict).
    unique: dict[str, str] = {}
    for directory in candidates:
        unique.setdefault(os.path.realpath(directory), directory)
    return list(unique.values()), missing


def _sweep(directory: str) -> None:
    """Remove the ledger files no live process holds: one killed (``kill -9``, an
    out-of-memory kill) never ran the finalizer that removes its file. Each creator holds
    a POSIX read lock on a byte past its entry for life (``_LIVE``); the kernel drops it
    with the process. This process holds no ledger in ``directory`` yet: closing a file
    here releases no lock of its own. Needs no room: it only opens, locks and unlinks."""
    for name in os.listdir(directory):
        if not name.startswith(_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:  # gone already, another user's, or a read-only directory
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


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's first ``size`` bytes now, so that writing them later cannot
    fail for want of space. Where the file system cannot, the write of the entry that
    follows allocates them (an overwrite in place needs no more room on tmpfs or ext4)."""
    if not hasattr(os, "posix_fallocate"):  # macOS
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in _NO_FALLOCATE:
            raise


def _write(fd: int, data: bytes) -> None:
    written = os.pwrite(fd, data, 0)
    if written != len(data):  # a short write: the file system ran out of room
        raise OSError(errno.ENOSPC, f"wrote {written} of an entry's {len(data)} bytes")


def _make_file(directory: str, data: bytes) -> tuple[int, str]:
    """A new ledger file in ``directory`` holding ``data``, locked for life: its
    descriptor and path. Raises OSError, with nothing left behind, where the directory
    refuses it or has no room."""
    # Locked before it takes the name a sweep looks for, so that no sweep finds it
    # unheld, and complete by then, so that no worker reads half an entry. The lock is
    # for life: the kernel releases it when this process goes, however it goes (POSIX
    # locks are independent of the flock that guards the entry).
    fd, made = tempfile.mkstemp(prefix=f".{_PREFIX}{os.getpid()}-", dir=directory)
    path = os.path.join(os.path.dirname(made), os.path.basename(made)[1:])
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH, 1, _LIVE)
        _reserve(fd, SIZE)
        _write(fd, data)
        os.rename(made, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(made)
        raise
    return fd, path


def _warn_in_memory(failures: list[str]) -> None:
    global _warned
    if _warned == os.getpid():
        return
    _warned = os.getpid()
    _log.warning(
        "no directory can hold a RemoteLoader's ledger file (%s), so this process keeps its "
        "loaders' positions in memory, not shared with their DataLoader workers. The training "
        "process does not see the passes that DataLoader workers run: a loader iterated in "
        "DataLoader workers repeats one epoch unless each epoch is set with "
        "loader.set_epoch(epoch) (persistent_workers=True advance on their own and miss later "
        "set_epoch calls). To share it, free space in /dev/shm or give the container a larger "
        "shm_size (docker run --shm-size, Compose shm_size), or set TMPDIR to a writable "
        "directory",
        "; ".join(failures),
    )


class _Held:
    """A process's descriptor of a ledger's file: ``fd`` (-1: none yet, or in memory),
    open in process ``pid``; closed when its ledger goes."""

    __slots__ = ("fd", "pid")

    def __init__(self, fd: int, pid: int) -> None:
        self.fd, self.pid = fd, pid


def _remove(path: str | None, owner: int, held: _Held) -> None:
    # Finalizers are inherited by forked children: each closes only its own descriptor,
    # and only the creator removes the file.
    if held.fd >= 0 and held.pid == os.getpid():
        with contextlib.suppress(OSError):
            os.close(held.fd)
        held.fd = -1
    if path is not None and os.getpid() == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class Ledger(Generic[R]):
    """An entry shared between a loader and its DataLoader workers; see the module.

    ``_path`` is the file (None: the entry is in memory, ``_snapshot`` itself);
    ``_snapshot``, the bytes a copy carried; ``_held``, this process's descriptor of the
    file, closed with the file's removal when the ledger is collected or closed.
    """

    def __init__(self, initial: R) -> None:
        data = initial.pack()
        if len(data) != SIZE:
            raise ValueError(f"a ledger holds an entry of {SIZE} bytes, not {len(data)}")
        self._kind = type(initial)
        self._create(data)
        _ledgers.add(self)

    def _create(self, initial: bytes) -> None:
        directories, missing = _directories()
        failures: list[str] = []
        fd, self._path = -1, None
        for directory in directories:
            if directory not in _swept:
                _swept.add(directory)
                with contextlib.suppress(OSError):
                    _sweep(directory)
            try:
                fd, self._path = _make_file(directory, initial)
                break
            except OSError as exc:
                failures.append(f"{directory}: {exc.strerror or exc}")
        else:
            _warn_in_memory(failures + missing)
        self._snapshot = initial
        self._owner = os.getpid()
        self._held = _Held(fd, self._owner)
        self._finalizer = weakref.finalize(self, _remove, self._path, self._owner, self._held)

    def _handle(self) -> int:
        """This process's descriptor (flock needs one per process: fork shares them),
        or -1 for a ledger in memory."""
        held = self._held
        if held.pid == os.getpid():
            return held.fd
        if torch.utils.data.get_worker_info() is None:
            # Not a DataLoader worker of the owner: continue on a ledger of our own.
            self._create(self._read_from_path())
            return self._held.fd
        if self._path is None:
            # A worker of a loader whose ledger is in memory runs on its own copy, the
            # values it forked with or was pickled with; nobody else sees it.
            held.fd, held.pid = -1, os.getpid()
            return held.fd
        try:
            held.fd = os.open(self._path, os.O_RDWR)
        except FileNotFoundError:
            raise RuntimeError(
                "the RemoteLoader this DataLoader worker copied was closed in the training "
                "process; close() the loader only after its DataLoader is done"
            ) from None
        held.pid = os.getpid()
        return held.fd

    def _read_from_path(self) -> bytes:
        if self._path is None:
            return self._snapshot
        try:
            with open(self._path, "rb") as file:
                data = file.read(SIZE)
        except FileNotFoundError:
            return self._snapshot
        return data if len(data) == SIZE else self._snapshot

    @contextlib.contextmanager
    def update(self) -> Iterator[R]:
        """The entry, locked against the other processes; changes are written back."""
        fd = self._handle()
        if fd < 0:  # in memory: this process alone
            entry = self._kind.unpack(self._snapshot)
            yield entry
            self._snapshot = entry.pack()
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            before = os.pread(fd, SIZE, 0)
            entry = self._kind.unpack(before)
            yield entry
            after = entry.pack()
            if after != before:
                _write(fd, after)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def read(self) -> R:
        """A copy of the entry."""
        with self.update() as entry:
            return self._kind.unpack(entry.pack())

    def close(self) -> None:
        """Remove the file (in the process that created it); idempotent."""
        self._finalizer()

    def __getstate__(self) -> dict[str, Any]:
        # A pickled copy (spawned workers, spawned DDP ranks) carries the path and
        # the values, so that whichever way _handle goes, it has what it needs. Read
        # first: a copy this process never opened moves onto a ledger of its own there,
        # and its spawned workers must share that one, not the file it was copied from.
        # A ledger in memory has no path: a copy starts from its values.
        snapshot = self.read().pack()
        return {"path": self._path, "snapshot": snapshot, "kind": self._kind}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._kind = state["kind"]
        self._path = state["path"]
        self._snapshot = state["snapshot"]
        self._owner = -1
        self._held = _Held(-1, -1)
        # Not ours to remove; the descriptor this process opens for it is closed.
        self._finalizer = weakref.finalize(self, _remove, self._path, -1, self._held)
        _ledgers.add(self)
