"""A new dataset's content: the images that decode, as ``Datum`` records in shards, and
its ``manifest.json``.

``write_dataset`` reads a source in batches, checks every image with DALI's CPU
decoder, appends those that decode to the shards as Caffe ``Datum`` records
holding the original bytes, and writes the manifest last. An image that does
not decode is ``Rejected`` with the decoder's reason; a source with no
decodable image is an ``IngestError``. A sample with named fields (a
``SampleSource``'s) has its boxes checked against the decoded image (``_boxes``)
and its fields stored in the Datum's ``fields``; the manifest declares them, with
their counts (``_field_tally``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pathlib
import sys
from collections.abc import Iterator, Mapping, Sequence

from batchwire.server.data.ingestion._batches import Rejected
from batchwire.server.data.ingestion._boxes import check_boxes
from batchwire.server.data.ingestion._field_tally import FieldTally
from batchwire.server.data.ingestion._file_sources import SourceFile, Sources
from batchwire.server.data.ingestion._lmdb_sources import LmdbSource, LmdbSourceError, SourceRecord
from batchwire.server.data.ingestion._sample_source import SampleSource, SourceSample
from batchwire.server.data.ingestion._shard_writer import ShardWriter
from batchwire.server.data.ingestion._validate import Decoded, ImageValidator
from batchwire.server.data.records import MANIFEST, Manifest, Shard, encode_fields
from batchwire.server.errors import IngestError
from batchwire.v1 import datum_pb2

__all__ = ["WriteOptions", "write_dataset"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How a dataset is written: its name, samples per shard, how images are validated
    (``batch_size`` images at once on ``num_threads`` threads), and a progress bar or not."""

    name: str
    shard_size: int
    batch_size: int
    num_threads: int | None
    progress: bool


_Source = Sources | LmdbSource | SampleSource
_Item = SourceFile | SourceRecord | SourceSample


class _Tally:
    """What the shards hold so far: samples per class (or, where samples have no class, the
    classes their ``class`` fields name), image bytes, fields, and what was rejected."""

    def __init__(self, sources: _Source) -> None:
        self.rejected: list[Rejected] = list(sources.ignored)
        # An LMDB's classes are its label numbers: counted as they come.
        self.counts = [0] * len(sources.classes or ())
        self.total_bytes = 0
        self.fields = FieldTally(sources.specs if isinstance(sources, SampleSource) else ())

    def accept(self, label: int, size: int, fields: Mapping[str, object]) -> None:
        if label >= len(self.counts):
            self.counts.extend([0] * (label + 1 - len(self.counts)))
        if label >= 0:  # NO_LABEL: counted by the classes its fields name
            self.counts[label] += 1
        self.total_bytes += size
        self.fields.accept(fields, self.counts)

    def reject(self, item: _Item, reason: str, part: str = "") -> None:
        self.rejected.append(Rejected(item.relpath, reason, part))
        logger.debug("rejected %s%s: %s", item.relpath, f" ({part})" if part else "", reason)


def write_dataset(
    sources: _Source, directory: pathlib.Path, *, source: str, options: WriteOptions
) -> Manifest:
    """Write the shards and manifest of a dataset into the empty ``directory``.

    ``source`` names where the images came from, in the manifest and in errors.
    """
    tally = _Tally(sources)
    shards = _write_shards(sources, directory, options, tally)
    if not shards:
        rejected = tally.rejected
        first = "; ".join(f"{r.path}: {r.reason}" for r in rejected[:3])
        raise IngestError(
            f"no decodable image in {source}: all {len(rejected)} files were rejected"
            + (f" ({first}{', ...' if len(rejected) > 3 else ''})" if first else "")
        )
    classes = sources.classes
    if classes is None:
        classes = tuple(str(label) for label in range(len(tally.counts)))
    manifest = Manifest(
        name=options.name,
        num_samples=sum(s.count for s in shards),
        classes=classes,
        class_counts=tuple(tally.counts),
        shards=tuple(shards),
        total_bytes=tally.total_bytes,
        source=source,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        rejected=tuple(r.as_json() for r in tally.rejected),
        fields=tally.fields.specs(),
        class_ids=sources.class_ids if isinstance(sources, SampleSource) else (),
    )
    _write_manifest(directory, manifest)
    return manifest


def _write_shards(
    sources: _Source, directory: pathlib.Path, options: WriteOptions, tally: _Tally
) -> list[Shard]:
    from tqdm import tqdm

    writer = ShardWriter(directory, options.shard_size)
    bar = tqdm(
        total=sources.total,
        desc=f"ingest {options.name}",
        unit="file",
        file=sys.stderr,
        disable=None if options.progress else True,  # None: off where stderr is no terminal
        dynamic_ncols=True,
    )
    try:
        with ImageValidator(
            batch_size=options.batch_size, num_threads=options.num_threads
        ) as validator:
            for batch, unreadable in _batches(sources, options.batch_size):
                tally.rejected.extend(unreadable)
                verdicts = validator.check([data for _, data in batch])
                for (item, data), verdict in zip(batch, verdicts, strict=True):
                    if not isinstance(verdict, Decoded):
                        tally.reject(item, verdict.reason)
                        continue
                    fields = _fields(item, verdict, sources, tally)
                    writer.add(_datum(data, item.label, verdict, fields, sources))
                    tally.accept(item.label, len(data), fields)
                bar.update(len(batch) + len(unreadable))
        return writer.close()
    finally:
        writer.abort()
        bar.close()


def _batches(
    sources: _Source, batch_size: int
) -> Iterator[tuple[Sequence[tuple[_Item, bytes]], list[Rejected]]]:
    try:
        yield from sources.batches(batch_size)
    except LmdbSourceError as exc:
        raise IngestError(str(exc)) from None


def _fields(item: _Item, image: Decoded, sources: _Source, tally: _Tally) -> dict[str, object]:
    """The fields of ``item`` to store, its bad boxes dropped and reported; a field made
    from the image's size (a callable: a COCO mask) made now."""
    if not isinstance(item, SourceSample) or not isinstance(sources, SampleSource):
        return {}
    values = {
        name: value(image.width, image.height) if callable(value) else value
        for name, value in item.fields.items()
    }
    fields, dropped = check_boxes(values, sources.specs, width=image.width, height=image.height)
    for part, reason in dropped:
        tally.reject(item, reason, part)
    return fields


def _datum(
    data: bytes, label: int, image: Decoded, fields: Mapping[str, object], sources: _Source
) -> bytes:
    """A serialized Caffe ``Datum`` holding the original encoded bytes of an image, and
    its fields where it has some (in the order the source declares them)."""
    datum = datum_pb2.Datum(
        channels=image.channels,
        height=image.height,
        width=image.width,
        data=data,
        label=label,
        encoded=True,
    )
    if fields and isinstance(sources, SampleSource):
        kinds = sources.kinds()
        datum.fields.CopyFrom(
            encode_fields({name: (kinds[name], fields[name]) for name in kinds if name in fields})
        )
    return datum.SerializeToString()


def _write_manifest(directory: pathlib.Path, manifest: Manifest) -> None:
    with open(directory / MANIFEST, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
