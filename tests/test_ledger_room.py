"""A loader's ledger is made whatever room its process has, on real tmpfs mounts.

Each test runs a trainer's code in a process of its own whose ``/dev/shm`` is a tiny tmpfs
(``namespaces.run_python``): full as Docker's 64 MiB after DataLoader workers used it, out
of inodes, or read-only. The ledger then goes to the temporary directory, shared with the
DataLoader workers as before; where that fails too, it is kept in memory with one warning.

A DataLoader with workers cannot start in a full or read-only ``/dev/shm`` at all:
multiprocessing's queues take POSIX semaphores there (``sem_open``: ENOSPC, EROFS), a page
each. So the scripts make their ledgers in the state under test, then give ``/dev/shm``
room (remount it writable and larger, as a larger ``shm_size`` would) before they start
one: the ledgers made before stay where they were made.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct
import sys
from collections.abc import Iterator

import pytest
import torch.utils.data
from namespaces import State, run_python

import batchwire
from batchwire.client._ledger import SIZE, Ledger

PREFIX = "batchwire-loader-"


@dataclasses.dataclass
class Counts:
    """An entry for the ledgers under test: an epoch and a cursor, in the ledger's bytes."""

    epoch: int = 0
    cursor: int = 0

    def pack(self) -> bytes:
        return struct.pack("<2q", self.epoch, self.cursor).ljust(SIZE, b"\0")

    @classmethod
    def unpack(cls, data: bytes) -> Counts:
        return cls(*struct.unpack_from("<2q", data))


class Bump(torch.utils.data.IterableDataset[tuple[int, int, int]]):
    """A DataLoader worker's pass: it adds 1 to the ledger's cursor and yields its worker
    id, the epoch it read and the cursor it wrote."""

    def __init__(self, ledger: Ledger[Counts]) -> None:
        self.ledger = ledger

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        info = torch.utils.data.get_worker_info()
        assert info is not None, "Bump runs in DataLoader workers"
        with self.ledger.update() as entry:
            entry.cursor += 1
            seen = (info.id, entry.epoch, entry.cursor)
        yield seen


# Run by the trainer process: argv[1] is the DataLoader workers' multiprocessing context,
# argv[2] "persistent" or "" (spawned workers: each spawn imports torch, seconds of CPU).
# It prints a JSON report of what it saw.
_TRAINER = """
import json, logging, os, subprocess, sys, tempfile
import torch.utils.data
from batchwire.client._ledger import Ledger
from test_ledger_room import Bump, Counts

logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
report = {"pid": os.getpid()}
ledger = Ledger(Counts(epoch=2))
report["shm"] = sorted(os.listdir("/dev/shm"))
with ledger.update() as entry:
    entry.epoch = 3
report["read"] = [ledger.read().epoch, ledger.read().cursor]
CHECKS
room = "remount,rw,size=16m,nr_inodes=4096"
subprocess.run(["mount", "-o", room, "/dev/shm"], check=True)
data = torch.utils.data.DataLoader(
    Bump(ledger),
    batch_size=None,
    num_workers=2,
    multiprocessing_context=sys.argv[1],
    persistent_workers=sys.argv[2] == "persistent",
)
report["passes"] = []
for epoch in (3, 4):
    with ledger.update() as entry:  # as set_epoch does
        entry.epoch = epoch
    report["passes"].append([sorted(map(list, data)), ledger.read().cursor])
report["after"] = [name for name in os.listdir("/dev/shm") if name.startswith("batchwire")]
print(json.dumps(report))
"""

# A killed process's ledger file (nobody holds its lock): the next ledger made in the
# same directory removes it. Empty, so that it fits in a full tmpfs that has inodes left.
_PLANT_IN_SHM = """
try:
    open("/dev/shm/batchwire-loader-1-killed", "x").close()
except OSError:
    pass  # no inode left
"""
_LIST_THE_TEMPORARY_DIRECTORY = """
report["tmp"] = sorted(os.listdir(tempfile.gettempdir()))
"""


