"""WebDataset-style samples as an ingest source: a folder, a ``.tar`` shard, or a folder of
``.tar`` shards, whose files are grouped by key.

A file's key is its path up to the first ``.`` of its name, its extension the rest
(``train/0001.jpg``: key ``train/0001``, extension ``jpg``), as WebDataset groups them.
A group is a sample: its image is the ``.jpg``, ``.jpeg`` or ``.png`` file; ``.json``
holds fields (an object: every key a field, kinds inferred as for a JSON-lines
manifest), ``.txt`` a ``caption`` (UTF-8 text) and ``.cls`` the label (a class index, or
a class name). Files of other extensions are ignored; a group without an image, or with a
``.json``, ``.txt`` or ``.cls`` that cannot be read, is rejected with the reason.
Samples follow their keys' sorted order (across shards: shard by shard, each sorted).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import tarfile
from collections.abc import Callable, Iterable

from batchwire.server.data.ingestion._batches import Rejected
from batchwire.server.data.ingestion._field_kinds import infer_columns, resolve_labels
from batchwire.server.data.ingestion._file_sources import read_file
from batchwire.server.data.ingestion._sample_source import SampleSource, SourceSample
from batchwire.server.errors import IngestError

__all__ = ["IMAGE_EXTENSIONS", "is_webdataset_folder", "read_webdataset"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")
_SIDECARS = ("json", "txt", "cls")


def split_key(name: str) -> tuple[str, str]:
    """(key, extension) of a file's path, as WebDataset splits it; a member of one of
    several shards, named ``shard.tar:member``, is split in its member's name (the
    shard's own dot is not its extension's)."""
    shard, tar, member = name.partition(".tar:")
    if not tar:
        shard, member = "", name
    folder, _, base = member.rpartition("/")
    stem, _, extension = base.partition(".")
    key = f"{folder}/{stem}" if folder else stem
    return (f"{shard}{tar}{key}" if tar else key), extension.lower()


def is_webdataset_folder(src: pathlib.Path) -> bool:
    """Whether the folder ``src`` holds ``.tar`` shards, or files grouped by key (an image
    beside a ``.json``, ``.txt`` or ``.cls`` of the same key) rather than class folders."""
    names = [e.name for e in os.scandir(src) if not e.name.startswith(".") and e.is_file()]
    if any(name.endswith(".tar") for name in names):
        return True
    groups: dict[str, set[str]] = collections.defaultdict(set)
    for name in names:
        key, extension = split_key(name)
        groups[key].add(extension)
    return any(exts & set(IMAGE_EXTENSIONS) and exts & set(_SIDECARS) for exts in groups.values())


def read_webdataset(src: pathlib.Path) -> SampleSource:
    """The samples of the folder or ``.tar`` shard(s) ``src``."""
    if src.is_file():
        shards = [src]
    else:
        shards = sorted(p for p in src.iterdir() if p.suffix == ".tar" and p.is_file())
    if shards:
        return _from_tars(shards, src)
    files = {
        p.relative_to(src).as_posix(): p
        for p in sorted(src.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(src).parts)
    }
    return _source(_groups(files), lambda member: read_file(files[member], member), close=None)


def _from_tars(shards: list[pathlib.Path], src: pathlib.Path) -> SampleSource:
    archives: list[tarfile.TarFile] = []
    members: dict[str, tuple[tarfile.TarFile, tarfile.TarInfo]] = {}
    try:
        for shard in shards:
            # Open until the source is closed; uncompressed, so members are read in place.
            archive = tarfile.open(shard, "r:")  # noqa: SIM115
            archives.append(archive)
            prefix = f"{shard.name}:" if len(shards) > 1 else ""
            for info in sorted(archive.getmembers(), key=lambda m: m.name):
                if info.isfile():
                    members[prefix + info.name] = (archive, info)
    except (OSError, tarfile.TarError) as exc:
        for archive in archives:
            archive.close()
        raise IngestError(f"cannot read {src} as uncompressed .tar shards: {exc}") from exc

    def read(name: str) -> bytes | Rejected:
        archive, info = members[name]
        try:
            handle = archive.extractfile(info)
            assert handle is not None  # a regular file's member
            return handle.read()
        except (OSError, tarfile.TarError) as exc:
            return Rejected(name, f"cannot read from the tar: {exc}")

    def close() -> None:
        for archive in archives:
            archive.close()

    return _source(_groups(members), read, close=close)


def _groups(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """Key → extension → member name, keys in sorted order."""
    groups: dict[str, dict[str, str]] = {}
    for name in names:
        key, extension = split_key(name)
        groups.setdefault(key, {})[extension] = name
    return dict(sorted(groups.items()))


def _source(
    groups: dict[str, dict[str, str]],
    read: Callable[[str], bytes | Rejected],
    *,
    close: Callable[[], None] | None,
) -> SampleSource:
    rejected: list[Rejected] = []
    kept: list[tuple[str, str, dict[str, object], object]] = []  # key, image, fields, label
    for key, files in groups.items():
        image = next((files[e] for e in IMAGE_EXTENSIONS if e in files), None)
        if image is None:
            if files.keys() & set(_SIDECARS):
                rejected.append(Rejected(key, "no .jpg, .jpeg or .png image for this key"))
            continue
        try:
            fields, label = _sidecars(files, read)
        except _Reject as exc:
            rejected.append(Rejected(image, str(exc)))
            continue
        kept.append((key, image, fields, label))
    if not kept:
        raise IngestError(
            "no samples found: a WebDataset sample is an image (key.jpg, ...) "
            "with key.json, key.txt or key.cls beside it"
        )
    columns = infer_columns([fields for _, _, fields, _ in kept])
    classes, labels = resolve_labels([label for *_, label in kept])
    rejected.extend(Rejected("(json)", why) for why in columns.dropped)
    samples = []
    for (_, image, _, _), values, label in zip(kept, columns.rows, labels, strict=True):
        reason = values if isinstance(values, str) else label if isinstance(label, str) else None
        if reason is not None:
            rejected.append(Rejected(image, reason))
            continue
        assert isinstance(values, dict) and isinstance(label, int)
        samples.append(SourceSample(relpath=image, label=label, fields=values))

    def read_sample(sample: SourceSample) -> bytes | Rejected:
        return read(sample.relpath)

    return SampleSource(
        classes=classes,
        specs=columns.specs,
        samples=tuple(samples),
        ignored=tuple(rejected),
        read=read_sample,
        close=close,
    )


class _Reject(Exception):
    """This group is left out, for the reason in the message."""


def _sidecars(
    files: dict[str, str], read: Callable[[str], bytes | Rejected]
) -> tuple[dict[str, object], object]:
    def text(extension: str) -> str:
        data = read(files[extension])
        if isinstance(data, Rejected):
            raise _Reject(f".{extension}: {data.reason}")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise _Reject(f".{extension} is not UTF-8 text") from None

    fields: dict[str, object] = {}
    if "json" in files:
        try:
            body = json.loads(text("json"))
        except json.JSONDecodeError as exc:
            raise _Reject(f".json is not JSON ({exc.msg})") from None
        if not isinstance(body, dict):
            raise _Reject(".json is not an object of fields")
        fields.update(body)
    if "txt" in files:
        fields["caption"] = text("txt").strip()
    label = text("cls").strip() if "cls" in files else None
    return fields, label
