"""``batchwire inspect DIR``: summarize a dataset directory and check its shards."""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchwire.server.data import FieldSpec

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "field_lines", "human_size", "run"]

# Longer lists are cut to their head, with the rest summarized in one line.
_MAX_CLASSES = 20
_MAX_SHARDS = 20
_MAX_REJECTED = 5


HELP = "summarize a dataset directory and check its shards against the manifest"
DESCRIPTION = (
    "Print a dataset's samples, classes, fields, shards and rejected files, and check that "
    "every shard holds as many records as the manifest says (exit 1 if not)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=pathlib.Path, metavar="DIR", help="dataset directory")
    parser.add_argument(
        "--all", action="store_true", help="list every class, shard and rejected file"
    )


def run(args: argparse.Namespace) -> int:
    from batchwire.server.data import DatasetError, summarize

    try:
        summary = summarize(args.directory)
    except DatasetError as exc:
        print(f"error: {exc}{_hint(args.directory)}", file=sys.stderr)
        return 2
    m = summary.manifest
    limit = None if args.all else _MAX_CLASSES
    print(f"dataset   {m.name}  ({summary.directory})")
    print(f"samples   {m.num_samples}")
    print(f"created   {m.created or '-'}  from {m.source or '-'}")
    print(f"version   {summary.version}  (as the server reports it)")
    print(f"classes   {len(m.classes)}")
    pairs = list(zip(m.classes, m.class_counts, strict=True))
    for label, (name, count) in enumerate(pairs[:limit]):
        print(f"  {label:>5}  {name:<30} {count}")
    if limit is not None and len(pairs) > limit:
        rest = [count for _, count in pairs[limit:]]
        print(
            f"  ... {len(rest)} more classes ({sum(rest)} samples, "
            f"{min(rest)}..{max(rest)} per class)"
        )
    for line in field_lines(m.fields):
        print(line)
    print(f"shards    {len(summary.shards)}")
    shard_limit = None if args.all else _MAX_SHARDS
    for shard in summary.shards[:shard_limit]:
        last = shard.first_id + shard.count - 1
        print(
            f"  {shard.path}  ids {shard.first_id}..{last}  {shard.count} samples  "
            f"{human_size(shard.size_bytes)}"
        )
    if shard_limit is not None and len(summary.shards) > shard_limit:
        print(f"  ... {len(summary.shards) - shard_limit} more shards")
    print(
        f"size      {human_size(summary.size_bytes)} on disk, {human_size(m.total_bytes)} of images"
    )
    print(f"rejected  {len(m.rejected)}")
    rejected_limit = None if args.all else _MAX_REJECTED
    for item in m.rejected[:rejected_limit]:
        part = f" ({item['part']})" if item.get("part") else ""
        print(f"  {item.get('path')}{part}: {item.get('reason')}")
    if rejected_limit is not None and len(m.rejected) > rejected_limit:
        print(f"  ... {len(m.rejected) - rejected_limit} more (--all lists them)")
    if summary.problems:
        for problem in summary.problems:
            print(f"error: {problem}", file=sys.stderr)
        print(
            f"error: {summary.directory} does not match its manifest; ingest it again",
            file=sys.stderr,
        )
        return 1
    print("check     ok: every shard holds the records its manifest lists")
    return 0


def _hint(directory: pathlib.Path) -> str:
    """What to do when ``directory`` is not a dataset: its parent folder, or a missing path."""
    if not directory.exists():
        return f" ({directory} does not exist)"
    if not directory.is_dir() or (directory / "manifest.json").exists():
        return ""
    names = sorted(c.name for c in directory.iterdir() if (c / "manifest.json").is_file())
    if not names:
        return f" ({directory} is not a dataset: `batchwire ingest` makes one)"
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"; {directory} holds datasets ({shown}): inspect one of them, e.g. "
        f"batchwire inspect {directory / names[0]}"
    )


def human_size(num_bytes: float) -> str:
    """``num_bytes`` in B, KiB, MiB, GiB or TiB, for people."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def field_lines(fields: tuple[FieldSpec, ...]) -> list[str]:
    """A line per field: its name, kind, dtype, shape, format, and how many entries the
    samples holding it hold (boxes per image, captions per image)."""
    lines = [f"fields    {len(fields)}"] if fields else []
    for spec in fields:
        shape = "[" + ", ".join(str(n) for n in spec.shape) + "]"
        extra = "".join(
            f"  {word} {value}"
            for word, value in (("format", spec.format), ("along", spec.along))
            if value
        )
        count = (
            f"in {spec.samples} samples, {spec.count_min}..{spec.count_max} each "
            f"(mean {spec.count_mean:.2f})"
            if spec.shape and spec.shape[0] == -1
            else f"in {spec.samples} samples"
        )
        lines.append(f"  {spec.name:<14} {spec.kind:<6} {spec.dtype:<8} {shape:<9}{extra}  {count}")
    return lines
