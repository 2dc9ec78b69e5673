"""Shards of a new dataset: records with consecutive ids appended to LMDB directories."""

from __future__ import annotations

import logging
import pathlib

import lmdb

from batchwire.server.data.records import Shard, sample_key

__all__ = ["ShardWriter"]

logger = logging.getLogger(__name__)

# Records are buffered and committed in bounded transactions.
_COMMIT_RECORDS = 1024
_COMMIT_BYTES = 64 << 20
# Initial LMDB map size per shard; doubled whenever a shard outgrows it.
_MAP_SIZE = 16 << 30


class ShardWriter:
    """Appends records with consecutive ids to ``shard-NNNNN`` LMDB directories."""

    def __init__(self, root: pathlib.Path, shard_size: int) -> None:
        self._root = root
        self._shard_size = shard_size
        self._shards: list[Shard] = []
        self._env: lmdb.Environment | None = None
        self._first_id = 0
        self._count = 0
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0

    def add(self, value: bytes) -> None:
        if self._env is None or self._count == self._shard_size:
            self._finish_shard()
            self._open_shard()
        self._pending.append((sample_key(self._first_id + self._count), value))
        self._pending_bytes += len(value)
        self._count += 1
        if len(self._pending) >= _COMMIT_RECORDS or self._pending_bytes >= _COMMIT_BYTES:
            self._commit()

    def close(self) -> list[Shard]:
        """Commit, sync and close the last shard; the shards written, in id order."""
        self._finish_shard()
        return list(self._shards)

    def abort(self) -> None:
        """Close without committing what is pending (the caller discards the directory)."""
        if self._env is not None:
            self._env.close()
            self._env = None

    def _open_shard(self) -> None:
        path = self._root / f"shard-{len(self._shards):05d}"
        # subdir=True: DALI's caffe reader opens only environment directories.
        # The directory is private until published, so no lock file and no
        # per-commit fsync; the shard is synced once when complete.
        self._env = lmdb.open(
            str(path),
            subdir=True,
            map_size=_MAP_SIZE,
            lock=False,
            sync=False,
            metasync=False,
            meminit=False,
            readahead=False,
        )

    def _finish_shard(self) -> None:
        if self._env is None:
            return
        self._commit()
        self._env.sync(True)
        self._env.close()
        self._env = None
        name = f"shard-{len(self._shards):05d}"
        self._shards.append(Shard(path=name, first_id=self._first_id, count=self._count))
        self._first_id += self._count
        self._count = 0

    def _commit(self) -> None:
        assert self._env is not None
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value, append=True)
                break
            except lmdb.MapFullError:
                grown = self._env.info()["map_size"] * 2
                logger.debug("growing LMDB map to %d bytes", grown)
                self._env.set_mapsize(grown)
        self._pending.clear()
        self._pending_bytes = 0
