"""What a pipeline runs and what comes out: a :class:`Job` and its :class:`Result`.

:func:`read_job` is the server's whole record path: a batch's records read from LMDB,
parsed and screened, ready for a pipeline.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from batchwire.server.data.records import Dataset

__all__ = ["Job", "Result", "empty_result", "read_job"]

log = logging.getLogger(__name__)

P = TypeVar("P")  # what a job's ``finish`` builds from its result (a stream's message)


@dataclasses.dataclass
class Job(Generic[P]):
    """A batch to run: ``ids[i]`` is encoded as ``images[i]`` with ``labels[i]``."""

    seq: int
    ids: np.ndarray
    images: list[np.ndarray]
    labels: np.ndarray
    skipped: list[int] = dataclasses.field(default_factory=list)
    attempts: int = 0
    # Called with the job's Result while its images are still a view of DALI's output
    # buffer (valid only until the pipeline's next run); what it returns becomes
    # ``Result.payload`` and the images are not kept. This is how a stream's messages are
    # built with the images copied once, from DALI's buffer into the message.
    finish: Callable[[Result[P]], P] | None = None

    def inputs(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """What ``fn.external_source`` hands DALI for this job: the encoded images, the
        labels, and one ``(seq, id)`` row per sample that names its output."""
        meta = np.stack([np.full(len(self.ids), self.seq, np.int64), self.ids], axis=1)
        return self.images, self.labels, meta


@dataclasses.dataclass(frozen=True)
class Result(Generic[P]):
    """A job's output; ``images`` and ``labels`` own their memory (``images`` is empty when
    the job had a ``finish``, whose return value is ``payload``)."""

    seq: int
    ids: np.ndarray
    images: np.ndarray
    labels: np.ndarray
    skipped: tuple[int, ...]
    payload: P | None = None


def empty_result(
    job: Job[P], sample_shape: tuple[int, ...] = (), dtype: np.dtype | type = np.uint8
) -> Result[P]:
    """The result of a job none of whose samples is left to run: no images, of shape
    ``(0, *sample_shape)``."""
    return Result(
        seq=job.seq,
        ids=job.ids[:0],
        images=np.zeros((0, *sample_shape), dtype=dtype),
        labels=np.zeros((0,), dtype=np.int64),
        skipped=tuple(job.skipped),
    )


def read_job(dataset: Dataset, seq: int, ids: np.ndarray) -> Job[Any]:
    """The records of ``ids`` ready for a pipeline: read from LMDB into one buffer, their
    images found in place, screened (once per dataset version, see ``ScreenedRecords``).

    This is the server's whole record path. Records that are missing, not a ``Datum`` or
    not a decodable image are left out and named in ``Job.skipped`` (and the log).
    """
    images, labels = dataset.read(ids)
    found = [(i, image) for i, image in enumerate(images) if image is not None]
    screened = dataset.screened.reasons(ids[[i for i, _ in found]], [im for _, im in found])
    reasons: list[str | None] = ["missing or not a Datum"] * len(images)
    for (i, _), reason in zip(found, screened, strict=True):
        reasons[i] = reason
    good, skipped = [], []
    for i, reason in enumerate(reasons):
        if reason is None:
            good.append(i)
            continue
        skipped.append(int(ids[i]))
        log.warning("dataset %r: skipping sample %d: %s", dataset.name, ids[i], reason)
    return Job(
        seq=seq,
        ids=ids[good],
        images=[images[i] for i in good],  # type: ignore[misc]
        labels=labels[good],
        skipped=skipped,
    )
