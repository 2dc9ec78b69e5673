"""Records: a dataset as it lies on disk (LMDB shards and a manifest) and the one path its
records take while a server serves it: located by offset from each shard's B-tree index,
read with one ``pread`` each (read ahead while reads wait for the disk), and screened once
per dataset version before any reaches a decoder. Needs LMDB; never loads grpc::

    from batchwire.server.data.records import Dataset

    with Dataset("data/pets") as dataset:
        images, labels = dataset.read([0, 1, 2])       # encoded bytes and labels
        fields = dataset.fields([0, 1, 2])             # name -> array, str or bytes
"""

from __future__ import annotations

import pathlib

from batchwire.server.data.records._dataset import MAX_LABEL, Dataset, sample_key
from batchwire.server.data.records._fields import (
    FieldValue,
    decode_fields,
    encode_field,
    encode_fields,
)
from batchwire.server.data.records._formats import unsupported_reason
from batchwire.server.data.records._manifest import (
    MANIFEST,
    NAME_PATTERN,
    Manifest,
    Shard,
    manifest_version,
)
from batchwire.server.data.records._mixed import MixedDataset, Records
from batchwire.server.data.records._readahead import ReadAhead, ReadAheadStats, StreamReadAhead
from batchwire.server.data.records._schema import BOX_FORMAT, CLASS_FORMAT, DTYPES, FieldSpec


def read_manifest(directory: pathlib.Path | str) -> Manifest:
    """The checked ``manifest.json`` of the dataset in ``directory``
    (:class:`~batchwire.server.errors.DatasetError` if it is missing or malformed)."""
    return Manifest.load(pathlib.Path(directory))


__all__ = [
    "BOX_FORMAT",
    "CLASS_FORMAT",
    "DTYPES",
    "MANIFEST",
    "MAX_LABEL",
    "NAME_PATTERN",
    "Dataset",
    "FieldSpec",
    "FieldValue",
    "Manifest",
    "MixedDataset",
    "ReadAhead",
    "ReadAheadStats",
    "Records",
    "Shard",
    "StreamReadAhead",
    "decode_fields",
    "encode_field",
    "encode_fields",
    "manifest_version",
    "read_manifest",
    "sample_key",
    "unsupported_reason",
]
