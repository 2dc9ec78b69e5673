"""Source items in validation batches, bounded by count and bytes, with those left out.

Every ingest source (files on disk, the records of an LMDB) yields its items in
id order as ``(item, encoded image)`` or as :class:`Rejected` (left out, and
why); :func:`bounded_batches` groups them for the image validator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["BATCH_BYTES", "Rejected", "bounded_batches"]

# A validation batch also stops growing at this many encoded bytes.
BATCH_BYTES = 8 << 20

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Rejected:
    """A source item left out of the dataset: ``path`` is relative to SRC (or an LMDB key).

    ``part`` names what of the sample was left out where the sample itself was kept (a
    bad box: ``"box 2"``, an annotation: ``"annotation 17"``); empty where the whole
    sample was.
    """

    path: str
    reason: str
    part: str = ""

    def as_json(self) -> dict[str, str]:
        """The manifest's entry: path and reason, and part where there is one."""
        entry = {"path": self.path, "reason": self.reason}
        return entry | {"part": self.part} if self.part else entry

    @classmethod
    def from_json(cls, entry: dict[str, str]) -> Rejected:
        return cls(entry["path"], entry["reason"], entry.get("part", ""))


def bounded_batches(
    entries: Iterable[tuple[T, bytes] | Rejected], batch_size: int
) -> Iterator[tuple[list[tuple[T, bytes]], list[Rejected]]]:
    """``entries`` in order, in batches of at most ``batch_size`` items and about
    ``BATCH_BYTES`` of images, each with the entries rejected since the last batch."""
    batch: list[tuple[T, bytes]] = []
    rejects: list[Rejected] = []
    size = 0
    for entry in entries:
        if isinstance(entry, Rejected):
            rejects.append(entry)
            continue
        batch.append(entry)
        size += len(entry[1])
        if len(batch) >= batch_size or size >= BATCH_BYTES:
            yield batch, rejects
            batch, rejects, size = [], [], 0
    if batch or rejects:
        yield batch, rejects
