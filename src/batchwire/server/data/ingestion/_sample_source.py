"""Samples with named fields as an ingest source: what the COCO, JSON-lines/CSV and
WebDataset readers make of their input, for the dataset writer.

A :class:`SampleSource` holds its samples in id order, each an image to read and the
values of its fields, with the fields' schema (``FieldSpec``: kind, shape, format; their
counts are the writer's to fill in) and the classes. Whatever a reader found wrong up
front (a row with a field of the wrong kind, a group without an image) is in ``ignored``.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Iterator, Mapping

from batchwire.server.data.ingestion._batches import Rejected, bounded_batches
from batchwire.server.data.ingestion._file_sources import read_file
from batchwire.server.data.records import FieldSpec

__all__ = ["NO_LABEL", "SampleSource", "SourceSample"]

NO_LABEL = -1  # the label of a sample with no image-level class (a detection dataset's)


@dataclasses.dataclass(frozen=True, slots=True)
class SourceSample:
    """One candidate sample: ``relpath`` names it in reports; its image is read from
    ``path`` (or by the source's reader); ``fields`` maps a declared field's name to this
    sample's value (a field a sample lacks is left out)."""

    relpath: str
    label: int
    fields: Mapping[str, object]
    path: pathlib.Path | None = None


class SampleSource:
    """Samples with fields, in id order; iterate :meth:`batches` once, then :meth:`close`.

    ``read`` gives a sample's encoded image (default: the file at its ``path``); ``close``
    releases what the reader holds open (a tar file).
    """

    def __init__(
        self,
        *,
        classes: tuple[str, ...] | None,
        specs: tuple[FieldSpec, ...],
        samples: tuple[SourceSample, ...],
        ignored: tuple[Rejected, ...] = (),
        class_ids: tuple[int, ...] = (),
        read: Callable[[SourceSample], bytes | Rejected] | None = None,
        close: Callable[[], None] | None = None,
    ) -> None:
        self.classes = classes
        self.specs = specs
        self.samples = samples
        self.ignored = ignored
        self.class_ids = class_ids
        self._read = read or _read_path
        self._close = close

    @property
    def total(self) -> int:
        """How many samples there are to read (for progress)."""
        return len(self.samples)

    def kinds(self) -> dict[str, str]:
        """Each declared field's kind, by name."""
        return {spec.name: spec.kind for spec in self.specs}

    def batches(
        self, batch_size: int
    ) -> Iterator[tuple[list[tuple[SourceSample, bytes]], list[Rejected]]]:
        """Samples whose image could be read, in id order, in bounded batches, with those
        whose image could not."""
        return bounded_batches(self._entries(), batch_size)

    def _entries(self) -> Iterator[tuple[SourceSample, bytes] | Rejected]:
        for sample in self.samples:
            data = self._read(sample)
            yield (sample, data) if isinstance(data, bytes) else data

    def close(self) -> None:
        if self._close is not None:
            self._close()


def _read_path(sample: SourceSample) -> bytes | Rejected:
    if sample.path is None:
        return Rejected(sample.relpath, "no image file")
    return read_file(sample.path, sample.relpath)
