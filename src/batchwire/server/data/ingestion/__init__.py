"""Ingest: the offline tool that turns image folders, file lists, existing LMDBs (Caffe
Datums, pickled tuples) or samples with fields (COCO, JSON lines or CSV, WebDataset) into a dataset of LMDB shards and a manifest, validating every
image first and publishing the dataset atomically; and ``inspect``'s summary of one. It
runs on a data engineer's machine or a build job, apart from any server, and writes the
format :mod:`batchwire.server.data.records` reads.
"""

from __future__ import annotations

from batchwire.server.data.ingestion._coco_masks import write_coco_masks
from batchwire.server.data.ingestion._ingest import (
    DEFAULT_SHARD_SIZE,
    FORMATS,
    IngestError,
    IngestReport,
    ingest,
)
from batchwire.server.data.ingestion._inspect import DatasetSummary, ShardSummary, summarize
from batchwire.server.data.ingestion._safe_pickle import UnsafePickle, safe_loads
from batchwire.server.data.ingestion._synthetic import (
    SHAPES,
    write_image_folders,
    write_photo_folders,
)
from batchwire.server.data.ingestion._synthetic_coco import (
    BACKGROUND,
    BOX_COLOURS,
    write_coco_boxes,
)

__all__ = [
    "BACKGROUND",
    "BOX_COLOURS",
    "DEFAULT_SHARD_SIZE",
    "FORMATS",
    "SHAPES",
    "DatasetSummary",
    "IngestError",
    "IngestReport",
    "ShardSummary",
    "UnsafePickle",
    "ingest",
    "safe_loads",
    "summarize",
    "write_coco_boxes",
    "write_coco_masks",
    "write_image_folders",
    "write_photo_folders",
]
