"""Where each record of an LMDB shard lies in its ``data.mdb``, read from the B-tree's pages.

For reading records by file offset: the server reads a batch's records with one ``pread``
each, straight into the batch's buffer (:meth:`Dataset.read`), and its read-ahead
(:mod:`batchwire.server.data.records._readahead`) asks the kernel for them before that. Looking a
record up through py-lmdb cannot give either: ``Transaction.get`` reads the whole value in
(a page at a time, the map being opened without the kernel's read-ahead, holding the
interpreter lock) before it returns. So the shard's branch and leaf pages (a few hundred for
ten thousand images) are read here with ``pread``, once, and each record is located: in the
overflow pages whose first page number its leaf node holds, or, for a value small enough,
in the leaf node itself.

This reads LMDB's on-disk format (``MDB_VERSION`` 1, as liblmdb 0.9 writes it) for a plain
database of unique keys, as ingest writes; a file in any other shape gives ``None`` (no
index: the records are then read when their batch is, as without read-ahead).
"""

from __future__ import annotations

import logging
import os
import struct

import numpy as np

__all__ = ["ShardIndex", "index_shard", "last_commit"]

log = logging.getLogger(__name__)

_MAGIC = 0xBEEFC0DE
_HEADER = 16  # PAGEHDRSZ: pgno (8), pad (2), flags (2), lower (2), upper (2)
_BRANCH, _LEAF, _OVERFLOW, _LEAF2, _SUBP = 0x01, 0x02, 0x04, 0x20, 0x40
_BIGDATA = 0x01  # a leaf node whose value lives in overflow pages
_MAIN_DB = _HEADER + 4 + 4 + 8 + 8 + 48  # MDB_meta: magic, version, address, mapsize, dbs[0]
_LAST_PAGE = _HEADER + 4 + 4 + 8 + 8 + 2 * 48
_MAX_PAGES = 1 << 24  # a walk over more branch and leaf pages than this is not a shard's


class ShardIndex:
    """Byte offsets and lengths in ``data.mdb`` of the values of ids ``first_id + i``
    (length 0: no such record), as of the file's transaction ``commit``."""

    def __init__(
        self,
        first_id: int,
        offsets: np.ndarray,
        lengths: np.ndarray,
        *,
        page_size: int = 4096,
        commit: int = 0,
    ) -> None:
        self.first_id = first_id
        self.offsets = offsets
        self.lengths = lengths
        self.page_size = page_size
        self.commit = commit

    def span(self, sample_id: int) -> tuple[int, int]:
        i = sample_id - self.first_id
        if not 0 <= i < len(self.lengths):
            return 0, 0
        return int(self.offsets[i]), int(self.lengths[i])

    def spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`span` of each of ``ids`` at once: (offsets, lengths), length 0 where
        the index does not know the id."""
        at = ids - self.first_id
        known = (at >= 0) & (at < len(self.lengths))
        at = np.where(known, at, 0)
        return self.offsets[at], np.where(known, self.lengths[at], 0)


def index_shard(fd: int, first_id: int, count: int) -> ShardIndex | None:
    """The index of the shard open as ``fd`` holding ids ``[first_id, first_id + count)``;
    None if the file is not an LMDB of the shape ingest writes."""
    try:
        return _index(fd, first_id, count)
    except (OSError, ValueError, struct.error, RecursionError) as exc:
        log.warning(
            "cannot index LMDB shard for read-ahead (%s); its records are read without it", exc
        )
        return None


def last_commit(fd: int, page_size: int) -> int:
    """The id of the last transaction committed to the LMDB file ``fd`` (the newer of its
    two meta pages'): a write to the shard since it was indexed (anything but rot in place)
    moves records, and this number, on."""
    at = _LAST_PAGE + 8  # each meta page's mm_txnid; the two read in one pread
    both = os.pread(fd, page_size + 8, at).ljust(page_size + 8, b"\0")
    return max(struct.unpack_from("<Q", both, 0)[0], struct.unpack_from("<Q", both, page_size)[0])


def _index(fd: int, first_id: int, count: int) -> ShardIndex | None:
    page_size, root, commit = _root(fd)
    offsets = np.zeros(count, dtype=np.int64)
    lengths = np.zeros(count, dtype=np.int64)
    pending, visited = [root], 0
    while pending:
        pgno = pending.pop()
        visited += 1
        if visited > _MAX_PAGES:
            raise ValueError("the B-tree has more pages than a shard can")
        page = os.pread(fd, page_size, pgno * page_size)
        _pgno, _pad, flags, lower, _upper = struct.unpack_from("<QHHHH", page)
        if len(page) < page_size or flags & (_LEAF2 | _SUBP | _OVERFLOW):
            raise ValueError(f"page {pgno} is not a plain branch or leaf page")
        nodes = struct.unpack_from(f"<{(lower - _HEADER) // 2}H", page, _HEADER)
        for at in nodes:
            lo, hi, node_flags, key_size = struct.unpack_from("<HHHH", page, at)
            if flags & _BRANCH:
                pending.append(lo | hi << 16 | node_flags << 32)
            elif flags & _LEAF:
                key = page[at + 8 : at + 8 + key_size]
                i = int(key) - first_id if key.isdigit() else -1
                if not 0 <= i < count:
                    continue
                value = at + 8 + key_size  # where the node's value (or its page number) is
                length = lo | hi << 16
                if node_flags & ~_BIGDATA:  # a sub-database or duplicates: not ingest's
                    raise ValueError(f"a node in page {pgno} has flags {node_flags:#x}")
                if node_flags & _BIGDATA:
                    (value_page,) = struct.unpack_from("<Q", page, value)
                    offsets[i] = value_page * page_size + _HEADER
                elif value + length <= page_size:
                    offsets[i] = pgno * page_size + value
                else:
                    raise ValueError(f"a value in page {pgno} runs past the page's end")
                lengths[i] = length
    return ShardIndex(first_id, offsets, lengths, page_size=page_size, commit=commit)


def _root(fd: int) -> tuple[int, int, int]:
    """(page size, root page of the main database, transaction id) from the newer of the
    two meta pages."""
    first = os.pread(fd, 4096, 0)
    magic, version = struct.unpack_from("<II", first, _HEADER)
    if magic != _MAGIC or version != 1:
        raise ValueError("not an LMDB data file of format version 1")
    # LMDB keeps the page size in the free database's md_pad field (mm_psize).
    (page_size,) = struct.unpack_from("<I", first, _HEADER + 4 + 4 + 8 + 8)
    if page_size < 512 or page_size & (page_size - 1):
        raise ValueError(f"page size {page_size} is not a power of two")
    metas = [first[:page_size], os.pread(fd, page_size, page_size)]
    newest = max(metas, key=lambda meta: struct.unpack_from("<Q", meta, _LAST_PAGE + 8)[0])
    (root,) = struct.unpack_from("<Q", newest, _MAIN_DB + 40)
    if root == 0xFFFFFFFFFFFFFFFF:
        raise ValueError("the main database is empty")
    return page_size, root, struct.unpack_from("<Q", newest, _LAST_PAGE + 8)[0]
