"""A JSON-lines or CSV manifest of images and their fields as an ingest source.

Each row (a JSON object a line, or a CSV row under its header) names an image by
``path`` (required; relative to ``images_dir``, by default the manifest's folder) and
may give a ``label`` (a class name, or a class index: ``_field_kinds.resolve_labels``).
Every other column is a field, its kind inferred from the values (``_field_kinds``): a
row with a value of the wrong kind for its column is rejected with the reason. CSV cells
are read as JSON where they parse as a number or a list (``[1, 2]``), else as text; an
empty cell is a missing value.
"""

from __future__ import annotations

import csv
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence

from batchwire.server.data.ingestion._batches import Rejected
from batchwire.server.data.ingestion._field_kinds import infer_columns, resolve_labels
from batchwire.server.data.ingestion._sample_source import SampleSource, SourceSample
from batchwire.server.errors import IngestError

__all__ = ["read_csv", "read_jsonl", "table_source"]


def read_jsonl(path: pathlib.Path, images_dir: pathlib.Path) -> SampleSource:
    """The samples of the JSON-lines file ``path`` (blank lines skipped)."""
    rows: list[Mapping[str, object]] = []
    for lineno, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise IngestError(f"{path}, line {lineno}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise IngestError(f"{path}, line {lineno}: expected an object, got {line:.60}")
        rows.append(row)
    return table_source(rows, path, images_dir)


def read_csv(path: pathlib.Path, images_dir: pathlib.Path) -> SampleSource:
    """The samples of the CSV file ``path``: a header row, then a row per image."""
    reader = csv.DictReader(_lines(path))
    rows = [{k: v for k, v in row.items() if k is not None and v != ""} for row in reader]
    return table_source(rows, path, images_dir, parse=_cell)


def table_source(
    rows: Sequence[Mapping[str, object]],
    path: pathlib.Path,
    images_dir: pathlib.Path,
    *,
    parse: Callable[[object], object] | None = None,
) -> SampleSource:
    """The samples of ``rows`` read from the manifest ``path``, in row order."""
    if not rows:
        raise IngestError(f"{path} lists no images")
    for number, row in enumerate(rows, start=1):
        if not isinstance(row.get("path"), str) or not row["path"]:
            raise IngestError(f"{path}, row {number}: every row needs a 'path' to its image")
    fields = [{k: v for k, v in row.items() if k not in ("path", "label")} for row in rows]
    columns = infer_columns(fields) if parse is None else infer_columns(fields, parse=parse)
    classes, labels = resolve_labels([row.get("label") for row in rows])
    samples, rejected = [], [Rejected(path.name, why) for why in columns.dropped]
    for row, values, label in zip(rows, columns.rows, labels, strict=True):
        relpath = str(row["path"])
        reason = values if isinstance(values, str) else label if isinstance(label, str) else None
        if reason is not None:
            rejected.append(Rejected(relpath, reason))
            continue
        assert isinstance(values, dict) and isinstance(label, int)
        samples.append(
            SourceSample(relpath=relpath, label=label, fields=values, path=images_dir / relpath)
        )
    return SampleSource(
        classes=classes, specs=columns.specs, samples=tuple(samples), ignored=tuple(rejected)
    )


def _lines(path: pathlib.Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise IngestError(f"cannot read {path}: {exc}") from exc


def _cell(value: object) -> object:
    """A CSV cell as JSON where it is a number or a list, else the text as it is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text[:1] in "[-0123456789.":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return value
