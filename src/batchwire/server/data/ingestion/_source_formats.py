"""Which kind of input an ingest source is, told from SRC or named by ``--format``, and the
sample sources of the formats whose samples carry fields.

- ``folder``: class folders (or a ``--file-list``): ``_file_sources``;
- ``lmdb``: an existing LMDB: ``_lmdb_sources``;
- ``coco``: a COCO ``.json`` (``images``, ``annotations``): ``_coco_source``;
- ``jsonl`` / ``csv``: a manifest of image paths and fields: ``_table_source``;
- ``webdataset``: a ``.tar`` shard, or a folder of them or of files grouped by key:
  ``_webdataset_source``.

Told from SRC: an LMDB by its contents; a file by its extension (``.json``, ``.jsonl``,
``.csv``, ``.tar``); a folder holding ``.tar`` shards or ``key.ext`` groups is a
WebDataset, any other folder class folders, as before fields existed.
"""

from __future__ import annotations

import pathlib

from batchwire.server.data.ingestion._coco_source import read_coco
from batchwire.server.data.ingestion._lmdb_sources import is_lmdb
from batchwire.server.data.ingestion._sample_source import SampleSource
from batchwire.server.data.ingestion._table_source import read_csv, read_jsonl
from batchwire.server.data.ingestion._webdataset_source import (
    is_webdataset_folder,
    read_webdataset,
)
from batchwire.server.errors import IngestError

__all__ = ["FIELD_FORMATS", "FORMATS", "detect_format", "open_sample_source"]

FIELD_FORMATS = ("coco", "jsonl", "csv", "webdataset")
FORMATS = ("folder", "lmdb", *FIELD_FORMATS)
_EXTENSIONS = {".json": "coco", ".jsonl": "jsonl", ".csv": "csv", ".tar": "webdataset"}


def detect_format(src: pathlib.Path) -> str | None:
    """The format of ``src`` (one of :data:`FORMATS`), or None where it is none of them
    (a path that does not exist, a file of another kind: the folder ingest says why)."""
    if not src.exists():
        return None
    if is_lmdb(src):
        return "lmdb"
    if src.is_file():
        return _EXTENSIONS.get(src.suffix.lower())
    try:
        return "webdataset" if is_webdataset_folder(src) else "folder"
    except OSError as exc:
        raise IngestError(f"cannot list {src}: {exc.strerror}") from exc


def open_sample_source(
    src: pathlib.Path, source_format: str, images: pathlib.Path | None, *, masks: bool = False
) -> SampleSource:
    """The samples of ``src`` in ``source_format`` (one of :data:`FIELD_FORMATS`); image
    paths of COCO and table manifests are relative to ``images`` (default: the file's
    folder); ``masks``: COCO instances' segmentations as a mask an image."""
    if source_format != "webdataset" and not src.is_file():
        raise IngestError(f"--format {source_format} reads a file, and {src} is not one")
    if masks and source_format != "coco":
        raise IngestError(f"--masks is for COCO instances, not {source_format} sources")
    images_dir = images if images is not None else src.parent
    if source_format == "coco":
        return read_coco(src, images_dir, masks=masks)
    if source_format == "jsonl":
        return read_jsonl(src, images_dir)
    if source_format == "csv":
        return read_csv(src, images_dir)
    return read_webdataset(src)
