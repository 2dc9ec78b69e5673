"""Datasets on disk: a ``manifest.json`` plus LMDB shards of Caffe ``Datum`` records.

Layout of a dataset directory ``NAME/``::

    manifest.json
    shard-00000/data.mdb     (an LMDB environment directory, as Caffe writes)
    shard-00001/data.mdb
    ...

Global sample ids are ``0..N-1``. Shard ``i`` holds the ids
``[first_id, first_id + count)``; the record of id ``k`` is stored under the
key ``b"%010d" % k``, so the server finds a sample by id without scanning.
Values are ``Datum`` protobufs with ``encoded=true``, ``data`` = the original
encoded image bytes and ``label`` = the class index, which keeps every shard
readable by DALI's ``fn.readers.caffe`` and by Caffe tools. A record may also hold
named fields (``Datum.fields``: boxes, captions, a mask), which the manifest declares
(``_schema``) and :meth:`Dataset.fields` reads; :meth:`Dataset.read` never parses them.
The manifest, its checks and the version it names are ``_manifest.py``'s.

The server opens shards read-only and never writes to a dataset.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import pathlib
import threading
import time
from collections.abc import Collection, Sequence

import lmdb
import numpy as np

from batchwire.server.data.records._datum import datum_image
from batchwire.server.data.records._environments import ENVIRONMENTS, copied
from batchwire.server.data.records._fields import FieldValue, decode_fields
from batchwire.server.data.records._formats import ScreenedRecords
from batchwire.server.data.records._lmdb_index import ShardIndex, index_shard, last_commit
from batchwire.server.data.records._manifest import Manifest, manifest_bytes, manifest_version
from batchwire.server.errors import DatasetError

__all__ = ["MAX_LABEL", "Dataset", "sample_key"]

log = logging.getLogger(__name__)

MAX_LABEL = 2**31 - 1  # the largest class index: Datum.label is an int32


def sample_key(sample_id: int) -> bytes:
    """The LMDB key of a sample id: ten decimal digits, so keys sort by id."""
    return b"%010d" % sample_id


class Dataset:
    """Read-only access to a dataset's records by global id. Thread-safe.

    A Dataset reads the files it opened, whatever happens to its directory later: a
    dataset replaced by ``ingest --overwrite`` (its directory renamed away and removed)
    stays readable through an open Dataset, since the LMDB files stay mapped until
    :meth:`close`. ``version`` names the content (:func:`manifest_version`).
    """

    def __init__(self, directory: pathlib.Path | str) -> None:
        self.directory = pathlib.Path(directory)
        raw = manifest_bytes(self.directory)
        self.manifest = Manifest.from_json(raw.decode("utf-8", errors="replace"))
        self.version = manifest_version(raw)
        self._starts = [shard.first_id for shard in self.manifest.shards]
        self._envs: list[lmdb.Environment] = []
        self._files: list[int] = []  # each shard's data.mdb, for reading ahead (locate)
        self._indexes: dict[int, ShardIndex | None] = {}
        self._index_lock = threading.Lock()
        # Records read that were not all in the page cache (or where that cannot be told),
        # and the seconds each thread's reads waited for them (``waited``: what tells the
        # read-ahead whether a stream needs it).
        self.misses = 0
        self._waits = threading.local()
        # Which records passed the screen: this version's, so a new ingest starts afresh.
        self.screened = ScreenedRecords(self.manifest.num_samples)
        try:
            for shard in self.manifest.shards:
                self._envs.append(ENVIRONMENTS.acquire(self.directory / shard.path))
                self._files.append(_open_file(self.directory / shard.path / "data.mdb"))
            # An ingest --overwrite that swapped the directory while the shards were being
            # opened would leave this Dataset with the old manifest and new shards.
            if manifest_bytes(self.directory) != raw:
                raise DatasetError(
                    f"dataset {self.directory} changed while it was being opened; try again"
                )
        except DatasetError:
            self.close()
            raise

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def waited(self) -> float:
        """Seconds the calling thread's reads have waited for records the page cache did
        not hold (a thread's own: streams read in threads of their own)."""
        return getattr(self._waits, "seconds", 0.0)

    @property
    def num_samples(self) -> int:
        return self.manifest.num_samples

    @property
    def classes(self) -> tuple[str, ...]:
        return self.manifest.classes

    def read(self, ids: Sequence[int] | np.ndarray) -> tuple[list[np.ndarray | None], np.ndarray]:
        """Encoded images and labels of ``ids``, in order.

        An entry is ``None`` (and its label -1) where the record is missing or
        is not a readable ``Datum``: rot on disk is reported, never raised.
        The records are copied once, from the page cache into one buffer for the batch
        (a ``pread`` each, the interpreter lock released while the disk is waited for),
        and each image is a uint8 view of its bytes in that buffer. Records that were not
        in the page cache are counted in :attr:`misses`; the disk is asked for all of
        them at once (:func:`advise`) before the first is waited for, so that a batch's
        misses cost about one disk latency, not one each.
        """
        return _images(self._records(np.asarray(ids, dtype=np.int64)))

    def fields(self, ids: Sequence[int] | np.ndarray) -> list[dict[str, FieldValue]]:
        """The named fields of the records of ``ids``, in order: name → value as
        :func:`~batchwire.server.data.records.decode_fields` gives it (numpy arrays, str,
        bytes), an empty dict for a record without fields or one missing or not a
        ``Datum``. Read as :meth:`read` reads records; only this parses fields. Raises
        ``ValueError`` for fields damaged on disk."""
        return [decode_fields(record) for record in self._records(np.asarray(ids, np.int64))]

    def _records(self, ids: np.ndarray) -> list[memoryview]:
        """The bytes of the records of ``ids``, in order, each a view of one buffer for
        them all (empty where a record is missing); :meth:`read` says how they are read."""
        spans = self._spans(ids)
        buffer = np.empty(sum(length for _, _, length in spans), dtype=np.uint8)
        memory = memoryview(buffer)  # type: ignore[arg-type]  # an ndarray is a buffer
        records: list[memoryview] = []
        missed: list[tuple[int, int]] = []  # (record, bytes of it read) not all cached
        at = 0
        for i, (fd, offset, length) in enumerate(spans):
            if length:
                record = memory[at : at + length]
                got = _pread_cached(fd, record, offset)
                if got < length:
                    missed.append((i, got))
                at += length
            else:
                record = self._get(int(ids[i]))
            records.append(record)
        if missed:
            self.misses += len(missed)
            waiting = time.perf_counter()
            for i, got in missed:
                fd, offset, length = spans[i]
                advise(fd, offset + got, length - got)
            for i, got in missed:
                fd, offset, length = spans[i]
                record = records[i]
                if got + _pread_rest(fd, record[got:], offset + got) != length:
                    records[i] = record[:0]  # a file cut short since
            self._waits.seconds = self.waited + time.perf_counter() - waiting
        return records

    def read_screened(
        self, ids: np.ndarray
    ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[int]]:
        """The records of ``ids`` that may reach a decoder, as :meth:`read` reads them and
        screened (once per dataset version, :class:`ScreenedRecords`): their ids, encoded
        images and labels, in order, and the ids left out. This is the server's whole
        record path. Records that are missing, not a ``Datum`` or not a decodable image
        are left out and logged."""
        kept, images, labels, skipped, _ = self._read_screened(np.asarray(ids, np.int64), False)
        return kept, images, labels, skipped

    def read_screened_fields(
        self, ids: np.ndarray, names: Collection[str] | None = None
    ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[int], list[dict[str, FieldValue]]]:
        """:meth:`read_screened`, and each kept record's fields (:meth:`fields`; those of
        ``names`` only, where given) parsed from the same read: empty for a record whose
        fields are damaged (whoever needs them skips that sample)."""
        return self._read_screened(np.asarray(ids, np.int64), True, names)

    def _read_screened(
        self, ids: np.ndarray, with_fields: bool, names: Collection[str] | None = None
    ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[int], list[dict[str, FieldValue]]]:
        records = self._records(ids)
        images, labels = _images(records)
        found = [i for i, image in enumerate(images) if image is not None]
        present = [image for image in images if image is not None]
        screened = iter(self.screened.reasons(ids[found], present))
        reasons = [
            "missing or not a Datum" if image is None else next(screened) for image in images
        ]
        good, skipped = [], []
        for i, reason in enumerate(reasons):
            if reason is None:
                good.append(i)
                continue
            skipped.append(int(ids[i]))
            log.warning("dataset %r: skipping sample %d: %s", self.name, ids[i], reason)
        fields = [_fields_or_none(records[i], names) for i in good] if with_fields else []
        kept_images = [images[i] for i in good]
        return ids[good], kept_images, labels[good], skipped, fields  # type: ignore[return-value]

    def _check_index(self, shard: int) -> None:
        """Forget ``shard``'s index where the shard was written since it was made (its
        records moved): the next look-up makes it again. Rot in place moves nothing; the
        screen sees it (``ScreenedRecords``). The file's meta pages are read outside the
        lock: every batch's read checks each shard it touches."""
        index = self._indexes.get(shard)
        if index is None or not 0 <= shard < len(self._files):
            return
        if last_commit(self._files[shard], index.page_size) == index.commit:
            return
        with self._index_lock:
            if self._indexes.get(shard) is index:
                log.warning(
                    "dataset %r: shard %d was written since it was opened", self.name, shard
                )
                del self._indexes[shard]

    def _spans(self, ids: np.ndarray, *, check: bool = True) -> list[tuple[int, int, int]]:
        """(fd, offset, length) of each record of ``ids`` in its shard's file, looked up a
        shard at a time (with ``check``, from indexes checked to be current); length 0
        where the shard's index does not know it (its record is then read through LMDB)."""
        if len(ids) and not (ids.min() >= 0 and ids.max() < self.num_samples):
            bad = ids[(ids < 0) | (ids >= self.num_samples)][0]
            raise IndexError(f"sample id {bad} is outside 0..{self.num_samples - 1}")
        shards = np.searchsorted(self._starts, ids, side="right") - 1
        fds = np.full(len(ids), -1, dtype=np.int64)
        offsets = np.zeros(len(ids), dtype=np.int64)
        lengths = np.zeros(len(ids), dtype=np.int64)
        for shard in np.unique(shards).tolist():
            if check:
                self._check_index(shard)
            index = self._index(shard)
            if index is None:
                continue
            mine = shards == shard
            offsets[mine], lengths[mine] = index.spans(ids[mine])
            fds[mine] = self._files[shard]
        fds[lengths == 0] = -1
        return list(zip(fds.tolist(), offsets.tolist(), lengths.tolist(), strict=True))

    def _index(self, shard: int) -> ShardIndex | None:
        """``shard``'s index, made at its first use (None: not in ingest's shape). Taken
        without the lock once made: every batch's read and read-ahead looks its shards'
        up."""
        with contextlib.suppress(KeyError):
            return self._indexes[shard]
        with self._index_lock:
            if shard not in self._indexes:
                info = self.manifest.shards[shard]
                self._indexes[shard] = index_shard(self._files[shard], info.first_id, info.count)
            return self._indexes[shard]

    def _get(self, sample_id: int) -> memoryview:
        """A record's bytes read through LMDB (a shard not in ingest's shape), copied
        with the interpreter lock released; empty where the record is missing."""
        shard = bisect.bisect_right(self._starts, sample_id) - 1
        with self._envs[shard].begin(buffers=True) as txn:
            value = txn.get(sample_key(sample_id))
            return memoryview(b"" if value is None else copied(value))

    def locate(self, ids: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
        """Where the records of ``ids`` lie on disk, for reading them ahead
        (:mod:`batchwire.server.data.records._readahead`): (file descriptor of the shard's
        ``data.mdb``, byte offset, length) of each whose place the shard's index knows,
        in order; missing records and shards not in ingest's shape are left out. Reads no
        record (the first call for a shard reads its B-tree's pages), and does not check
        that the index is current: :meth:`read` does. The descriptors stay open until
        :meth:`close`."""
        spans = self._spans(np.asarray(ids, dtype=np.int64), check=False)
        return [span for span in spans if span[2]]

    def shard_entries(self) -> list[int]:
        """How many records each shard's LMDB holds, in shard order."""
        return [int(env.stat()["entries"]) for env in self._envs]

    def close(self) -> None:
        for env in self._envs:
            ENVIRONMENTS.release(env)
        self._envs.clear()
        for fd in self._files:
            os.close(fd)
        self._files.clear()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _open_file(path: pathlib.Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise DatasetError(f"cannot open {path}: {exc.strerror}") from exc


# Linux's RWF_NOWAIT: a read that fails rather than wait for pages not in the page cache.
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def advise(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to read ``length`` bytes of ``fd`` at ``offset`` into the page cache
    now (``POSIX_FADV_WILLNEED``: it queues the reads and returns). Best effort: a failure
    is ignored, the bytes are then read when they are read."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError as exc:
        log.debug("read-ahead of %d bytes at %d failed: %s", length, offset, exc)


def _pread_cached(fd: int, buffer: memoryview, offset: int) -> int:
    """Read what the page cache holds of ``buffer``'s length of ``fd`` at ``offset``,
    from its start, without waiting for the disk: the bytes read (0 where the system
    cannot tell what is cached: no RWF_NOWAIT)."""
    global _NOWAIT
    if not _NOWAIT:
        return 0
    try:
        return os.preadv(fd, [buffer], offset, _NOWAIT)
    except BlockingIOError:  # the first page is not in the page cache
        return 0
    except OSError:  # a file system or kernel without it: ask no more
        _NOWAIT = 0
        return 0


def _pread_rest(fd: int, buffer: memoryview, offset: int) -> int:
    """Read ``buffer``'s length of ``fd`` at ``offset``, waiting for the disk (the
    interpreter lock released meanwhile): the bytes read, fewer at the file's end."""
    got = 0
    while got < len(buffer):
        read = os.preadv(fd, [buffer[got:]], offset + got)
        if read == 0:
            break
        got += read
    return got


def _images(records: list[memoryview]) -> tuple[list[np.ndarray | None], np.ndarray]:
    """Each record's encoded image, a view of its bytes (None where it is not a Datum),
    and labels (-1 there)."""
    images: list[np.ndarray | None] = []
    labels = np.full(len(records), -1, dtype=np.int64)
    for i, record in enumerate(records):
        found = datum_image(record)
        if found is None:
            images.append(None)
            continue
        start, end, labels[i] = found
        images.append(np.frombuffer(record[start:end], dtype=np.uint8))
    return images, labels


def _fields_or_none(record: memoryview, names: Collection[str] | None) -> dict[str, FieldValue]:
    """A record's fields (of ``names``, where given); none where they are damaged (a
    malformed Fields message)."""
    try:
        return decode_fields(record, names)
    except ValueError:
        return {}
