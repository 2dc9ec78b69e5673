r"""A dataset's ``manifest.json``: what it records of the dataset (:class:`Manifest`: its
name, samples, classes and their counts, its :class:`Shard`\ s, the fields its records
hold), the checks it passes as it is read, and the dataset's version, which the
manifest's bytes name (:func:`manifest_version`). ``_dataset.py`` opens the shards it
lists."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Any

from batchwire.common.stream import NAME_PATTERN
from batchwire.server.data.records._schema import FieldSpec, specs_from_json, specs_to_json
from batchwire.server.errors import DatasetError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "NAME_PATTERN",
    "Manifest",
    "Shard",
    "manifest_bytes",
    "manifest_version",
]

MANIFEST = "manifest.json"
FORMAT = "batchwire-dataset"
FORMAT_VERSION = 1


def manifest_version(manifest: bytes) -> str:
    """A dataset's version: the first 12 hex digits of the sha256 of its manifest's bytes.

    Every ingest writes a new manifest (with its own ``created`` stamp), so a dataset
    ingested again under the same name, even from the same images, gets a new version.
    """
    return hashlib.sha256(manifest).hexdigest()[:12]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shard:
    """One LMDB environment directory holding ids ``[first_id, first_id + count)``."""

    path: str
    first_id: int
    count: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``manifest.json`` records about a dataset.

    ``fields`` declares the named fields its records hold (``_schema``; none in a manifest
    written before fields existed); ``class_ids`` are the source's own ids of ``classes``
    where it had some (COCO's category ids), else empty. Both are left out of the JSON
    when empty, so a dataset without them is written as before, and they need no new
    ``format_version``: a reader that does not know them reads image and label as ever.
    """

    name: str
    num_samples: int
    classes: tuple[str, ...]
    class_counts: tuple[int, ...]
    shards: tuple[Shard, ...]
    total_bytes: int = 0
    source: str = ""
    created: str = ""
    rejected: tuple[dict[str, str], ...] = ()
    fields: tuple[FieldSpec, ...] = ()
    class_ids: tuple[int, ...] = ()
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise DatasetError(
                f"dataset name {self.name!r} is not allowed: use letters, digits, '.', '_' or '-' "
                "(at most 128 characters, starting with a letter or digit)"
            )
        if len(self.class_counts) != len(self.classes):
            raise DatasetError("manifest: class_counts and classes differ in length")
        if self.class_ids and len(self.class_ids) != len(self.classes):
            raise DatasetError("manifest: class_ids and classes differ in length")
        names = [spec.name for spec in self.fields]
        for spec in self.fields:
            if names.count(spec.name) > 1:
                raise DatasetError(f"manifest: field {spec.name!r} is declared twice")
            if spec.along and spec.along not in names:
                raise DatasetError(
                    f"manifest: field {spec.name!r} follows {spec.along!r}, which is not a field"
                )
        expected = 0
        for shard in self.shards:
            if shard.first_id != expected or shard.count < 0:
                raise DatasetError(
                    f"manifest: shard {shard.path!r} starts at id {shard.first_id}, expected {expected}"
                )
            if not NAME_PATTERN.match(shard.path):
                raise DatasetError(f"manifest: shard path {shard.path!r} must be a plain name")
            expected += shard.count
        if expected != self.num_samples:
            raise DatasetError(
                f"manifest: shards hold {expected} samples but num_samples is {self.num_samples}"
            )

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        body["fields"] = specs_to_json(self.fields)
        for optional in ("fields", "class_ids"):
            if not body[optional]:
                del body[optional]
        body = {"format": FORMAT, **body}
        return json.dumps(body, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            body: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"manifest is not valid JSON: {exc}") from exc
        if body.get("format") != FORMAT:
            raise DatasetError(f"manifest format is {body.get('format')!r}, expected {FORMAT!r}")
        version = body.get("format_version")
        if version != FORMAT_VERSION:
            raise DatasetError(
                f"manifest format_version {version} is not supported (this batchwire reads "
                f"{FORMAT_VERSION}); ingest the data again with this version"
            )
        try:
            return cls(
                name=str(body["name"]),
                num_samples=int(body["num_samples"]),
                classes=tuple(str(c) for c in body["classes"]),
                class_counts=tuple(int(c) for c in body["class_counts"]),
                shards=tuple(
                    Shard(path=str(s["path"]), first_id=int(s["first_id"]), count=int(s["count"]))
                    for s in body["shards"]
                ),
                total_bytes=int(body.get("total_bytes", 0)),
                source=str(body.get("source", "")),
                created=str(body.get("created", "")),
                rejected=tuple(dict(r) for r in body.get("rejected", ())),
                fields=specs_from_json(body.get("fields", {})),
                class_ids=tuple(int(i) for i in body.get("class_ids", ())),
                format_version=int(version),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"manifest is missing or has a bad field: {exc}") from exc

    @classmethod
    def load(cls, directory: pathlib.Path) -> Manifest:
        return cls.from_json(manifest_bytes(directory).decode("utf-8", errors="replace"))


def manifest_bytes(directory: pathlib.Path) -> bytes:
    """The bytes of the manifest of the dataset in ``directory``, as its version hashes
    them (``DatasetError`` where it cannot be read)."""
    path = directory / MANIFEST
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from exc
