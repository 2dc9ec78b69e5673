"""What a pipeline runs and what comes out: a :class:`Job` and its :class:`Batch`.

:func:`read_job` makes a batch's job from the record path's output
(:meth:`Dataset.read_screened`: its records read from LMDB, parsed and screened).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchwire.common.outputs import TEXT_SEPARATOR, Payload, none_of
from batchwire.server.data.records import Records
from batchwire.v1 import batchwire_pb2 as pb

__all__ = [
    "Batch",
    "Job",
    "batch_entropy",
    "empty_result",
    "field_arrays",
    "keep",
    "read_job",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Job:
    """A batch to run: ``ids[i]`` is encoded as ``images[i]`` with ``labels[i]``."""

    seq: int  # the batch's number in its stream (its ticket's), kept by its Batch
    ids: np.ndarray
    images: list[np.ndarray]
    labels: np.ndarray
    skipped: list[int] = dataclasses.field(default_factory=list)
    # The dataset fields its pipeline takes (PipelineSpec.inputs, in order): for each, one
    # array a sample (:func:`field_arrays`).
    fields: tuple[list[np.ndarray], ...] = ()
    # What fixes its random draws (:class:`~batchwire.server.pipelines.Draws`): a stream's
    # seed, epoch and the batch's ids (:func:`batch_entropy`); empty: draws of its own.
    entropy: tuple[int, ...] = ()
    attempts: int = 0

    def inputs(self) -> tuple[Any, ...]:
        """What the pipeline's feed takes for this job: the encoded images (which the
        runner passes as one DALI batch, ``encoded_batch``), the labels, one ``(seq, id)``
        row per sample that names its output, the fields, and last the entropy of its
        random draws (which the feed makes DALI's random states)."""
        meta = np.stack([np.full(len(self.ids), self.seq, np.int64), self.ids], axis=1)
        return (self.images, self.labels, meta, *self.fields, self.entropy)

    def only(self, keep: list[int], skipped: list[int]) -> Job:
        """This job with only the samples at positions ``keep``, ``skipped`` added to the
        ones it leaves out."""
        return dataclasses.replace(
            self,
            ids=self.ids[keep],
            images=[self.images[i] for i in keep],
            labels=self.labels[keep],
            skipped=self.skipped + skipped,
            fields=tuple([values[i] for i in keep] for values in self.fields),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    """One batch from the pipeline's output to the stream's encoder: what the runner makes
    of a job's output (:meth:`Runner.run`), and what the stream adds of it, its place in the
    share (``index``, ``cursor``, ``num_batches``) and format (``normalized``, ``layout``),
    before the encoder makes it messages (:meth:`BatchStream.finish`).

    ``images`` may be a view of DALI's output buffer, as the runner yields it: valid only
    until its run is resumed (:func:`keep` copies it); ``labels`` own their memory. A pipeline with
    named outputs puts them in ``images`` as one payload, which ``outputs`` describes
    (``batchwire.common.outputs``)."""

    ids: np.ndarray
    images: np.ndarray | Payload
    labels: np.ndarray
    skipped_ids: tuple[int, ...] = ()  # left out (undecodable, bad fields)
    seq: int = 0  # its number in its stream (its job's)
    outputs: tuple[pb.Tensor, ...] = ()
    # The stream's: its batch of the share, the share's cursor after it, how many batches
    # the share holds, and how its images travel.
    index: int = 0
    cursor: int = 0
    num_batches: int = 0
    normalized: bool = False
    layout: str = "NCHW"
    # A mixture's: samples of each of its sources in this batch (empty for one dataset).
    source_counts: tuple[int, ...] = ()


def keep(batch: Batch) -> Batch:
    """``batch`` with images that own their memory, for a taker that holds it past the
    runner's next run (a payload of named outputs is copied by being made an array)."""
    images = batch.images
    if isinstance(images, np.ndarray) and images.flags.owndata:
        return batch
    copy = np.asarray(images) if isinstance(images, Payload) else np.array(images)
    return dataclasses.replace(batch, images=copy)


def empty_result(
    job: Job,
    sample_shape: tuple[int, ...] = (),
    dtype: np.dtype | type = np.uint8,
    outputs: tuple[pb.Tensor, ...] = (),
) -> Batch:
    """The batch of a job none of whose samples is left to run: no images, of shape
    ``(0, *sample_shape)``; a pipeline with named outputs gives each of them with no
    samples (``outputs``: their heads, as a batch that ran gave them)."""
    if outputs:
        images = np.zeros((0,), dtype=np.uint8)  # an empty payload
    else:
        images = np.zeros((0, *sample_shape), dtype=dtype)
    return Batch(
        seq=job.seq,
        ids=job.ids[:0],
        images=images,
        labels=np.zeros((0,), dtype=np.int64),
        skipped_ids=tuple(job.skipped),
        outputs=none_of(outputs),
    )


def batch_entropy(seed: int, epoch: int, ids: np.ndarray) -> tuple[int, ...]:
    """What fixes the random draws of a batch of ``ids`` in ``(seed, epoch)``: the same
    samples in the same order draw the same, on any server and over any transport."""
    digest = hashlib.blake2b(np.asarray(ids, "<i8").tobytes(), digest_size=16).digest()
    return (seed, epoch, int.from_bytes(digest, "little"))


def read_job(
    dataset: Records,
    seq: int,
    ids: np.ndarray,
    inputs: Sequence[tuple[str, str]] = (),
    entropy: tuple[int, ...] = (),
) -> Job:
    """Batch ``seq``'s job: the records of ``ids`` that may reach a pipeline, read and
    screened by the record path (:meth:`Dataset.read_screened`), with the fields
    ``inputs`` names (name, kind) where the pipeline takes some; the rest in
    ``Job.skipped`` (also a sample whose field is missing or malformed). ``entropy``
    fixes its random draws (:func:`batch_entropy`)."""
    if not inputs:
        kept, images, labels, skipped = dataset.read_screened(ids)
        return Job(
            seq=seq, ids=kept, images=images, labels=labels, skipped=skipped, entropy=entropy
        )
    names = {name for name, _ in inputs}  # the fields the pipeline takes, not all a record has
    kept, images, labels, skipped, values = dataset.read_screened_fields(ids, names)
    job = Job(seq=seq, ids=kept, images=images, labels=labels, skipped=skipped, entropy=entropy)
    arrays, bad = field_arrays(dataset.name, kept, values, inputs)
    keep = [i for i in range(len(kept)) if i not in bad]
    job = job.only(keep, [int(kept[i]) for i in sorted(bad)])
    return dataclasses.replace(
        job, fields=tuple([arrays[i][n] for i in keep] for n in range(len(inputs)))
    )


def field_arrays(
    dataset: str,
    ids: np.ndarray,
    values: Sequence[Mapping[str, object]],
    inputs: Sequence[tuple[str, str]],
) -> tuple[list[list[np.ndarray]], set[int]]:
    """Each sample's ``inputs`` fields (of ``values``, the samples' fields as the record
    path read them) as the arrays DALI takes (int64, float32, or the bytes of a text,
    several joined by ``TEXT_SEPARATOR``, or of an encoded image), and the positions of the
    samples whose field is missing or malformed (logged, one line each)."""
    arrays: list[list[np.ndarray]] = []
    bad: set[int] = set()
    for position, (sample, fields) in enumerate(zip(ids.tolist(), values, strict=True)):
        row = []
        for name, kind in inputs:
            array = _as_input(fields.get(name), kind)
            if array is None:
                log.warning(
                    "sample %d of %s: field %r is missing or not %s; skipping it",
                    sample,
                    dataset,
                    name,
                    kind,
                )
                bad.add(position)
                break
            row.append(array)
        arrays.append(row)
    return arrays, bad


def _as_input(value: object, kind: str) -> np.ndarray | None:
    if kind in ("int", "float"):
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf":
            return None
        return np.ascontiguousarray(value, np.int64 if kind == "int" else np.float32)
    if isinstance(value, str) and kind == "text":
        return np.frombuffer(value.encode("utf-8"), np.uint8)
    if isinstance(value, bytes) and kind in ("bytes", "image"):
        return np.frombuffer(value, np.uint8)
    if isinstance(value, tuple) and value and kind == "text":
        joined = TEXT_SEPARATOR.join(v.encode("utf-8") for v in value if isinstance(v, str))
        return np.frombuffer(joined, np.uint8)
    return None
