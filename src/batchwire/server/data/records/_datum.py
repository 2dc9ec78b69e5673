"""A Caffe ``Datum``'s image bytes and label found in place, without building a message.

protobuf's Python runtime copies the ``data`` field when it parses a record and again when
the field is read; for an 80 KB photo that is most of the record path's time. A Datum is a
handful of fields, so its wire format is walked here (tags and lengths only) and the image
is returned as a span of the record's own buffer. The fields (``caffe.proto``): channels 1,
height 2, width 3, data 4, label 5, float_data 6, encoded 7; as protobuf does, the last
occurrence of a field wins. batchwire's own ``fields`` (100, a ``Fields`` message) is found
the same way, by :func:`datum_fields`, only when a caller asks for a record's fields.
"""

from __future__ import annotations

__all__ = ["datum_fields", "datum_image"]

_DATA, _LABEL, _FIELDS = 4, 5, 100
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def _varint(record: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = record[at]  # IndexError past the end: a truncated record
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than ten bytes")


def datum_image(record: memoryview) -> tuple[int, int, int] | None:
    """(start, end, label) of the encoded image in the Datum bytes ``record`` (a uint8
    memoryview), or None where ``record`` is not a Datum holding image bytes (protobuf
    would fail to parse it, or its ``data`` is empty)."""
    start = end = label = 0
    at, size = 0, len(record)
    try:
        while at < size:
            tag, at = _varint(record, at)
            if tag > 0xFFFFFFFF:  # a field number past protobuf's 2**29 - 1
                return None
            number, wire = tag >> 3, tag & 7
            if wire == _VARINT:
                value, at = _varint(record, at)
                if number == _LABEL:  # an int32: the low 32 bits, signed
                    label = (value & 0xFFFFFFFF) - ((value & 0x80000000) << 1)
            elif wire == _LENGTH_DELIMITED:
                length, at = _varint(record, at)
                if at + length > size:
                    return None
                if number == _DATA:
                    start, end = at, at + length
                at += length
            elif wire == _FIXED64:
                at += 8
            elif wire == _FIXED32:
                at += 4
            else:
                return None  # groups (3, 4) and 6, 7: not in a Datum
            if number == 0 or at > size:
                return None
    except (IndexError, ValueError):
        return None
    if end == start:
        return None
    return start, end, label


def datum_fields(record: memoryview) -> memoryview | None:
    """The serialized ``Fields`` message in the Datum bytes ``record``: a view of
    ``record``, or None where the record has no fields (every record written before they
    existed) or is not a Datum. The walk reads tags and lengths only, so a record without
    fields costs a few varints, whatever its image's size."""
    found: memoryview | None = None
    at, size = 0, len(record)
    try:
        while at < size:
            tag, at = _varint(record, at)
            number, wire = tag >> 3, tag & 7
            if wire == _VARINT:
                _, at = _varint(record, at)
            elif wire == _LENGTH_DELIMITED:
                length, at = _varint(record, at)
                if at + length > size:
                    return None
                if number == _FIELDS:
                    found = record[at : at + length]
                at += length
            elif wire in (_FIXED64, _FIXED32):
                at += 8 if wire == _FIXED64 else 4
            else:
                return None
            if number == 0 or at > size:
                return None
    except (IndexError, ValueError):
        return None
    return found