WORKERS = {"fork": ("fork", ""), "spawn-persistent": ("spawn", "persistent")}
TIMEOUT = 240  # seconds: a process importing torch, spawned workers too, on a busy host


@pytest.mark.parametrize(
    ("shm", "workers"), [("full", "fork"), ("full", "spawn-persistent"), ("no-inodes", "fork")]
)
def test_a_full_dev_shm_puts_the_ledger_in_the_temporary_directory_shared_with_workers(
    tmp_path: pathlib.Path, shm: State, workers: str
) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    (tmpdir / f"{PREFIX}1-killed").write_bytes(bytes(72))
    script = _TRAINER.replace("CHECKS", _LIST_THE_TEMPORARY_DIRECTORY)
    done = run_python(
        _PLANT_IN_SHM + script,
        *WORKERS[workers],
        shm=shm,
        env={"TMPDIR": str(tmpdir)},
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    # Nothing of the ledger's in /dev/shm, and the killed process's file swept from it,
    # though full (where it had an inode for that file).
    assert report["shm"] == ([".filler"] if shm == "full" else [])
    (own,) = report["tmp"]  # the killed process's file swept from here too
    assert own.startswith(f"{PREFIX}{report['pid']}-")
    assert report["read"] == [3, 0]
    # Both workers' updates reach the training process, and its updates the workers.
    for (seen, cursor), epoch, cursors in zip(
        report["passes"], (3, 4), ([1, 2], [3, 4]), strict=True
    ):
        assert [worker for worker, _, _ in seen] == [0, 1]
        assert {read for _, read, _ in seen} == {epoch}
        assert sorted(wrote for _, _, wrote in seen) == cursors and cursor == cursors[-1]
    assert report["after"] == []  # the workers opened the file in the temporary directory
    assert list(tmpdir.iterdir()) == []  # removed at its normal exit


def _hidden(covered: list[str]) -> str | None:
    """A directory the test needs that mounts on ``covered`` would hide."""
    needed = [sys.executable, sys.prefix, batchwire.__file__, __file__]
    for path in (os.path.realpath(p) for p in needed):
        for directory in covered:
            if path.startswith(os.path.realpath(directory) + os.sep):
                return path
    return None


@pytest.mark.slow
@pytest.mark.parametrize("workers", sorted(WORKERS))
def test_with_no_room_anywhere_the_ledger_is_this_process_alone_with_one_warning(
    workers: str,
) -> None:
    # Every directory tempfile.gettempdir() tries: TMPDIR, /tmp, /var/tmp, /usr/tmp and
    # the working directory (the read-only /dev/shm here).
    covered = [d for d in ("/tmp", "/var/tmp", "/usr/tmp") if os.path.isdir(d)]
    hidden = _hidden(covered)
    if hidden is not None:
        pytest.skip(f"the test covers {covered} with tmpfs mounts, which would hide {hidden}")
    kinds: list[State] = ["full", "no-inodes", "read-only"]
    states = dict(zip(covered, kinds, strict=False))
    copies = """
report["tmp"] = sorted(os.listdir("/tmp"))
copy = __import__("pickle").loads(__import__("pickle").dumps(ledger))
with copy.update() as entry:  # a copy has a ledger of its own, and no second warning
    entry.epoch = 9
report["copy"] = [copy.read().epoch, ledger.read().epoch, Ledger(Counts()).read().epoch]
"""
    done = run_python(
        _TRAINER.replace("CHECKS", copies),
        *WORKERS[workers],
        shm="read-only",
        tmpfs=states,
        env={"TMPDIR": "/tmp", "TEMP": "/tmp", "TMP": "/tmp"},
        cwd="/dev/shm",
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, done.stderr
    (warning,) = warnings
    for said in (
        "batchwire.client._ledger",
        "/dev/shm: Read-only file system",  # what failed
        "No usable temporary directory",
        "DataLoader workers",  # what it means
        "set_epoch",
        "shm_size",  # what to do
        "TMPDIR",
    ):
        assert said in warning, warning
    report = json.loads(done.stdout)
    assert report["shm"] == [] and report["tmp"] == [".filler"]
    assert report["read"] == [3, 0]  # it works in this process
    assert report["copy"] == [9, 3, 0]
    # Each worker runs on a copy of the training process's entry, which never sees the
    # copy's update: the cursor stays 0. Workers made anew for each pass copy the epoch
    # set before it; persistent ones go on from their first copy, and miss the second.
    fork = workers == "fork"
    expected = [[[0, 3, 1], [1, 3, 1]], [[0, 4, 1], [1, 4, 1]] if fork else [[0, 3, 2], [1, 3, 2]]]
    assert report["passes"] == [[seen, 0] for seen in expected]
    assert report["after"] == []  # nor did they make a file once /dev/shm had room


NOBODY = 65534

_AS_ANOTHER_USER = """
import json, logging, os, tempfile
from batchwire.client._ledger import Ledger
from batchwire.client._state import Entry, Place

logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
ledger = Ledger(Entry())
with ledger.update() as entry:
    entry.place = Place(5)
tmp = tempfile.gettempdir()
owners = {name: os.stat(os.path.join(tmp, name)).st_uid for name in os.listdir(tmp)}
report = {"uid": os.getuid(), "pid": os.getpid(), "tmp": tmp, "owners": owners}
print(json.dumps({**report, "shm": os.listdir("/dev/shm"), "epoch": ledger.read().place.epoch}))
"""


def test_a_dev_shm_this_user_may_not_write_in_puts_the_ledger_in_the_temporary_directory() -> None:
    hidden = _hidden(["/tmp"])
    if hidden is not None:
        pytest.skip(f"the test covers /tmp with a tmpfs mount, which would hide {hidden}")
    done = run_python(
        _AS_ANOTHER_USER,
        shm="root-only",  # EACCES for the trainer's user
        tmpfs={"/tmp": "empty"},
        uid=NOBODY,
        env={"TMPDIR": "/tmp"},
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    ((name, owner),) = report.pop("owners").items()  # the ledger, this user's
    assert name.startswith(f"{PREFIX}{report['pid']}-") and owner == NOBODY
    assert report == {"uid": NOBODY, "pid": report["pid"], "tmp": "/tmp", "shm": [], "epoch": 5}


def test_an_entry_keeps_the_ledgers_byte_layout() -> None:
    """A loader and its DataLoader workers read one entry's bytes, as every release wrote
    them: version, epoch, cursor, fresh, pass_id, in_workers, origin, world, batch."""
    from batchwire.client._state import Entry, Place

    entry = Entry(Place(2, origin=3, cursor=4, world=5, batch=6), False, 7, True)
    data = struct.pack("<9q", 1, 2, 4, 0, 7, 1, 3, 5, 6)
    assert len(data) == SIZE
    assert entry.pack() == data and Entry.unpack(data) == entry


def ledger_descriptors() -> int:
    """Descriptors this process holds of ledger files (removed ones included)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += PREFIX in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
    return held


def test_a_process_that_makes_loader_after_loader_keeps_no_descriptor_of_theirs(
    data_dir: pathlib.Path,
) -> None:
    """A sweep, a notebook or an evaluation job makes a loader, drops it and makes
    another: each loader's ledger file, and this process's descriptor of it, goes with
    it, so that a long process never runs out of descriptors."""
    import gc

    from batchwire.client import RemoteLoader

    before = ledger_descriptors()
    for _ in range(50):
        loader = RemoteLoader("localhost:1", dataset="shapes", pipeline="val", batch_size=8)
        assert ledger_descriptors() == before + 1
        del loader
        gc.collect()
    assert ledger_descriptors() == before
    ledger = Ledger(Counts(epoch=1))
    ledger.close()
    assert ledger_descriptors() == before
    assert ledger.read() == Counts(epoch=1)  # a closed ledger reads on in memory
