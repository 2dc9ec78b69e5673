"""``batchwire ingest SRC OUT --name NAME``: build a dataset from class folders, a file list,
an existing LMDB (Caffe's ``convert_imageset`` output, or pickled ``(image bytes, label)``
records), or samples with fields (a COCO file, a JSON-lines or CSV manifest, WebDataset
shards)."""

from __future__ import annotations

import argparse
import pathlib
import sys

from batchwire.common.words import counted

# The formats --format names (batchwire.server.data.FORMATS, spelled here so that --help
# needs no DALI or LMDB).
FORMATS = ("folder", "lmdb", "coco", "jsonl", "csv", "webdataset")

__all__ = ["DESCRIPTION", "FORMATS", "HELP", "add_arguments", "run"]


HELP = "turn a folder of images into a batchwire dataset (LMDB shards + manifest)"
DESCRIPTION = (
    "Write OUT/NAME/: LMDB shards of Caffe Datum records (the original image bytes) "
    "and manifest.json. Classes are SRC's subdirectories in sorted order (labels "
    "0..C-1), or come from --file-list. SRC may also be an existing LMDB: Caffe's "
    "convert_imageset output (Datum values) or pickled (image bytes, label) records "
    "with __keys__; its images are copied as they are, pickles are read without running "
    "any code. SRC may also hold samples with named fields (boxes, captions, ...): a COCO "
    "instances or captions .json, a .jsonl or .csv manifest of image paths and fields, or "
    "WebDataset shards (a .tar, or a folder of key.jpg/key.json/key.txt/key.cls files); the "
    "format is told from SRC, or named by --format. Every image is decoded with DALI; those "
    "that fail are skipped and listed with a reason, as are bad annotations."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src",
        type=pathlib.Path,
        metavar="SRC",
        help="folder of images, an existing LMDB, a COCO .json, a .jsonl or .csv manifest, "
        "or WebDataset shards",
    )
    parser.add_argument("out", type=pathlib.Path, metavar="OUT", help="where OUT/NAME/ goes")
    parser.add_argument("--name", required=True, help="dataset name (the served name)")
    parser.add_argument(
        "--file-list",
        type=pathlib.Path,
        metavar="F",
        help="file of 'relative/path label' lines (paths relative to SRC) instead of class folders",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="what SRC is, where it cannot be told from SRC itself (default: told from SRC)",
    )
    parser.add_argument(
        "--images",
        type=pathlib.Path,
        metavar="DIR",
        help="folder that a COCO, .jsonl or .csv manifest's image paths are relative to "
        "(default: the manifest's folder)",
    )
    parser.add_argument(
        "--masks",
        action="store_true",
        help="COCO instances: each image's segmentations as a mask field (a PNG, each pixel "
        "1 + its class, 0 the background), for the segmentation pipeline",
    )
    parser.add_argument(
        "--shard-size", type=int, default=None, metavar="N", help="samples per shard (10000)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace OUT/NAME once the new one is complete"
    )
    parser.add_argument(
        "--threads", type=int, default=None, metavar="N", help="DALI decoding threads"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is off anyway where output is not a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    from batchwire.cli._inspect import field_lines, human_size
    from batchwire.server.data import DEFAULT_SHARD_SIZE, IngestError, ingest

    try:
        report = ingest(
            args.src,
            args.out,
            name=args.name,
            file_list=args.file_list,
            source_format=args.format,
            images=args.images,
            masks=args.masks,
            shard_size=DEFAULT_SHARD_SIZE if args.shard_size is None else args.shard_size,
            overwrite=args.overwrite,
            num_threads=args.threads,
            progress=not args.no_progress,
        )
    except IngestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"ingested {counted(report.num_samples, 'image')} in "
        f"{counted(len(report.classes), 'class', 'classes')} into "
        f"{report.path} ({counted(report.num_shards, 'shard')}, {human_size(report.bytes)}) "
        f"in {report.seconds:.1f} s"
    )
    for line in field_lines(report.fields):
        print(line)
    files = [item for item in report.rejected if not item.part]
    parts = [item for item in report.rejected if item.part]
    if files:
        print(f"rejected {counted(len(files), 'file')}:")
        for item in files:
            print(f"  {item.path}: {item.reason}")
    if parts:
        print(f"dropped {counted(len(parts), 'annotation')} of the files kept:")
        for item in parts:
            print(f"  {item.path} ({item.part}): {item.reason}")
    return 0
