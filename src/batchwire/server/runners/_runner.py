"""One built DALI pipeline, fed batch by batch, that survives bad samples.

The pipeline reads its input through ``fn.external_source`` from a callback
that pulls the next :class:`Job` (ids, encoded images, labels). DALI calls the
callback ahead of time to keep ``prefetch`` batches in flight.

A sample that makes the pipeline fail (a truncated JPEG, random bytes, a GIF
on nvJPEG) must not end the stream: when a run raises, the failed batch is
bisected through a synchronous copy of the same graph (``_culprits``), the
culprits are reported as skipped and the rest of the batch is run again on a
rebuilt pipeline. Batches come out in job order whatever was retried.

A failure that is not about a sample (out of memory, CUDA, a build, a batch that
fails whole or again without its culprits) raises :class:`PipelineFault` from
:meth:`Runner.run`: the batches in flight are lost here, the runner is no longer
``healthy``, and the fault is reported to the server's :class:`PipelineHealth`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from batchwire.common.outputs import Output, pack
from batchwire.server.errors import PipelineFault
from batchwire.server.pipelines import BuildContext, PipelineSpec
from batchwire.server.runners._culprits import Probe, find_culprits
from batchwire.server.runners._dali import (
    build_pipeline,
    encoded_batch,
    error_line,
    fault_kind,
    release,
    samples,
    to_numpy,
    view,
)
from batchwire.server.runners._health import PipelineHealth
from batchwire.server.runners._jobs import Batch, Job, empty_result
from batchwire.server.runners._keys import RunnerKey
from batchwire.server.runners._stages import StageTimes
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["Runner"]

log = logging.getLogger(__name__)


class _Source:
    """The external_source callback: hands DALI the next job, remembers it. Each job is
    held with its place in the run (``Runner.run`` numbers them in the order taken)."""

    def __init__(self) -> None:
        self.jobs: Iterator[tuple[int, Job]] = iter(())
        self.retries: collections.deque[tuple[int, Job]] = collections.deque()
        self.in_flight: collections.deque[tuple[int, Job]] = collections.deque()
        self.empty: list[tuple[int, Job]] = []
        self.seconds = 0.0  # spent in this callback: waiting for and reading jobs

    def __call__(self) -> tuple[Any, ...]:
        started = time.perf_counter()
        try:
            return self._next()
        finally:
            self.seconds += time.perf_counter() - started

    def _next(self) -> tuple[Any, ...]:
        while True:
            taken = self.retries.popleft() if self.retries else next(self.jobs, None)
            if taken is None:
                raise StopIteration
            if not taken[1].images:
                # Nothing left to run (every sample skipped): no DALI batch.
                self.empty.append(taken)
                continue
            self.in_flight.append(taken)
            images, *rest = taken[1].inputs()
            return (encoded_batch(images), *rest)


class Runner:
    """A built pipeline for one :class:`RunnerKey` that runs jobs: those of any stream
    (or Preprocess batch) of that key, as a scheduler slot hands them over; one
    :meth:`run` at a time."""

    def __init__(
        self,
        key: RunnerKey,
        pipeline: PipelineSpec,
        ctx: BuildContext,
        *,
        num_threads: int,
        prefetch: int = 2,
        stages: StageTimes | None = None,
        health: PipelineHealth | None = None,
    ) -> None:
        """Builds the pipeline: PipelineFault (reported to ``health``) when it cannot."""
        self.key = key
        self._stages = stages or StageTimes()
        self._health = health or PipelineHealth((key.device_id,))
        self._pipeline = pipeline
        self._params = dict(key.params)
        self._ctx = ctx
        self._num_threads = num_threads
        self._prefetch = prefetch
        self._source = _Source()
        self._lock = threading.Lock()
        self.healthy = True
        try:
            self._pipe: Any = self._build(key.batch_size, self._source)
        except PipelineFault as fault:
            self._fault(fault, batches=0)
            raise

    def _build(self, batch_size: int, source: Any, synchronous: bool = False) -> Any:
        return build_pipeline(
            self._pipeline,
            self._params,
            self._ctx,
            batch_size=batch_size,
            num_threads=1 if synchronous else self._num_threads,
            device_id=self.key.device_id,
            prefetch=1 if synchronous else self._prefetch,
            source=source,
            synchronous=synchronous,
        )

    def run(self, jobs: Iterator[Job]) -> Generator[Batch, None, None]:
        """Run ``jobs`` (of any streams: their ``seq`` is kept, not used) and yield each
        one's :class:`Batch`, in the order of the jobs.

        A batch's ``images`` are a view of DALI's output buffer, valid only until the
        generator is resumed (or closed), when the pipeline runs again into that buffer:
        whoever takes a batch copies what it keeps of it before asking for the next
        (:func:`keep` makes a batch that owns its images). So the one copy of a batch's
        pixels is its taker's, from DALI's buffer to where they go.

        Closing the generator early drains what DALI still has in flight, so the
        runner can run the next jobs clean. One run at a time. Raises PipelineFault
        when the pipeline fails for a reason other than a sample; the runner is then
        not ``healthy`` and must be dropped.
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("a Runner runs one sequence of jobs at a time")
        source = self._source
        source.jobs = enumerate(jobs)
        source.retries.clear()
        source.in_flight.clear()
        source.empty.clear()
        finished = False
        try:
            done: dict[int, Batch] = {}  # the batches to yield, by place in the run
            place = 0  # the next batch to yield
            while True:
                for taken, job in source.empty:
                    done[taken] = self._empty(job)
                source.empty.clear()
                if place in done:
                    yield done.pop(place)
                    place += 1
                    continue
                try:
                    outputs = self._run()
                except StopIteration:
                    self._pipe.reset()
                    if source.retries or source.empty:
                        continue
                    if source.in_flight:
                        raise RuntimeError(
                            "DALI ended the epoch with batches still in flight"
                        ) from None
                    finished = True
                    return
                except Exception as exc:
                    if not source.in_flight:
                        raise  # not a batch's failure: the source itself failed
                    self._repair(exc)
                    continue
                # Yielded before the next run reuses DALI's buffer: every job taken before
                # this one came out of an earlier run, or was empty (``source.empty``).
                taken, job = source.in_flight.popleft()
                done[taken] = self._result(job, outputs)
        finally:
            if not finished and self.healthy:
                self._drain()
            source.jobs = iter(())
            self._lock.release()

    def _run(self) -> Any:
        """One run of the pipeline; its time less its input callback's is the
        ``pipeline`` stage (the callback's own share is the record path, or idle)."""
        source = self._source
        fed = source.seconds
        started = time.perf_counter()
        try:
            return self._pipe.run()
        finally:
            ran = time.perf_counter() - started - (source.seconds - fed)
            self._stages.add("pipeline", max(ran, 0.0))

    def _result(self, job: Job, outputs: Any) -> Batch:
        """The job's batch of DALI's ``outputs``, its images (or a pipeline's named outputs:
        their payload) a view of DALI's buffers, valid until the pipeline's next run."""
        meta = to_numpy(outputs[-1])
        if meta.shape[0] != len(job.ids) or not np.array_equal(meta[:, 1], job.ids):
            raise RuntimeError(f"DALI output of batch {meta[0, 0]} does not match job {job.seq}")
        if self._pipeline.outputs:
            return self._named(job, outputs[:-2], to_numpy(outputs[-2]))
        images = view(outputs[0])
        labels = to_numpy(outputs[1])
        self._health.ran(self.key, images, job.images[0], int(job.labels[0]))
        return Batch(
            seq=job.seq,
            ids=job.ids,
            images=images,
            labels=labels.reshape(-1).astype(np.int64, copy=False),
            skipped_ids=tuple(job.skipped),
        )

    def _named(self, job: Job, outputs: Any, labels: np.ndarray) -> Batch:
        """The result of a pipeline with named outputs: their payload, and the samples' own
        ``labels``."""
        named = []
        for declared, made in zip(self._pipeline.outputs, outputs, strict=True):
            data = samples(made) if declared.kind in ("ragged", "text") else view(made)
            layout = declared.layout or (self.key.layout if declared.kind == "image" else "")
            named.append(Output(name=declared.name, kind=declared.kind, data=data, layout=layout))
        payload, heads = pack(named)
        self._health.ran(self.key, None, job.images[0], int(job.labels[0]), heads)
        return Batch(
            seq=job.seq,
            ids=job.ids,
            images=payload,
            labels=labels.reshape(-1).astype(np.int64, copy=False),
            skipped_ids=tuple(job.skipped),
            outputs=heads,
        )

    def _empty(self, job: Job) -> Batch:
        """The batch of a job none of whose samples is left: no images, shaped as this configuration's batches are once one has run (``(0,)``
        before)."""
        known = self._health.output_shape(self.key)
        shape, dtype = known if known is not None else ((), np.dtype(self.key.dtype))
        # Before any batch of named outputs ran: as declared, the image outputs as uint8.
        heads = self._health.output_heads(self.key) or tuple(
            pb.Tensor(name=o.name, kind=o.kind, layout=o.layout, dtype=pb.UINT8)
            for o in self._pipeline.outputs
        )
        return empty_result(job, shape, dtype, heads)

    def _repair(self, exc: Exception) -> None:
        """The oldest batch in flight failed with ``exc``: find its bad samples and queue
        it again without them, with the batches that were in flight behind it, on a new
        pipeline. A fault ends the run instead (PipelineFault, raised)."""
        source = self._source
        taken, failed = source.in_flight.popleft()
        pending = list(source.in_flight)
        source.in_flight.clear()
        # After an error DALI's pipeline is no longer valid: it is replaced (after the
        # search, so that the two are not in memory at once).
        release(self._pipe)
        self._pipe = None
        try:
            repaired = self._recover(failed, exc)
            self._pipe = self._build(self.key.batch_size, self._source)
        except BaseException as error:
            self.healthy = False  # it has no pipeline
            if isinstance(error, PipelineFault):
                self._fault(error, batches=1 + len(pending) + len(source.retries))
            raise
        source.retries.extendleft(reversed([(taken, repaired), *pending]))

    def _recover(self, job: Job, exc: Exception) -> Job:
        """``job`` without the samples that make it fail with ``exc``; PipelineFault when
        the failure is not theirs."""
        name = self._pipeline.name
        kind = fault_kind(exc)
        if kind is None and job.attempts >= 1:
            kind = "retry"  # it failed again without its culprits
        if kind is not None:
            raise PipelineFault(name, kind, error_line(exc)) from exc
        log.warning(
            "pipeline %r failed on a batch of %d samples (%s); looking for the samples to blame",
            name,
            len(job.ids),
            error_line(exc),
        )
        probe = Probe(lambda source: self._build(len(job.ids), source, synchronous=True))
        # The control sample is an image and label alone: none for a pipeline of fields.
        control = None if self._pipeline.inputs else self._health.control()
        bad = find_culprits(job, exc, probe, pipeline=name, control=control)
        skipped = [int(job.ids[i]) for i in bad]
        log.warning("skipping sample ids %s: pipeline %r fails on them", skipped, name)
        keep = [i for i in range(len(job.ids)) if i not in set(bad)]
        return dataclasses.replace(job.only(keep, skipped), attempts=job.attempts + 1)

    def _fault(self, fault: PipelineFault, batches: int) -> None:
        """A fault ends this runner: the server's health learns of it."""
        self.healthy = False
        self._health.failed(self.key, fault, batches)

    def _drain(self) -> None:
        """Run out what DALI holds so the next run starts clean."""
        source = self._source
        source.jobs = iter(())
        source.retries.clear()
        try:
            for _ in range(64):
                try:
                    self._pipe.run()
                except StopIteration:
                    self._pipe.reset()
                    source.in_flight.clear()
                    return
                if source.in_flight:
                    source.in_flight.popleft()
        except RuntimeError as exc:
            log.info(
                "pipeline %r failed while draining (%s); discarding it", self._pipeline.name, exc
            )
        release(self._pipe)  # it runs no more: shut down here, not where an error lets it go
        self.healthy = False
