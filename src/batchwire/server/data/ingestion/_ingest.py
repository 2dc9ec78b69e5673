"""Ingest: image files on disk become a batchwire dataset directory.

``ingest(SRC, OUT, name=NAME)`` reads class folders under ``SRC`` (or a
``path label`` file list), the records of an existing LMDB (Caffe's
``convert_imageset`` output, or pickled ``(image bytes, label)`` records; see
``_lmdb_sources``), or samples with named fields (a COCO file, a JSON-lines or CSV
manifest, WebDataset shards; see ``_source_formats``), checks that every image decodes with DALI's CPU
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

This module runs the steps; each is a module of its own: the sources
(``_file_sources``, ``_lmdb_sources``, the formats with fields of ``_source_formats``,
batched by ``_batches``), the dataset's
content (``_dataset_writer``, with ``_shard_writer``), and the atomic rename
into place (``_publish``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import shutil
import time
from collections.abc import Iterator

from batchwire.server.data.ingestion._batches import Rejected
from batchwire.server.data.ingestion._dataset_writer import WriteOptions, write_dataset
from batchwire.server.data.ingestion._file_sources import (
    Sources,
    read_file_list,
    scan_class_folders,
)
from batchwire.server.data.ingestion._lmdb_sources import (
    LmdbSource,
    LmdbSourceError,
    open_lmdb_source,
)
from batchwire.server.data.ingestion._publish import check_replaceable, new_dir, publish
from batchwire.server.data.ingestion._sample_source import SampleSource
from batchwire.server.data.ingestion._source_formats import (
    FIELD_FORMATS,
    FORMATS,
    detect_format,
    open_sample_source,
)
from batchwire.server.data.ingestion._validate import DEFAULT_BATCH_SIZE
from batchwire.server.data.records import NAME_PATTERN, FieldSpec, Manifest
from batchwire.server.errors import IngestError

__all__ = ["DEFAULT_SHARD_SIZE", "FORMATS", "IngestError", "IngestReport", "ingest"]

# What is ingested and what was written are DEBUG lines: the report says them once (the
# summary `batchwire ingest` prints), and the progress bar shows an ingest under way.
logger = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 10_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class IngestReport:
    """What an ingest wrote. ``bytes`` counts the encoded images stored; ``seconds`` is wall
    time. ``rejected`` lists the samples left out and the parts of samples (a bad box, an
    annotation) left out of those kept (``Rejected.part``); ``fields`` is the schema of the
    fields written (none for class folders, file lists and LMDBs)."""

    path: pathlib.Path
    num_samples: int
    classes: tuple[str, ...]
    class_counts: tuple[int, ...]
    num_shards: int
    rejected: tuple[Rejected, ...]
    bytes: int
    seconds: float
    fields: tuple[FieldSpec, ...] = ()


def ingest(
    src: pathlib.Path | str,
    out: pathlib.Path | str,
    *,
    name: str,
    file_list: pathlib.Path | str | None = None,
    source_format: str | None = None,
    images: pathlib.Path | str | None = None,
    masks: bool = False,
    shard_size: int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_threads: int | None = None,
    progress: bool = False,
) -> IngestReport:
    """Write the dataset ``OUT/NAME`` from the images under ``src``; see the module docstring.

    ``src`` is a folder of class folders, a folder with ``file_list``, an
    existing LMDB (a directory holding ``data.mdb``, or a single LMDB file),
    a COCO ``.json``, a ``.jsonl`` or ``.csv`` manifest, or WebDataset shards (a
    ``.tar``, or a folder of them or of ``key.ext`` files), recognised by its contents
    or extension, or named by ``source_format`` (one of :data:`FORMATS`). ``images`` is
    the folder a COCO or table manifest's image paths are relative to (default: the
    manifest's folder); ``masks`` adds COCO instances' segmentations, a mask an image.

    Ids ``0..N-1`` follow the source order, counting only files that decode.
    ``shard_size`` is samples per shard; ``batch_size`` bounds how many images
    DALI decodes at once. ``progress`` draws a tqdm bar on stderr. An existing
    ``OUT/NAME`` is an error unless ``overwrite``, and is then replaced only
    once the new dataset is complete. Raises ``IngestError`` for what a user can
    fix, including a source with no decodable image.
    """
    started = time.monotonic()
    src, out = pathlib.Path(src), pathlib.Path(out)
    options = WriteOptions(
        name=name,
        shard_size=shard_size,
        batch_size=batch_size,
        num_threads=num_threads,
        progress=progress,
    )
    _check_options(options)
    final = out / name
    # Before the source is read: a refusal comes first, not after "ingesting N files".
    check_replaceable(final, overwrite)
    sources = _open(
        src,
        file_list=None if file_list is None else pathlib.Path(file_list),
        source_format=source_format,
        images=None if images is None else pathlib.Path(images),
        masks=masks,
        final=final,
    )
    with _closing(sources):
        manifest = _write_and_publish(
            sources, src=src, out=out, options=options, overwrite=overwrite
        )
        return _report(manifest, final, started)


@contextlib.contextmanager
def _closing(sources: Sources | LmdbSource | SampleSource) -> Iterator[None]:
    """Closes an LMDB or a source of samples once the ingest is done with it, whatever
    happened (the files of a folder hold nothing open)."""
    try:
        yield
    finally:
        if isinstance(sources, LmdbSource | SampleSource):
            sources.close()


def _check_options(options: WriteOptions) -> None:
    if not NAME_PATTERN.match(options.name):
        raise IngestError(
            f"dataset name {options.name!r} is not allowed: use letters, digits, '.', '_' or '-' "
            "(at most 128 characters, starting with a letter or digit)"
        )
    if options.shard_size < 1:
        raise IngestError(f"shard size must be at least 1, got {options.shard_size}")
    if options.batch_size < 1 or (options.num_threads is not None and options.num_threads < 1):
        raise IngestError("batch size and thread count must be at least 1")


def _open(
    src: pathlib.Path,
    *,
    file_list: pathlib.Path | None,
    source_format: str | None,
    images: pathlib.Path | None,
    masks: bool,
    final: pathlib.Path,
) -> Sources | LmdbSource | SampleSource:
    """The source in ``source_format``, or in the format told from ``src``."""
    if source_format is not None and source_format not in FORMATS:
        raise IngestError(f"format {source_format!r} is not one of {', '.join(FORMATS)}")
    if source_format is None and file_list is None:
        source_format = detect_format(src)
    if source_format not in FIELD_FORMATS:
        if images is not None or masks:
            flag = "--images is for COCO, JSON-lines and CSV" if images else "--masks is for COCO"
            raise IngestError(f"{flag} sources: drop it")
        if source_format == "folder":
            return _scan(src, file_list, final)
        return _open_sources(src, file_list, final)
    if file_list is not None:
        raise IngestError(f"--file-list is for folders of images, not {source_format} sources")
    sources = open_sample_source(src, source_format, images, masks=masks)
    logger.debug(
        "ingesting %d samples with fields %s from %s (%s) into %s",
        sources.total,
        ", ".join(sources.kinds()),
        src,
        source_format,
        final,
    )
    return sources


def _open_sources(
    src: pathlib.Path, file_list: pathlib.Path | None, final: pathlib.Path
) -> Sources | LmdbSource:
    """The LMDB at ``src``, or the files of its class folders or of ``file_list``."""
    try:
        existing = open_lmdb_source(src)
    except LmdbSourceError as exc:
        raise IngestError(str(exc)) from None
    if existing is None:
        return _scan(src, file_list, final)
    if file_list is not None:
        existing.close()
        raise IngestError(f"{src} is an LMDB: it carries its own labels, so drop --file-list")
    logger.debug(
        "ingesting %d records of the %s LMDB %s into %s",
        existing.total,
        "Caffe" if existing.kind == "caffe" else "pickled",
        src,
        final,
    )
    return existing


def _scan(src: pathlib.Path, file_list: pathlib.Path | None, final: pathlib.Path) -> Sources:
    if not src.exists():
        raise IngestError(f"source {src} does not exist")
    if not src.is_dir():
        raise IngestError(
            f"source {src} is not a directory of images nor an LMDB (a directory holding "
            "data.mdb, or an LMDB file)"
        )
    sources = read_file_list(src, file_list) if file_list is not None else scan_class_folders(src)
    if not sources.files:
        raise IngestError(f"no files found in the class folders under {src}")
    logger.debug(
        "ingesting %d files in %d classes from %s into %s",
        len(sources.files),
        len(sources.classes),
        src,
        final,
    )
    return sources


def _write_and_publish(
    sources: Sources | LmdbSource | SampleSource,
    *,
    src: pathlib.Path,
    out: pathlib.Path,
    options: WriteOptions,
    overwrite: bool,
) -> Manifest:
    """Write the dataset into a hidden directory in ``out``, then rename it into place."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        partial = new_dir(out, f".{options.name}.partial-")
    except OSError as exc:
        raise IngestError(f"cannot create a directory in {out}: {exc.strerror}") from exc
    try:
        manifest = write_dataset(sources, partial, source=str(src.resolve()), options=options)
        publish(partial, out / options.name, overwrite)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _report(manifest: Manifest, final: pathlib.Path, started: float) -> IngestReport:
    rejected = tuple(Rejected.from_json(r) for r in manifest.rejected)
    for label, count in enumerate(manifest.class_counts):
        if count == 0:
            logger.warning("class %r has no decodable image", manifest.classes[label])
    logger.debug(
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
        fields=manifest.fields,
    )
