"""LMDB environments of datasets, each opened once per process, and a record copied out of
one with the interpreter lock released."""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading

import lmdb
import numpy as np

from batchwire.server.errors import DatasetError

__all__ = ["ENVIRONMENTS", "copied"]


class _SharedEnvironments:
    """LMDB forbids opening one environment twice in a process, so every
    Dataset over the same shard (two servers in one process, a test beside a
    server) shares one read-only handle, closed with its last user.

    A shard is known by its path and its ``data.mdb``'s inode: a dataset replaced
    under the same path has new files, which must not be read through the old
    handle (still open for the streams of the old version).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, tuple[lmdb.Environment, int]] = {}

    def acquire(self, path: pathlib.Path) -> lmdb.Environment:
        try:
            stat = (path / "data.mdb").stat()
        except OSError:
            stat = None
        if stat is None or not (path / "data.mdb").is_file():
            raise DatasetError(f"shard {path} has no data.mdb: the dataset is incomplete")
        real = os.path.realpath(path)
        key = f"{real}@{stat.st_dev}:{stat.st_ino}"
        with self._lock:
            env, users = self._open.get(key, (None, 0))
            if env is None:
                try:
                    # lock=False: datasets are immutable once ingested, so readers
                    # need no lock file (and the volume may be mounted read-only).
                    env = lmdb.open(
                        real,
                        readonly=True,
                        lock=False,
                        readahead=False,
                        meminit=False,
                        max_readers=512,
                    )
                except lmdb.Error as exc:
                    raise DatasetError(f"cannot open LMDB shard {path}: {exc}") from exc
            self._open[key] = (env, users + 1)
            return env

    def release(self, env: lmdb.Environment) -> None:
        with self._lock:
            for key, (known, users) in list(self._open.items()):
                if known is env:
                    if users > 1:
                        self._open[key] = (known, users - 1)
                    else:
                        del self._open[key]
                        env.close()
                    return


ENVIRONMENTS = _SharedEnvironments()


def copied(value: memoryview) -> bytearray:
    """The bytes of a record in the LMDB map, copied with the interpreter lock released
    (ctypes drops it): where the record's pages are not in memory yet, the disk is waited
    for while the server's other threads, its read-ahead's among them, run on."""
    copy = bytearray(len(value))
    if copy:
        source = np.frombuffer(value, dtype=np.uint8).ctypes.data
        ctypes.memmove((ctypes.c_char * len(copy)).from_buffer(copy), source, len(copy))
    return copy
