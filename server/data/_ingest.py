"""Ingest: image files on disk become a batchwire dataset directory.

``ingest(SRC, OUT, name=NAME)`` reads class folders under ``SRC`` (or a
``path label`` file list) or the records of an existing LMDB (Caffe's
``convert_imageset`` output, or pickled ``(image bytes, label)`` records; see
``_lmdb_sources``), checks that every image decodes with DALI's CPU
decoder, and writes ``OUT/NAME/``: LMDB shards of Caffe ``Datum`` records
holding the original file bytes, plus ``manifest.json`` (see ``_dataset``).
Files that do not decode are skipped and listed, with a reason, in the report
and in the manifest's ``rejected`` list.

The write is atomic: everything goes to a hidden ``OUT/.NAME.partial-*``
directory that is renamed to ``OUT/NAME`` only once complete, and removed on
any failure or interrupt.

``summarize(DIR)`` is the read-only counterpart behind ``batchwire inspect``: it
checks each shard's LMDB entry count against the manifest.

Errors a user can fix are ``IngestError``, with a message that says what to do.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Iterator

from batchwire.server.data._batches import Rejected
from batchwire.server.data._dataset import MANIFEST, NAME_PATTERN, Manifest
from batchwire.server.data._file_sources import (
    SourceFile,
    Sources,
    read_file_list,
    scan_class_folders,
)
from batchwire.server.data._ingest_error import IngestError
from batchwire.server.data._lmdb_sources import (
    LmdbSource,
    LmdbSourceError,
    Record,
    open_lmdb_source,
)
from batchwire.server.data._publish import check_replaceable, new_dir, publish
from batchwire.server.data._shard_writer import ShardWriter
from batchwire.server.data._validate import DEFAULT_BATCH_SIZE, Decoded, ImageValidator
from batchwire.v1 import datum_pb2

__all__ = ["DEFAULT_SHARD_SIZE", "IngestError", "IngestReport", "ingest"]

logger = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 10_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class IngestReport:
    """What an ingest wrote. ``bytes`` counts the encoded images stored; ``seconds`` is wall time."""

    path: pathlib.Path
    num_samples: int
    classes: tuple[str, ...]
    class_counts: tuple[int, ...]
    num_shards: int
    rejected: tuple[Rejected, ...]
    bytes: int
    seconds: float


def ingest(
    src: pathlib.Path | str,
    out: pathlib.Path | str,
    *,
    name: str,
    file_list: pathlib.Path | str | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_threads: int | None = None,
    progress: bool = False,
) -> IngestReport:
    """Write the dataset ``OUT/NAME`` from the images under ``src``; see the module docstring.

    ``src`` is a folder of class folders, a folder with ``file_list``, or an
    existing LMDB (a directory holding ``data.mdb``, or a single LMDB file),
    recognised by its contents.

    Ids ``0..N-1`` follow the source order, counting only files that decode.
    ``shard_size`` is samples per shard; ``batch_size`` bounds how many images
    DALI decodes at once. ``progress`` draws a tqdm bar on stderr. An existing
    ``OUT/NAME`` is an error unless ``overwrite``, and is then replaced only
    once the new dataset is complete. Raises ``IngestError`` for what a user can
    fix, including a source with no decodable image.
    """
    started = time.monotonic()
    src, out = pathlib.Path(src), pathlib.Path(out)
    if not NAME_PATTERN.match(name):
        raise IngestError(
            f"dataset name {name!r} is not allowed: use letters, digits, '.', '_' or '-' "
            "(at most 128 characters, starting with a letter or digit)"
        )
    if shard_size < 1:
        raise IngestError(f"shard size must be at least 1, got {shard_size}")
    if batch_size < 1 or (num_threads is not None and num_threads < 1):
        raise IngestError("batch size and thread count must be at least 1")
    final = out / name
    try:
        existing = open_lmdb_source(src)
    except LmdbSourceError as exc:
        raise IngestError(str(exc)) from None
    sources: Sources | LmdbSource
    if existing is not None:
        if file_list is not None:
            existing.close()
            raise IngestError(f"{src} is an LMDB: it carries its own labels, so drop --file-list")
        sources = existing
        logger.info(
            "ingesting %d records of the %s LMDB %s into %s",
            existing.total,
            "Caffe" if existing.kind == "caffe" else "pickled",
            src,
            final,
        )
    else:
        if not src.is_dir():
            raise IngestError(
                f"source {src} is not a directory of images nor an LMDB (a directory holding "
                "data.mdb, or an LMDB file)"
            )
        sources = (
            read_file_list(src, pathlib.Path(file_list))
            if file_list is not None
            else scan_class_folders(src)
        )
        if not sources.files:
            raise IngestError(f"no files found in the class folders under {src}")
        logger.info(
            "ingesting %d files in %d classes from %s into %s",
            len(sources.files),
            len(sources.classes),
            src,
            final,
        )
    try:
        check_replaceable(final, overwrite)
        return _ingest(
            sources,
            src=src,
            out=out,
            name=name,
            shard_size=shard_size,
            overwrite=overwrite,
            batch_size=batch_size,
            num_threads=num_threads,
            progress=progress,
            started=started,
        )
    finally:
        if isinstance(sources, LmdbSource):
            sources.close()


def _ingest(
    sources: Sources | LmdbSource,
    *,
    src: pathlib.Path,
    out: pathlib.Path,
    name: str,
    shard_size: int,
    overwrite: bool,
    batch_size: int,
    num_threads: int | None,
    progress: bool,
    started: float,
) -> IngestReport:
    final = out / name
    try:
        out.mkdir(parents=True, exist_ok=True)
        partial = new_dir(out, f".{name}.partial-")
    except OSError as exc:
        raise IngestError(f"cannot create a directory in {out}: {exc.strerror}") from exc
    try:
        manifest = _write(
            sources,
            partial,
            name=name,
            source=str(src.resolve()),
            shard_size=shard_size,
            batch_size=batch_size,
            num_threads=num_threads,
            progress=progress,
        )
        publish(partial, final, overwrite)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    rejected = tuple(Rejected(r["path"], r["reason"]) for r in manifest.rejected)
    for label, count in enumerate(manifest.class_counts):
        if count == 0:
            logger.warning("class %r has no decodable image", manifest.classes[label])
    logger.info(
        "wrote %d samples to %s; rejected %d files", manifest.num_samples, final, len(rejected)
    )
    return IngestReport(
        path=final,
        num_samples=manifest.num_samples,
        classes=manifest.classes,
        class_counts=manifest.class_counts,
        num_shards=len(manifest.shards),
        rejected=rejected,
        bytes=manifest.total_bytes,
        seconds=time.monotonic() - started,
    )


def _write(
    sources: Sources | LmdbSource,
    directory: pathlib.Path,
    *,
    name: str,
    source: str,
    shard_size: int,
    batch_size: int,
    num_threads: int | None,
    progress: bool,
) -> Manifest:
    from tqdm import tqdm

    rejected = list(sources.ignored)
    # An LMDB's classes are its label numbers: counted as they come.
    counts = [0] * len(sources.classes or ())
    total_bytes = 0
    writer = ShardWriter(directory, shard_size)
    bar = tqdm(
        total=sources.total,
        desc=f"ingest {name}",
        unit="file",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        with ImageValidator(batch_size=batch_size, num_threads=num_threads) as validator:
            for batch, unreadable in _batches(sources, batch_size):
                rejected.extend(unreadable)
                verdicts = validator.check([data for _, data in batch])
                for (file, data), verdict in zip(batch, verdicts, strict=True):
                    if not isinstance(verdict, Decoded):
                        rejected.append(Rejected(file.relpath, verdict.reason))
                        logger.debug("rejected %s: %s", file.relpath, verdict.reason)
                        continue
                    datum = datum_pb2.Datum(
                        channels=verdict.channels,
                        height=verdict.height,
                        width=verdict.width,
                        data=data,
                        label=file.label,
                        encoded=True,
                    )
                    writer.add(datum.SerializeToString())
                    if file.label >= len(counts):
                        counts.extend([0] * (file.label + 1 - len(counts)))
                    counts[file.label] += 1
                    total_bytes += len(data)
                bar.update(len(batch) + len(unreadable))
        shards = writer.close()
    finally:
        writer.abort()
        bar.close()
    if not shards:
        first = "; ".join(f"{r.path}: {r.reason}" for r in rejected[:3])
        raise IngestError(
            f"no decodable image in {source}: all {len(rejected)} files were rejected"
            + (f" ({first}{', ...' if len(rejected) > 3 else ''})" if first else "")
        )
    classes = sources.classes
    if classes is None:
        classes = tuple(str(label) for label in range(len(counts)))
    manifest = Manifest(
        name=name,
        num_samples=sum(s.count for s in shards),
        classes=classes,
        class_counts=tuple(counts),
        shards=tuple(shards),
        total_bytes=total_bytes,
        source=source,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        rejected=tuple({"path": r.path, "reason": r.reason} for r in rejected),
    )
    path = directory / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    return manifest


def _batches(
    sources: Sources | LmdbSource, batch_size: int
) -> Iterator[tuple[list[tuple[SourceFile, bytes]] | list[tuple[Record, bytes]], list[Rejected]]]:
    try:
        yield from sources.batches(batch_size)
    except LmdbSourceError as exc:
        raise IngestError(str(exc)) from None
