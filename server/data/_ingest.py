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
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Iterator

import lmdb

from batchwire.server.data._dataset import (
    MANIFEST,
    NAME_PATTERN,
    Manifest,
    Shard,
    sample_key,
)
from batchwire.server.data._lmdb_sources import (
    LmdbSource,
    LmdbSourceError,
    Record,
    open_lmdb_source,
)
from batchwire.server.data._validate import DEFAULT_BATCH_SIZE, Decoded, ImageValidator
from batchwire.v1 import datum_pb2

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "IngestError",
    "IngestReport",
    "Rejected",
    "SourceFile",
    "Sources",
    "ingest",
    "read_file_list",
    "scan_class_folders",
]

logger = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 10_000
# A validation batch also stops growing at this many encoded bytes.
_BATCH_BYTES = 8 << 20
# Records are buffered and committed in bounded transactions.
_COMMIT_RECORDS = 1024
_COMMIT_BYTES = 64 << 20
# Initial LMDB map size per shard; doubled whenever a shard outgrows it.
_MAP_SIZE = 16 << 30
_MAX_LABEL = 2**31 - 1  # Datum.label is an int32


class IngestError(Exception):
    """An ingest cannot proceed; the message says what to change."""


@dataclasses.dataclass(frozen=True, slots=True)
class Rejected:
    """A source file left out of the dataset: ``path`` is relative to SRC."""

    path: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class SourceFile:
    """One candidate sample: ``relpath`` (POSIX, relative to SRC) names it in reports."""

    path: pathlib.Path
    relpath: str
    label: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sources:
    """Candidate files in id order, the class names by label, and files ignored up front."""

    classes: tuple[str, ...]
    files: tuple[SourceFile, ...]
    ignored: tuple[Rejected, ...] = ()


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


def scan_class_folders(src: pathlib.Path) -> Sources:
    """Files under ``SRC/<class>/`` (recursively), as torchvision's ImageFolder sees them.

    Classes are the sorted names of SRC's subdirectories, labelled 0..C-1; each
    class's files are sorted by relative path. Hidden files and directories are
    skipped; files directly in SRC belong to no class and are reported as ignored.
    """
    try:
        entries = sorted(os.scandir(src), key=lambda e: e.name)
    except OSError as exc:
        raise IngestError(f"cannot list {src}: {exc.strerror}") from exc
    visible = [e for e in entries if not e.name.startswith(".")]
    classes = tuple(e.name for e in visible if e.is_dir())
    if not classes:
        raise IngestError(
            f"{src} has no class folders: put each class's images in SRC/<class>/, "
            "or pass --file-list with 'relative/path label' lines"
        )
    ignored = tuple(Rejected(e.name, "not in a class folder") for e in visible if not e.is_dir())
    files: list[SourceFile] = []
    for label, name in enumerate(classes):
        relpaths = sorted(_walk_files(src, src / name))
        files.extend(SourceFile(path=src / rel, relpath=rel, label=label) for rel in relpaths)
    return Sources(classes=classes, files=tuple(files), ignored=ignored)


def read_file_list(src: pathlib.Path, file_list: pathlib.Path) -> Sources:
    """Files named by ``file_list``: lines ``relative/path label``, paths relative to SRC.

    Blank lines and ``#`` comments are skipped; the label is the last
    whitespace-separated field, so paths may contain spaces. Classes are the
    label numbers as strings, ``"0"`` .. ``str(max label)``.
    """
    try:
        lines = file_list.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise IngestError(f"cannot read file list {file_list}: {exc}") from exc
    files: list[SourceFile] = []
    for lineno, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{file_list}, line {lineno}"
        parts = text.rsplit(None, 1)
        if len(parts) != 2:
            raise IngestError(f"{where}: expected 'relative/path label', got {text!r}")
        relpath, label_text = parts
        try:
            label = int(label_text)
        except ValueError:
            raise IngestError(
                f"{where}: label {label_text!r} is not an integer (expected 'relative/path label')"
            ) from None
        if not 0 <= label <= _MAX_LABEL:
            raise IngestError(f"{where}: label {label} is outside 0..{_MAX_LABEL}")
        if os.path.isabs(relpath):
            raise IngestError(f"{where}: path {relpath!r} must be relative to SRC")
        files.append(SourceFile(path=src / relpath, relpath=relpath, label=label))
    if not files:
        raise IngestError(f"file list {file_list} names no files")
    num_classes = max(f.label for f in files) + 1
    return Sources(classes=tuple(str(i) for i in range(num_classes)), files=tuple(files))


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
        _check_replaceable(final, overwrite)
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
        partial = _new_dir(out, f".{name}.partial-")
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
        _publish(partial, final, overwrite)
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
    writer = _ShardWriter(directory, shard_size)
    bar = tqdm(
        total=len(sources.files) if isinstance(sources, Sources) else sources.total,
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
) -> Iterator[tuple[list[tuple[SourceFile | Record, bytes]], list[Rejected]]]:
    if isinstance(sources, Sources):
        yield from _read_batches(sources.files, batch_size)  # type: ignore[misc]
        return
    try:
        for batch, rejects in sources.batches(batch_size):
            yield batch, [Rejected(key, reason) for key, reason in rejects]  # type: ignore[misc]
    except LmdbSourceError as exc:
        raise IngestError(str(exc)) from None


