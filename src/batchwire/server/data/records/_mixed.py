"""Several datasets read as one, by mixed ids (:mod:`batchwire.common.mixture`): what a
stream over a mixture reads its batches from.

A batch of mixed ids is split by source and each source's records are read and screened by
its own :class:`Dataset` (one ``pread`` a record into that source's buffer, as for one
dataset), then put back in the batch's order: the images stay views of those buffers, so a
mixed batch reaches DALI with no copy more than one dataset's. Labels are each source's
own (the mixed id says which source); a record left out is reported by its mixed id.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np

from batchwire.common.mixture import split_ids
from batchwire.server.data.records._dataset import Dataset
from batchwire.server.data.records._fields import FieldValue

__all__ = ["MixedDataset", "Records"]


class Records(Protocol):
    """What a stream reads its batches from: one :class:`Dataset`, or a
    :class:`MixedDataset` (ids are then mixed ids)."""

    @property
    def name(self) -> str: ...

    @property
    def num_samples(self) -> int: ...

    @property
    def waited(self) -> float: ...

    def read_screened(
        self, ids: np.ndarray
    ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[int]]: ...

    def locate(self, ids: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]: ...

    def read_screened_fields(
        self, ids: np.ndarray, names: Collection[str] | None = None
    ) -> tuple[
        np.ndarray, list[np.ndarray], np.ndarray, list[int], list[dict[str, FieldValue]]
    ]: ...


class MixedDataset:
    """``sources`` read as one dataset whose mixed id ``offsets_of(sizes)[s] + i`` is
    sample ``i`` of source ``s`` (:mod:`batchwire.common.mixture`). The sources stay the
    caller's to close."""

    def __init__(self, sources: Sequence[Dataset]) -> None:
        if not sources:
            raise ValueError("a mixture needs at least one source")
        self.sources = tuple(sources)
        self.sizes = tuple(source.num_samples for source in self.sources)
        self._ends = list(itertools.accumulate(self.sizes))  # each source's last id + 1

    @property
    def name(self) -> str:
        return "+".join(source.name for source in self.sources)

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    @property
    def waited(self) -> float:
        """Seconds the calling thread's reads waited for the disk, over every source."""
        return sum(source.waited for source in self.sources)

    def locate(self, ids: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
        """:meth:`Dataset.locate` of mixed ids, source by source."""
        sources, local = split_ids(np.asarray(ids, dtype=np.int64), self.sizes)
        spans: list[tuple[int, int, int]] = []
        for source in np.unique(sources).tolist():
            spans += self.sources[source].locate(local[sources == source])
        return spans

    def read_screened(
        self, ids: np.ndarray
    ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[int]]:
        """:meth:`Dataset.read_screened` of a batch of mixed ids: the mixed ids that may
        reach a decoder, their encoded images and labels (each in its source's classes),
        in the batch's order, and the mixed ids left out."""
        kept, images, labels, skipped, _ = self._read_screened(ids, False)
        return kept, images, labels, skipped

    def read_screened_fields(
        self, ids: np.ndarray, names: Collection[str] | None = None
    ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[int], list[dict[str, FieldValue]]]:
        """:meth:`read_screened`, and each kept record's fields (``Dataset.fields``; those
        of ``names`` only, where given)."""
        return self._read_screened(ids, True, names)

    def _read_screened(
        self, ids: np.ndarray, with_fields: bool, names: Collection[str] | None = None
    ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, list[int], list[dict[str, FieldValue]]]:
        ids = np.asarray(ids, dtype=np.int64)
        sources, local = split_ids(ids, self.sizes)
        # Each record asked for is kept or left out by its source: where the kept ones lie
        # in the batch says both.
        kept = np.zeros(len(ids), dtype=bool)
        position_of_kept: list[np.ndarray] = []
        images: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        fields: list[dict[str, FieldValue]] = []
        for source in range(len(self.sources)):
            positions = np.flatnonzero(sources == source)
            if not len(positions):
                continue
            dataset = self.sources[source]
            found_ids, found, found_labels, _, found_fields = (
                dataset.read_screened_fields(local[positions], names)
                if with_fields
                else (*dataset.read_screened(local[positions]), [])
            )
            position_of_kept.append(positions[_kept_positions(local[positions], found_ids)])
            images += found
            labels.append(found_labels)
            fields += found_fields
        if not position_of_kept:
            return ids[:0], [], np.zeros(0, dtype=np.int64), [], []
        kept_positions = np.concatenate(position_of_kept)
        order = np.argsort(kept_positions, kind="stable").tolist()
        kept[kept_positions] = True
        return (
            ids[kept],
            [images[i] for i in order],
            np.concatenate(labels)[order],
            ids[~kept].tolist(),
            [fields[i] for i in order] if with_fields else [],
        )


def _kept_positions(asked: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Where in ``asked`` the ids ``kept`` (a subsequence of it, in order) lie. An id asked
    twice (an upsampled source) is kept or left out both times, as both are one record."""
    positions = np.empty(len(kept), dtype=np.int64)
    at = 0
    kept_list = kept.tolist()
    for position, sample in enumerate(asked.tolist()):
        if at < len(kept_list) and sample == kept_list[at]:
            positions[at] = position
            at += 1
    if at != len(kept_list):
        raise AssertionError("read_screened kept ids that were not asked for, or out of order")
    return positions
