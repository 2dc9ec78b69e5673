"""The fields of rows of plain values (JSON lines, CSV rows, WebDataset ``.json`` files):
each column's kind and shape inferred, each row's values made to fit, and its label.

A column's kind is what most rows hold: an int, a float (ints and floats together are
float), a list of numbers (an array; its shape is the rows' shapes, ``-1`` where they
differ), or text (a string, or a list of strings: a column holding both is a list of
strings, one string being a list of one). A row whose value is of another kind is
rejected with the reason; a missing value (absent, ``null``, an empty CSV cell) leaves the
field out of that sample. A column no row holds a plain value in (objects) is no field.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from batchwire.server.data.ingestion._sample_source import NO_LABEL
from batchwire.server.data.records import MAX_LABEL, FieldSpec
from batchwire.server.errors import DatasetError, IngestError

__all__ = ["Columns", "infer_columns", "resolve_labels"]

_Signature = tuple[str, int]  # (kind, ndim); kind "empty": an empty list, which fits any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Columns:
    """The fields of a table: their specs, and each row's values (name → value) or the
    reason the row is rejected; ``dropped`` names the columns that are no field, and why."""

    specs: tuple[FieldSpec, ...]
    rows: tuple[dict[str, object] | str, ...]
    dropped: tuple[str, ...] = ()


def infer_columns(
    rows: Sequence[Mapping[str, object]],
    *,
    parse: Callable[[object], object] = lambda value: value,
) -> Columns:
    """The fields of ``rows`` (each a mapping of column → raw value), in the order columns
    first appear. ``parse`` turns a raw value into a typed one (CSV's strings); where a
    column is text, a raw string is kept as it was. Raises ``IngestError`` for a column
    whose name cannot be a field's."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    typed = [{name: parse(value) for name, value in row.items()} for row in rows]
    specs: list[FieldSpec] = []
    dropped: list[str] = []
    values: list[dict[str, object] | str] = [{} for _ in rows]
    for name in names:
        signature = _column_signature([row.get(name) for row in typed])
        if signature is None:
            dropped.append(f"column {name!r} holds no numbers, lists or text")
            continue
        kind, ndim = signature
        shapes = []
        for i, (raw, row) in enumerate(zip(rows, typed, strict=True)):
            value = row.get(name)
            if value is None or isinstance(values[i], str):
                continue
            fitted = _fit(raw.get(name), value, kind, ndim)
            if isinstance(fitted, _Misfit):
                values[i] = f"field {name!r} {fitted.why}"
                continue
            row_values = values[i]
            assert isinstance(row_values, dict)
            row_values[name] = fitted
            if isinstance(fitted, np.ndarray):
                # An empty list's shape says only that it holds no rows.
                shapes.append(fitted.shape if fitted.size else (0,) + (-2,) * (ndim - 1))
        shape = (-1,) if kind == "text" and ndim else _shape(shapes, ndim)
        if kind != "text" and ndim > 1:  # an empty list: no rows of the column's row shape
            empty = (0, *(max(n, 0) for n in shape[1:]))
            for row_values in values:
                found = row_values.get(name) if isinstance(row_values, dict) else None
                if isinstance(found, np.ndarray) and found.size == 0:
                    row_values[name] = found.reshape(empty)  # type: ignore[index]
        try:
            specs.append(FieldSpec(name=name, kind=kind, shape=shape))
        except DatasetError as exc:
            raise IngestError(f"{exc}: rename the column") from None
    return Columns(specs=tuple(specs), rows=tuple(values), dropped=tuple(dropped))


def resolve_labels(
    values: Sequence[object | None],
) -> tuple[tuple[str, ...], list[int | str]]:
    """The classes and each row's label (or why it is rejected) of a label column: all
    integers are class indices (classes ``"0"`` .. the largest); otherwise every value is a
    class name (classes sorted, labels 0..C-1). A missing value is ``NO_LABEL``."""
    present = [v for v in values if v is not None and v != ""]
    if not present:
        return (), [NO_LABEL] * len(values)
    indices = [_index(v) for v in present]
    if all(i is not None for i in indices):
        labels: list[int | str] = []
        for value in values:
            index = _index(value) if value is not None and value != "" else NO_LABEL
            assert index is not None
            ok = index == NO_LABEL or 0 <= index <= MAX_LABEL
            labels.append(index if ok else f"label {index} is outside 0..{MAX_LABEL}")
        top = max((i for i in indices if i is not None), default=-1)
        return tuple(str(i) for i in range(max(top, 0) + 1)), labels
    classes = tuple(sorted({str(v) for v in present}))
    at = {name: i for i, name in enumerate(classes)}
    return classes, [NO_LABEL if v is None or v == "" else at[str(v)] for v in values]


def _index(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _signature(value: object) -> _Signature:
    if isinstance(value, bool | int):
        return ("int", 0)
    if isinstance(value, float):
        return ("float", 0)
    if isinstance(value, str):
        return ("text", 0)
    if isinstance(value, list | tuple):
        if value and all(isinstance(v, str) for v in value):
            return ("text", 1)
        try:
            array = np.asarray(value)
        except ValueError:  # ragged
            return ("invalid", 0)
        if array.size == 0 and array.dtype != object:
            return ("empty", array.ndim)
        if array.dtype.kind in "biu":
            return ("int", array.ndim)
        if array.dtype.kind == "f":
            return ("float", array.ndim)
    return ("invalid", 0)


def _column_signature(values: list[object]) -> _Signature | None:
    counts = collections.Counter(_signature(v) for v in values if v is not None)
    for ndim in {n for _, n in counts}:
        if ("int", ndim) in counts and ("float", ndim) in counts:
            counts[("float", ndim)] += counts.pop(("int", ndim))
    if ("text", 0) in counts and ("text", 1) in counts:
        counts[("text", 1)] += counts.pop(("text", 0))
    for unusable in [s for s in counts if s[0] in ("invalid", "empty")]:
        del counts[unusable]
    return counts.most_common(1)[0][0] if counts else None


@dataclasses.dataclass(frozen=True)
class _Misfit:
    """Why a value does not fit its column: a phrase after the field's name."""

    why: str


def _fit(raw: object, value: object, kind: str, ndim: int) -> object:
    """``value`` as the column's kind, or why it is not (:class:`_Misfit`)."""
    got, got_ndim = _signature(value)
    if kind == "text":
        if got == "text" and got_ndim == 1 and ndim:
            return tuple(value)  # type: ignore[arg-type]
        if got == "empty" and ndim:
            return ()
        text = raw if isinstance(raw, str) else value
        if isinstance(text, str):
            return (text,) if ndim else text
    elif got == "empty" and ndim >= 1:
        return np.zeros((0,) * ndim, dtype=np.int64 if kind == "int" else np.float32)
    elif got_ndim == ndim and (got == kind or (kind == "float" and got == "int")):
        return np.asarray(value, dtype=np.int64 if kind == "int" else np.float32)
    shape = "" if kind == "text" or not ndim else f" of {ndim} dimensions"
    return _Misfit(f"is {_describe(value)}, not {kind}{shape} like the rest of its column")


def _shape(shapes: list[tuple[int, ...]], ndim: int) -> tuple[int, ...]:
    """The column's shape: each dimension's size where every row agrees, else -1 (-2: an
    empty row's unknown size, which agrees with any)."""
    shape = []
    for d in range(ndim):
        sizes = {s[d] for s in shapes if len(s) == ndim} - {-2}
        shape.append(sizes.pop() if len(sizes) == 1 else -1)
    return tuple(shape)


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