def _read_batches(
    files: tuple[SourceFile, ...], batch_size: int
) -> Iterator[tuple[list[tuple[SourceFile, bytes]], list[Rejected]]]:
    """Readable files in order, in batches bounded by count and bytes, with those unreadable."""
    batch: list[tuple[SourceFile, bytes]] = []
    unreadable: list[Rejected] = []
    size = 0
    for file in files:
        try:
            mode = os.stat(file.path).st_mode
            if not stat.S_ISREG(mode):
                # Opening a FIFO or device could block or never end.
                unreadable.append(Rejected(file.relpath, "not a regular file"))
                continue
            data = file.path.read_bytes()
        except OSError as exc:
            unreadable.append(Rejected(file.relpath, f"cannot read: {exc.strerror or exc}"))
            continue
        batch.append((file, data))
        size += len(data)
        if len(batch) >= batch_size or size >= _BATCH_BYTES:
            yield batch, unreadable
            batch, unreadable, size = [], [], 0
    if batch or unreadable:
        yield batch, unreadable


class _ShardWriter:
    """Appends records with consecutive ids to ``shard-NNNNN`` LMDB directories."""

    def __init__(self, root: pathlib.Path, shard_size: int) -> None:
        self._root = root
        self._shard_size = shard_size
        self._shards: list[Shard] = []
        self._env: lmdb.Environment | None = None
        self._first_id = 0
        self._count = 0
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0

    def add(self, value: bytes) -> None:
        if self._env is None or self._count == self._shard_size:
            self._finish_shard()
            self._open_shard()
        self._pending.append((sample_key(self._first_id + self._count), value))
        self._pending_bytes += len(value)
        self._count += 1
        if len(self._pending) >= _COMMIT_RECORDS or self._pending_bytes >= _COMMIT_BYTES:
            self._commit()

    def close(self) -> list[Shard]:
        """Commit, sync and close the last shard; the shards written, in id order."""
        self._finish_shard()
        return list(self._shards)

    def abort(self) -> None:
        """Close without committing what is pending (the caller discards the directory)."""
        if self._env is not None:
            self._env.close()
            self._env = None

    def _open_shard(self) -> None:
        path = self._root / f"shard-{len(self._shards):05d}"
        # subdir=True: DALI's caffe reader opens only environment directories.
        # The directory is private until published, so no lock file and no
        # per-commit fsync; the shard is synced once when complete.
        self._env = lmdb.open(
            str(path),
            subdir=True,
            map_size=_MAP_SIZE,
            lock=False,
            sync=False,
            metasync=False,
            meminit=False,
            readahead=False,
        )

    def _finish_shard(self) -> None:
        if self._env is None:
            return
        self._commit()
        self._env.sync(True)
        self._env.close()
        self._env = None
        name = f"shard-{len(self._shards):05d}"
        self._shards.append(Shard(path=name, first_id=self._first_id, count=self._count))
        self._first_id += self._count
        self._count = 0

    def _commit(self) -> None:
        assert self._env is not None
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value, append=True)
                break
            except lmdb.MapFullError:
                grown = self._env.info()["map_size"] * 2
                logger.debug("growing LMDB map to %d bytes", grown)
                self._env.set_mapsize(grown)
        self._pending.clear()
        self._pending_bytes = 0


def _walk_files(src: pathlib.Path, top: pathlib.Path) -> Iterator[str]:
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:  # a symlink loop
            dirnames.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        here = pathlib.Path(dirpath)
        for filename in filenames:
            if not filename.startswith("."):
                yield (here / filename).relative_to(src).as_posix()


def _check_replaceable(final: pathlib.Path, overwrite: bool) -> None:
    if not (final.exists() or final.is_symlink()):
        return
    if final.is_dir() and not final.is_symlink() and not any(final.iterdir()):
        return  # an empty directory is replaced without asking
    if not overwrite:
        raise IngestError(
            f"{final} already exists: pass --overwrite to replace it, or choose another --name"
        )
    if not (final.is_dir() and (final / MANIFEST).is_file()):
        raise IngestError(
            f"{final} exists and is not a batchwire dataset (no {MANIFEST}); "
            "refusing to replace it: remove it yourself or choose another --name"
        )


def _publish(partial: pathlib.Path, final: pathlib.Path, overwrite: bool) -> None:
    """Rename the complete dataset into place; an old one goes only after the new one is in."""
    _check_replaceable(final, overwrite)
    if final.exists():
        old = _new_dir(final.parent, f".{final.name}.old-")
        os.replace(final, old)  # onto an empty directory: allowed by rename(2)
        try:
            os.replace(partial, final)
        except BaseException:
            os.replace(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.rename(partial, final)
        except OSError as exc:
            raise IngestError(f"cannot move the new dataset into {final}: {exc.strerror}") from exc
    _fsync_dir(final.parent)


def _new_dir(parent: pathlib.Path, prefix: str) -> pathlib.Path:
    # Not tempfile.mkdtemp: its 0700 mode would stick to the published dataset
    # and lock out a server running as another user; mkdir honours the umask.
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
