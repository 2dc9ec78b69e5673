"""What a pipeline runs and what comes out: a :class:`Job`, its :class:`Result`, and what
the job's ``finish`` makes of that result.

:func:`read_job` makes a batch's job from the record path's output
(:meth:`Dataset.read_screened`: its records read from LMDB, parsed and screened).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from batchwire.server.data.records import Records
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["Job", "Result", "empty_result", "keep", "read_job"]

P = TypeVar("P")  # what a job's ``finish`` builds from its result (a stream's message)


@dataclasses.dataclass
class Job(Generic[P]):
    """A batch to run: ``ids[i]`` is encoded as ``images[i]`` with ``labels[i]``."""

    seq: int  # the batch's number in its stream (its ticket's), kept by its Result
    ids: np.ndarray
    images: list[np.ndarray]
    labels: np.ndarray
    skipped: list[int] = dataclasses.field(default_factory=list)
    attempts: int = 0
    # Called with the job's Result while its images are a view of DALI's output buffer
    # (valid only until the pipeline's next run): what it returns is what the runner
    # yields for the job. This is how a stream's messages are built with the images
    # copied once, from DALI's buffer into the message. None: :func:`keep`, a Result
    # that owns its images.
    finish: Callable[[Result], P] | None = None

    def inputs(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """What ``fn.external_source`` hands DALI for this job: the encoded images (which
        the runner passes as one DALI batch, ``encoded_batch``), the labels, and one
        ``(seq, id)`` row per sample that names its output."""
        meta = np.stack([np.full(len(self.ids), self.seq, np.int64), self.ids], axis=1)
        return self.images, self.labels, meta


@dataclasses.dataclass(frozen=True)
class Result:
    """A job's output as its ``finish`` sees it: ``images`` may be a view of DALI's output
    buffer, valid only during the call (:func:`keep` copies it); ``labels`` own their
    memory. A pipeline with named outputs puts them in ``images`` as one payload, which
    ``outputs`` describes (``batchwire.common.outputs``)."""

    seq: int
    ids: np.ndarray
    images: np.ndarray
    labels: np.ndarray
    skipped: tuple[int, ...]
    outputs: tuple[pb.Tensor, ...] = ()


def keep(result: Result) -> Result:
    """``result`` with images that own their memory: a job's ``finish`` by default."""
    if result.images.flags.owndata:
        return result
    return dataclasses.replace(result, images=np.array(result.images))


def empty_result(
    job: Job[Any],
    sample_shape: tuple[int, ...] = (),
    dtype: np.dtype | type = np.uint8,
    outputs: tuple[pb.Tensor, ...] = (),
) -> Result:
    """The result of a job none of whose samples is left to run: no images, of shape
    ``(0, *sample_shape)``; a pipeline with named outputs gives each of them with no
    samples (``outputs``: their heads, as a batch that ran gave them)."""
    empty = []
    for head in outputs:
        none = pb.Tensor()
        none.CopyFrom(head)
        del none.shape[:], none.lengths[:]
        none.shape.extend([0, *head.shape[1:]])
        none.offset = 0
        empty.append(none)
    return Result(
        seq=job.seq,
        ids=job.ids[:0],
        images=np.zeros(
            (0,) if outputs else (0, *sample_shape), dtype=np.uint8 if outputs else dtype
        ),
        labels=np.zeros((0,), dtype=np.int64),
        skipped=tuple(job.skipped),
        outputs=tuple(empty),
    )


def read_job(dataset: Records, seq: int, ids: np.ndarray) -> Job[Any]:
    """Batch ``seq``'s job: the records of ``ids`` that may reach a pipeline, read and
    screened by the record path (:meth:`Dataset.read_screened`); the rest in
    ``Job.skipped``."""
    kept, images, labels, skipped = dataset.read_screened(ids)
    return Job(seq=seq, ids=kept, images=images, labels=labels, skipped=skipped)
