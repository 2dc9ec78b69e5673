"""What a new dataset's fields hold, counted as its samples are written: the counts of each
field's spec (samples holding it, and the length of its first dimension per sample), and
the classes a ``class`` field names (a detection dataset's boxes per class)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from batchwire.server.data.records import CLASS_FORMAT, FieldSpec

__all__ = ["FieldTally"]


class FieldTally:
    """Counts of the fields declared by ``specs``, sample by sample."""

    def __init__(self, specs: tuple[FieldSpec, ...]) -> None:
        self._specs = specs
        self._samples = dict.fromkeys((s.name for s in specs), 0)
        self._min: dict[str, int] = {}
        self._max = dict.fromkeys((s.name for s in specs), 0)
        self._total = dict.fromkeys((s.name for s in specs), 0)

    def accept(self, fields: Mapping[str, object], counts: list[int]) -> None:
        """Count one written sample's ``fields``; add each class a ``class`` field names to
        ``counts`` (per class index, grown as needed)."""
        for spec in self._specs:
            if spec.name not in fields:
                continue
            value = fields[spec.name]
            length = len(value) if isinstance(value, tuple) else _leading(value)
            self._samples[spec.name] += 1
            self._min[spec.name] = min(self._min.get(spec.name, length), length)
            self._max[spec.name] = max(self._max[spec.name], length)
            self._total[spec.name] += length
            if spec.format == CLASS_FORMAT and isinstance(value, np.ndarray):
                for label in value.ravel().tolist():
                    if label >= len(counts):
                        counts.extend([0] * (label + 1 - len(counts)))
                    counts[label] += 1

    def specs(self) -> tuple[FieldSpec, ...]:
        """The declared specs with their counts."""
        return tuple(
            dataclasses.replace(
                spec,
                samples=self._samples[spec.name],
                count_min=self._min.get(spec.name, 0),
                count_max=self._max[spec.name],
                count_total=self._total[spec.name],
            )
            for spec in self._specs
        )


def _leading(value: object) -> int:
    """The length of a value's first dimension: 1 for one number, string or blob."""
    shape = np.shape(value) if isinstance(value, np.ndarray | np.generic) else ()
    return int(shape[0]) if shape else 1
