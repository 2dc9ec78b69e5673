"""A sample's fields as a record holds them (``Datum.fields``, a ``Fields`` message) and as
Python sees them.

A field's value, read (:func:`decode_fields`) or to write (:func:`encode_fields`):

- ``int``: an int64 ndarray of the sample's shape (0-d for one number);
- ``float``: a float32 ndarray likewise (boxes: ``[n, 4]``);
- ``text``: a ``str`` (shape ``[]``) or a tuple of them (shape ``[n]``: n captions);
- ``bytes`` and ``image``: ``bytes`` or a tuple of them (an image is encoded: PNG, JPEG).

Reading a record's fields parses only its ``fields`` (found in place by the Datum walk,
``datum_fields``): a record without fields costs a few varints and no protobuf.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from batchwire.server.data.records._datum import datum_fields
from batchwire.v1 import datum_pb2

__all__ = ["FieldValue", "decode_fields", "encode_field", "encode_fields"]

FieldValue = np.ndarray | str | bytes | tuple[str, ...] | tuple[bytes, ...]

_KINDS = {
    "int": datum_pb2.Field.INT,
    "float": datum_pb2.Field.FLOAT,
    "text": datum_pb2.Field.TEXT,
    "bytes": datum_pb2.Field.BYTES,
    "image": datum_pb2.Field.IMAGE,
}
_NAMES = {number: kind for kind, number in _KINDS.items()}


def encode_field(name: str, kind: str, value: object) -> datum_pb2.Field:
    """The ``Field`` message of one value of ``kind`` (see the module docstring for what
    each kind takes; numbers may be any nested sequence numpy reads as a rectangular
    array). Raises ``ValueError`` for a value that is not of ``kind``."""
    field = datum_pb2.Field(name=name, kind=_KINDS[kind])
    if kind in ("int", "float"):
        array = np.asarray(value)
        if array.dtype == object or not (
            array.size == 0
            or np.issubdtype(array.dtype, np.integer)
            or np.issubdtype(array.dtype, np.bool_)
            or (kind == "float" and np.issubdtype(array.dtype, np.floating))
        ):
            raise ValueError(f"{name}: {_describe(value)} is not {kind} numbers")
        field.shape.extend(array.shape)
        if kind == "int":
            field.ints.extend(array.astype(np.int64).ravel().tolist())
        else:
            field.floats.extend(array.astype(np.float32).ravel().tolist())
        return field
    wanted: type = str if kind == "text" else bytes
    items = [value] if isinstance(value, wanted) else value
    if not isinstance(items, Sequence) or not all(isinstance(v, wanted) for v in items):
        raise ValueError(f"{name}: {_describe(value)} is not {kind}")
    if not isinstance(value, wanted):
        field.shape.append(len(items))
    field.values.extend(v.encode("utf-8") if isinstance(v, str) else v for v in items)
    return field


def encode_fields(fields: Mapping[str, tuple[str, object]]) -> datum_pb2.Fields:
    """The ``Fields`` message of name → (kind, value), in order (see :func:`encode_field`)."""
    return datum_pb2.Fields(
        field=[encode_field(name, kind, value) for name, (kind, value) in fields.items()]
    )


def decode_fields(
    record: bytes | memoryview, names: Collection[str] | None = None
) -> dict[str, FieldValue]:
    """The fields of the Datum bytes ``record`` (those of ``names`` only, where given),
    name → value (see the module docstring); empty for a record without fields or one
    that is not a Datum. Raises ``ValueError`` for fields that are not a valid ``Fields``
    message (a record damaged on disk)."""
    span = datum_fields(memoryview(record).cast("B"))
    if span is None:
        return {}
    message = datum_pb2.Fields()
    try:
        message.ParseFromString(span.tobytes())
    except Exception as exc:  # protobuf's DecodeError, by backend
        raise ValueError(f"a record's fields do not parse: {exc}") from None
    return {
        field.name: _value(field) for field in message.field if names is None or field.name in names
    }


def _value(field: datum_pb2.Field) -> FieldValue:
    kind = _NAMES.get(field.kind)
    shape = tuple(field.shape)
    if kind in ("text", "bytes", "image") and not shape and len(field.values) != 1:
        raise ValueError(f"field {field.name!r} holds {len(field.values)} values, not one")
    # fromiter: NumPy reads protobuf's repeated field as an iterable, not a sequence it
    # must first inspect (a third of the time, for a record's handful of boxes).
    if kind == "int":
        return np.fromiter(field.ints, np.int64, len(field.ints)).reshape(shape)
    if kind == "float":
        return np.fromiter(field.floats, np.float32, len(field.floats)).reshape(shape)
    if kind == "text":
        texts = tuple(v.decode("utf-8", errors="replace") for v in field.values)
        return texts if shape else texts[0]
    if kind in ("bytes", "image"):
        return tuple(field.values) if shape else field.values[0]
    raise ValueError(f"field {field.name!r} has an unknown kind {field.kind}")


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
