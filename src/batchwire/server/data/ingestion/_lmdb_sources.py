"""Existing LMDBs as ingest sources: Caffe's ``convert_imageset`` output and pickled records.

``open_lmdb_source(SRC)`` recognises an LMDB (an environment directory holding
``data.mdb``, or a single LMDB file as written with ``subdir=False``) and
returns an :class:`LmdbSource` whose records ingest validates and copies into
batchwire shards, keeping every image's original bytes:

- **Caffe** (``convert_imageset``): keys such as ``00000001_path/to/img.jpg``,
  values Caffe ``Datum``. Encoded Datums keep their bytes. Raw-pixel Datums
  (``convert_imageset`` without ``--encoded``: BGR, CHW) are written as
  lossless PNG, the one case where bytes are made. Ids follow key order.
- **Pickled** (the layout common in LMDB tutorials for PyTorch): values
  ``pickle.dumps((image_bytes, label))``, plus ``__keys__`` (the pickled list
  of record keys, which gives the id order) and ``__len__``.
  Values are read with ``safe_loads``: a pickle that would import or call
  anything stops the ingest with ``LmdbSourceError`` naming the key, before
  any of it runs.

Records that are not usable (not a Datum, an empty image, a bad label) are
reported as ``Rejected`` (key, reason) and left out; the ingest goes on.
The source is opened read-only and never written. Never imports grpc.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pathlib
from collections.abc import Iterator

import lmdb

from batchwire.server.data.ingestion._batches import Rejected, bounded_batches
from batchwire.server.data.ingestion._safe_pickle import UnsafePickle, safe_loads
from batchwire.server.data.records import MAX_LABEL
from batchwire.server.errors import LmdbSourceError
from batchwire.v1 import datum_pb2

__all__ = ["LmdbSource", "LmdbSourceError", "SourceRecord", "is_lmdb", "open_lmdb_source"]

log = logging.getLogger(__name__)

# An LMDB file starts with a meta page: a 16-byte page header, then this magic
# (little-endian), the same on 32- and 64-bit builds.
_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")
_KEYS, _LEN = b"__keys__", b"__len__"


@dataclasses.dataclass(frozen=True, slots=True)
class SourceRecord:
    """One usable record: ``relpath`` is its key as text (for reports), ``label`` its class."""

    relpath: str
    label: int


def _is_lmdb_file(path: pathlib.Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    return len(head) == 20 and head[16:20] == _MAGIC


def is_lmdb(src: pathlib.Path) -> bool:
    """Whether ``src`` is an LMDB environment directory or a single-file LMDB."""
    if src.is_dir():
        return (src / "data.mdb").is_file() and _is_lmdb_file(src / "data.mdb")
    return src.is_file() and _is_lmdb_file(src)


def _text(key: bytes) -> str:
    return key.decode("utf-8", errors="backslashreplace")


class LmdbSource:
    """An existing LMDB to ingest; iterate ``batches()`` once, then ``close()``.

    ``kind`` is ``"caffe"`` or ``"pickle"``; ``total`` is the number of
    records (for progress); ``classes`` is None: labels are numbers, and the
    classes are ``"0"`` .. the largest label.
    """

    classes: tuple[str, ...] | None = None
    ignored: tuple[Rejected, ...] = ()

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        try:
            self._env = lmdb.open(
                str(path),
                subdir=path.is_dir(),
                readonly=True,
                lock=False,
                readahead=False,
                meminit=False,
            )
        except lmdb.Error as exc:
            raise LmdbSourceError(f"cannot open LMDB {path}: {exc}") from exc
        try:
            self.kind, self._keys = self._layout()
        except BaseException:
            self._env.close()
            raise
        if self._keys is not None:
            self.total = len(self._keys)
        else:
            with self._env.begin() as txn:
                entries = int(txn.stat()["entries"])
                special = sum(txn.get(k) is not None for k in (_KEYS, _LEN))
            self.total = entries - special

    def _layout(self) -> tuple[str, list[bytes] | None]:
        with self._env.begin() as txn:
            keys_value = txn.get(_KEYS)
            if keys_value is not None:
                return "pickle", self._key_list(keys_value, txn.get(_LEN))
            with txn.cursor() as cursor:
                first = next(
                    (value for key, value in cursor if key not in (_KEYS, _LEN)),
                    None,
                )
        if first is None:
            raise LmdbSourceError(f"LMDB {self.path} holds no records")
        if first[:1] == b"\x80":  # a pickle (protocol 2+) never starts like a Datum
            return "pickle", None
        if _datum(first) is None:
            raise LmdbSourceError(
                f"LMDB {self.path} is neither Caffe's format (Datum values, as "
                "convert_imageset writes) nor pickled (image bytes, label) records: "
                "ingest the original images instead"
            )
        return "caffe", None

    def _key_list(self, value: bytes, length: bytes | None) -> list[bytes]:
        try:
            keys = safe_loads(value)
        except UnsafePickle as exc:
            raise LmdbSourceError(_refused(self.path, _KEYS, exc)) from None
        if not isinstance(keys, list | tuple) or not all(isinstance(k, bytes | str) for k in keys):
            raise LmdbSourceError(
                f"LMDB {self.path}: __keys__ must be a pickled list of record keys (bytes or str)"
            )
        keys = [k.encode() if isinstance(k, str) else k for k in keys]
        if length is not None:
            try:
                count = safe_loads(length)
            except UnsafePickle as exc:
                raise LmdbSourceError(_refused(self.path, _LEN, exc)) from None
            if count != len(keys):
                log.warning(
                    "%s: __len__ says %r but __keys__ lists %d keys; using __keys__",
                    self.path,
                    count,
                    len(keys),
                )
        return keys

    def batches(
        self, batch_size: int
    ) -> Iterator[tuple[list[tuple[SourceRecord, bytes]], list[Rejected]]]:
        """Usable records with their encoded image, and those rejected, in id order.

        Batches hold at most ``batch_size`` records and about 8 MB of images.
        Raises ``LmdbSourceError`` for a pickle that would run code.
        """
        return bounded_batches(self._entries(), batch_size)

    def _entries(self) -> Iterator[tuple[SourceRecord, bytes] | Rejected]:
        for key, value in self._values():
            name = _text(key)
            if value is None:
                yield Rejected(name, "listed in __keys__ but not in the LMDB")
                continue
            try:
                item = self._parse(value) if self.kind == "caffe" else self._unpickle(key, value)
            except _Reject as reject:
                yield Rejected(name, str(reject))
                continue
            label, data = item
            yield SourceRecord(name, label), data

    def _values(self) -> Iterator[tuple[bytes, bytes | None]]:
        with self._env.begin() as txn:
            if self._keys is not None:
                for key in self._keys:
                    yield key, txn.get(key)
                return
            with txn.cursor() as cursor:
                for key, value in cursor:
                    if key not in (_KEYS, _LEN):
                        yield key, value

    def _parse(self, value: bytes) -> tuple[int, bytes]:
        datum = _datum(value)
        if datum is None:
            raise _Reject("not a Caffe Datum")
        label = _label(datum.label)
        if datum.encoded:
            if not datum.data:
                raise _Reject("empty image")
            return label, datum.data
        return label, _raw_to_png(datum)

    def _unpickle(self, key: bytes, value: bytes) -> tuple[int, bytes]:
        try:
            item = safe_loads(value)
        except UnsafePickle as exc:
            raise LmdbSourceError(_refused(self.path, key, exc)) from None
        if (
            not isinstance(item, tuple | list)
            or len(item) < 2
            or not isinstance(item[0], bytes | bytearray)
        ):
            raise _Reject(f"value is not (image bytes, label) but {_describe(item)}")
        if not isinstance(item[1], int) or isinstance(item[1], bool):
            raise _Reject(f"label is not an integer but {_describe(item[1])}")
        if not item[0]:
            raise _Reject("empty image")
        return _label(item[1]), bytes(item[0])

    def close(self) -> None:
        self._env.close()


class _Reject(Exception):
    """This record is left out, for the reason in the message."""


def _refused(path: pathlib.Path, key: bytes, exc: UnsafePickle) -> str:
    return (
        f"LMDB {path}: record {_text(key)!r} was refused, nothing was ingested: {exc}. "
        "batchwire only reads pickles of plain values (bytes, numbers, strings, tuples, "
        "lists, dicts) and never runs code from a dataset; re-write the records as "
        "pickle.dumps((image_bytes, int_label)) with protocol 3 or later, or ingest the "
        "original images"
    )


def _describe(value: object) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _label(label: int) -> int:
    if not 0 <= label <= MAX_LABEL:
        raise _Reject(f"label {label} is outside 0..{MAX_LABEL}")
    return label


def _datum(value: bytes) -> datum_pb2.Datum | None:
    datum = datum_pb2.Datum()
    try:
        datum.ParseFromString(value)
    except Exception:  # DecodeError or RuntimeError, by protobuf backend
        return None
    if not datum.data and not datum.float_data:
        return None
    return datum


def _raw_to_png(datum: datum_pb2.Datum) -> bytes:
    """A raw Caffe Datum (uint8 CHW, BGR) as lossless PNG bytes."""
    import numpy as np
    from PIL import Image

    channels, height, width = datum.channels, datum.height, datum.width
    if datum.float_data or not datum.data:
        raise _Reject("float_data Datum: not an image")
    if channels not in (1, 3) or height < 1 or width < 1:
        raise _Reject(
            f"raw Datum of shape {channels}x{height}x{width}: not a 1- or 3-channel image"
        )
    if len(datum.data) != channels * height * width:
        raise _Reject(f"raw Datum holds {len(datum.data)} bytes, not {channels}x{height}x{width}")
    pixels = np.frombuffer(datum.data, dtype=np.uint8).reshape(channels, height, width)
    if channels == 1:
        image = Image.fromarray(pixels[0])
    else:
        image = Image.fromarray(np.ascontiguousarray(pixels[::-1].transpose(1, 2, 0)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def open_lmdb_source(src: pathlib.Path) -> LmdbSource | None:
    """An :class:`LmdbSource` when ``src`` is an LMDB, else None (a folder of images)."""
    return LmdbSource(src) if is_lmdb(src) else None
