"""Datasets on disk: ingest image folders or existing LMDBs, open a dataset, read its manifest.

The data layer of the server, usable on its own (a data engineer's machine, a
build job): it needs LMDB, Pillow and DALI's CPU decoder, and never loads grpc::

    from batchwire.server.data import Dataset, ingest, read_manifest

    report = ingest("images/", "data/", name="pets")   # class folders -> data/pets/
    manifest = read_manifest("data/pets")              # its manifest.json, checked
    with Dataset("data/pets") as dataset:
        images, labels = dataset.read([0, 1, 2])       # encoded bytes and labels
        fields = dataset.fields([0, 1, 2])             # named fields: boxes, captions, ...

Two subpackages, gathered here for scripts: :mod:`batchwire.server.data.ingestion`, the
offline tool that writes datasets, and :mod:`batchwire.server.data.records`, a dataset's
records as a server reads them. The server's own code imports the subpackage it needs.
:class:`DatasetError`, what a dataset that cannot be read raises, is
:mod:`batchwire.server.errors`'s, exported here for scripts.
"""

from __future__ import annotations

from batchwire.server.data.ingestion import (
    BACKGROUND,
    BOX_COLOURS,
    DEFAULT_SHARD_SIZE,
    FORMATS,
    SHAPES,
    DatasetSummary,
    IngestError,
    IngestReport,
    ShardSummary,
    UnsafePickle,
    ingest,
    safe_loads,
    summarize,
    write_coco_boxes,
    write_coco_masks,
    write_image_folders,
    write_photo_folders,
)
from batchwire.server.data.records import (
    BOX_FORMAT,
    CLASS_FORMAT,
    MANIFEST,
    NAME_PATTERN,
    Dataset,
    FieldSpec,
    FieldValue,
    Manifest,
    ReadAhead,
    ReadAheadStats,
    Shard,
    StreamReadAhead,
    decode_fields,
    encode_fields,
    manifest_version,
    read_manifest,
    sample_key,
    unsupported_reason,
)
from batchwire.server.errors import DatasetError

__all__ = [
    "BACKGROUND",
    "BOX_COLOURS",
    "BOX_FORMAT",
    "CLASS_FORMAT",
    "DEFAULT_SHARD_SIZE",
    "FORMATS",
    "MANIFEST",
    "NAME_PATTERN",
    "SHAPES",
    "Dataset",
    "DatasetError",
    "DatasetSummary",
    "FieldSpec",
    "FieldValue",
    "IngestError",
    "IngestReport",
    "Manifest",
    "ReadAhead",
    "ReadAheadStats",
    "Shard",
    "ShardSummary",
    "StreamReadAhead",
    "UnsafePickle",
    "decode_fields",
    "encode_fields",
    "ingest",
    "manifest_version",
    "read_manifest",
    "safe_loads",
    "sample_key",
    "summarize",
    "unsupported_reason",
    "write_coco_boxes",
    "write_coco_masks",
    "write_image_folders",
    "write_photo_folders",
]
