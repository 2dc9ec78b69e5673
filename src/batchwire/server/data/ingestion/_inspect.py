"""``batchwire inspect``: a dataset's manifest checked against its shards on disk."""

from __future__ import annotations

import dataclasses
import pathlib

from batchwire.server.data.records import Dataset, Manifest

__all__ = ["DatasetSummary", "ShardSummary", "summarize"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardSummary:
    """A shard as found on disk: ``entries`` is LMDB's record count, ``size_bytes`` its files."""

    path: str
    first_id: int
    count: int
    entries: int
    size_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetSummary:
    """A dataset's manifest, its shards on disk, and every mismatch found (``problems``)."""

    directory: pathlib.Path
    manifest: Manifest
    version: str  # what DescribeDataset reports as the dataset's version
    shards: tuple[ShardSummary, ...]
    problems: tuple[str, ...]

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)


def summarize(directory: pathlib.Path | str) -> DatasetSummary:
    """Read-only check of a dataset: shard record counts and first/last keys against the manifest.

    Raises ``DatasetError`` when the directory is not a readable dataset; a
    mismatch is reported in ``problems``, not raised.
    """
    directory = pathlib.Path(directory)
    problems: list[str] = []
    with Dataset(directory) as dataset:
        manifest, version = dataset.manifest, dataset.version
        entries_by_shard = dataset.shard_entries()
        for shard in manifest.shards:
            ends = sorted({shard.first_id, shard.first_id + shard.count - 1}) if shard.count else []
            images, _ = dataset.read(ends)
            problems.extend(
                f"{shard.path}: the record of id {i} is missing or unreadable"
                for i, image in zip(ends, images, strict=True)
                if image is None
            )
    shards: list[ShardSummary] = []
    for shard, entries in zip(manifest.shards, entries_by_shard, strict=True):
        path = directory / shard.path
        if entries != shard.count:
            problems.append(
                f"{shard.path} holds {entries} records but the manifest says {shard.count}"
            )
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        shards.append(
            ShardSummary(
                path=shard.path,
                first_id=shard.first_id,
                count=shard.count,
                entries=entries,
                size_bytes=size,
            )
        )
    return DatasetSummary(
        directory=directory,
        manifest=manifest,
        version=version,
        shards=tuple(shards),
        problems=tuple(problems),
    )
