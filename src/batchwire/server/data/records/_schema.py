"""A dataset's schema: the named fields its records hold beside the image and label, as its
``manifest.json`` declares them.

In the manifest, ``fields`` maps each name to its spec::

    "fields": {
      "boxes": {"kind": "float", "dtype": "float32", "shape": [-1, 4], "format": "ltrb",
                "along": "", "samples": 5, "count_min": 1, "count_max": 3, "count_total": 9},
      "labels": {"kind": "int", "dtype": "int64", "shape": [-1], "format": "class",
                 "along": "boxes", ...},
      "caption": {"kind": "text", "dtype": "str", "shape": [-1], ...}
    }

``shape`` is a sample's shape, ``-1`` where it varies from sample to sample (a ragged
dimension); ``[]`` is one value. ``format`` says how to read the numbers where that is not
plain: ``"ltrb"`` is a box as absolute pixel ``[left, top, right, bottom]`` (float32, the one
stored box form), ``"class"`` an index into the manifest's ``classes``. ``along`` names the
field whose entries this one's first dimension follows (a box's class follows the boxes:
drop a box, drop its class). The counts are what ingest stored: how many samples hold the
field, and the length of its first dimension per sample (boxes per image, captions per
image), smallest, largest and summed. A manifest without ``fields`` (every dataset made
before them) declares none.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from batchwire.server.errors import DatasetError

__all__ = ["BOX_FORMAT", "CLASS_FORMAT", "DTYPES", "FieldSpec", "specs_from_json", "specs_to_json"]

# A field's kind, and the dtype its values have when read (records._fields).
DTYPES = {"int": "int64", "float": "float32", "text": "str", "bytes": "bytes", "image": "bytes"}
BOX_FORMAT = "ltrb"  # absolute pixels, [left, top, right, bottom]
CLASS_FORMAT = "class"  # an index into the manifest's classes
_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """One named field of a dataset's samples (the module docstring says what each means).

    ``kind`` is one of :data:`DTYPES`; ``shape`` a sample's shape with ``-1`` for a ragged
    dimension. Raises :class:`DatasetError` for a spec that could not describe a field.
    """

    name: str
    kind: str
    shape: tuple[int, ...] = ()
    format: str = ""
    along: str = ""
    samples: int = 0
    count_min: int = 0
    count_max: int = 0
    count_total: int = 0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise DatasetError(
                f"manifest: field name {self.name!r} is not allowed: use letters, digits, "
                "'_', '.' or '-', starting with a letter or '_' (at most 64 characters)"
            )
        if self.kind not in DTYPES:
            raise DatasetError(
                f"manifest: field {self.name!r} has kind {self.kind!r}, not one of "
                f"{', '.join(DTYPES)}"
            )
        if any(n < -1 for n in self.shape):
            raise DatasetError(f"manifest: field {self.name!r} has shape {list(self.shape)}")
        if self.format == BOX_FORMAT and (self.kind != "float" or self.shape != (-1, 4)):
            raise DatasetError(
                f"manifest: field {self.name!r} holds boxes ({BOX_FORMAT}): it must be float "
                "of shape [-1, 4]"
            )

    @property
    def dtype(self) -> str:
        """The dtype of the field's values when read: int64, float32, str or bytes."""
        return DTYPES[self.kind]

    @property
    def count_mean(self) -> float:
        """The mean length of the field's first dimension over the samples holding it."""
        return self.count_total / self.samples if self.samples else 0.0


def specs_to_json(specs: tuple[FieldSpec, ...]) -> dict[str, dict[str, Any]]:
    """The manifest's ``fields`` object: name → spec, in declaration order."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        body = dataclasses.asdict(spec)
        del body["name"]
        out[spec.name] = {"kind": spec.kind, "dtype": spec.dtype, **body}
        out[spec.name]["shape"] = list(spec.shape)
    return out


def specs_from_json(body: Mapping[str, Any]) -> tuple[FieldSpec, ...]:
    """The specs of a manifest's ``fields`` object; :class:`DatasetError` if one is bad."""
    if not isinstance(body, Mapping):
        raise DatasetError("manifest: fields must be an object of name: spec")
    specs = []
    for name, spec in body.items():
        try:
            specs.append(
                FieldSpec(
                    name=str(name),
                    kind=str(spec["kind"]),
                    shape=tuple(int(n) for n in spec.get("shape", ())),
                    format=str(spec.get("format", "")),
                    along=str(spec.get("along", "")),
                    samples=int(spec.get("samples", 0)),
                    count_min=int(spec.get("count_min", 0)),
                    count_max=int(spec.get("count_max", 0)),
                    count_total=int(spec.get("count_total", 0)),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DatasetError(f"manifest: field {name!r} is malformed: {exc}") from exc
        if "dtype" in spec and spec["dtype"] != specs[-1].dtype:
            raise DatasetError(
                f"manifest: field {name!r} of kind {specs[-1].kind} has dtype "
                f"{spec['dtype']!r}, expected {specs[-1].dtype!r}"
            )
    return tuple(specs)
