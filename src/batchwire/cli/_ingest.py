"""``batchwire ingest SRC OUT --name NAME``: build a dataset from class folders, a file list,
or an existing LMDB (Caffe's ``convert_imageset`` output, or pickled ``(image bytes, label)``
records)."""

from __future__ import annotations

import argparse
import pathlib
import sys

from batchwire.common.words import counted

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]


HELP = "turn a folder of images into a batchwire dataset (LMDB shards + manifest)"
DESCRIPTION = (
    "Write OUT/NAME/: LMDB shards of Caffe Datum records (the original image bytes) "
    "and manifest.json. Classes are SRC's subdirectories in sorted order (labels "
    "0..C-1), or come from --file-list. SRC may also be an existing LMDB: Caffe's "
    "convert_imageset output (Datum values) or pickled (image bytes, label) records "
    "with __keys__; its images are copied as they are, pickles are read without running "
    "any code. Every image is decoded with DALI; those that fail are skipped and listed "
    "with a reason."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src", type=pathlib.Path, metavar="SRC", help="folder of images, or an existing LMDB"
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
    from batchwire.cli._inspect import human_size
    from batchwire.server.data import DEFAULT_SHARD_SIZE, IngestError, ingest

    try:
        report = ingest(
            args.src,
            args.out,
            name=args.name,
            file_list=args.file_list,
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
    if report.rejected:
        print(f"rejected {counted(len(report.rejected), 'file')}:")
        for item in report.rejected:
            print(f"  {item.path}: {item.reason}")
    return 0
