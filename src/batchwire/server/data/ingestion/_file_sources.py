"""Ingest sources on disk: class folders (as torchvision's ImageFolder sees them) or a
``path label`` file list, and their files read in batches for validation.

A file that cannot be read is not an error: it is a :class:`Rejected` entry, with
the reason, and the ingest goes on. What the user must fix is ``IngestError``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import stat
from collections.abc import Iterator

from batchwire.server.data.ingestion._batches import Rejected, bounded_batches
from batchwire.server.data.records import MAX_LABEL
from batchwire.server.errors import IngestError

__all__ = [
    "SourceFile",
    "Sources",
    "read_file",
    "read_file_list",
    "scan_class_folders",
]


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

    @property
    def total(self) -> int:
        """How many files there are to read (for progress)."""
        return len(self.files)

    def batches(
        self, batch_size: int
    ) -> Iterator[tuple[list[tuple[SourceFile, bytes]], list[Rejected]]]:
        """Readable files in id order, in bounded batches, with those unreadable."""
        return bounded_batches(_entries(self.files), batch_size)


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
        if not 0 <= label <= MAX_LABEL:
            raise IngestError(f"{where}: label {label} is outside 0..{MAX_LABEL}")
        if os.path.isabs(relpath):
            raise IngestError(f"{where}: path {relpath!r} must be relative to SRC")
        files.append(SourceFile(path=src / relpath, relpath=relpath, label=label))
    if not files:
        raise IngestError(f"file list {file_list} names no files")
    num_classes = max(f.label for f in files) + 1
    return Sources(classes=tuple(str(i) for i in range(num_classes)), files=tuple(files))


def _entries(files: tuple[SourceFile, ...]) -> Iterator[tuple[SourceFile, bytes] | Rejected]:
    for file in files:
        data = _read(file)
        yield (file, data) if isinstance(data, bytes) else data


def _read(file: SourceFile) -> bytes | Rejected:
    return read_file(file.path, file.relpath)


def read_file(path: pathlib.Path, relpath: str) -> bytes | Rejected:
    """The bytes of the regular file ``path``, or why not (``relpath`` names it)."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            # Opening a FIFO or device could block or never end.
            return Rejected(relpath, "not a regular file")
        return path.read_bytes()
    except OSError as exc:
        return Rejected(relpath, f"cannot read: {exc.strerror or exc}")


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
