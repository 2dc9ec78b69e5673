"""Datasets on disk: ingest image folders or existing LMDBs, open a dataset, read its manifest.

The data layer of the server, usable on its own (a data engineer's machine, a
build job): it needs LMDB, Pillow and DALI's CPU decoder, and never loads grpc::

    from batchwire.server.data import Dataset, ingest, read_manifest

    report = ingest("images/", "data/", name="pets")   # class folders -> data/pets/
    manifest = read_manifest("data/pets")              # its manifest.json, checked
    with Dataset("data/pets") as dataset:
        images, labels = dataset.read([0, 1, 2])       # encoded bytes and labels
"""

from __future__ import annotations

import pathlib

from batchwire.server.data._dataset import (
    MANIFEST,
    NAME_PATTERN,
    Dataset,
    DatasetError,
    Manifest,
    Shard,
    manifest_version,
    sample_key,
)
from batchwire.server.data._formats import unsupported_reason
from batchwire.server.data._ingest import DEFAULT_SHARD_SIZE, IngestError, IngestReport, ingest
from batchwire.server.data._inspect import DatasetSummary, ShardSummary, summarize
from batchwire.server.data._readahead import ReadAhead, ReadAheadStats, StreamReadAhead
from batchwire.server.data._safe_pickle import UnsafePickle, safe_loads
from batchwire.server.data._synthetic import SHAPES, write_image_folders, write_photo_folders


def read_manifest(directory: pathlib.Path | str) -> Manifest:
    """The checked ``manifest.json`` of the dataset in ``directory`` (``DatasetError`` if
    it is missing or malformed)."""
    return Manifest.load(pathlib.Path(directory))


__all__ = [
    "DEFAULT_SHARD_SIZE",
    "MANIFEST",
    "NAME_PATTERN",
    "SHAPES",
    "Dataset",
    "DatasetError",
    "DatasetSummary",
    "IngestError",
    "IngestReport",
    "Manifest",
    "ReadAhead",
    "ReadAheadStats",
    "Shard",
    "ShardSummary",
    "StreamReadAhead",
    "UnsafePickle",
    "ingest",
    "manifest_version",
    "read_manifest",
    "safe_loads",
    "sample_key",
    "summarize",
    "unsupported_reason",
    "write_image_folders",
    "write_photo_folders",
]
