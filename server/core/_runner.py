"""One built DALI pipeline, fed batch by batch, that survives bad samples.

The pipeline reads its input through ``fn.external_source`` from a callback
that pulls the next :class:`Job` (ids, encoded images, labels). DALI calls the
callback ahead of time to keep ``prefetch`` batches in flight.

A sample that makes the pipeline fail (a truncated JPEG, random bytes, a GIF
on nvJPEG) must not end the stream: when a run raises, the failed batch's
samples are tried one at a time through a batch-size-1 copy of the same graph,
the culprits are reported as skipped and the rest of the batch is run again.
Results come out in job order whatever was retried.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import pathlib
import pickle
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from batchwire.server.core._pipelines import BuildContext, PipelineSpec

__all__ = ["Job", "ParallelRunner", "PlannedSource", "Result", "Runner", "RunnerKey"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunnerKey:
    """What makes two pipelines interchangeable."""

    pipeline: str
    params: tuple[tuple[str, float], ...]
    dtype: str
    layout: str
    batch_size: int
    device: str
    device_id: int | None


@dataclasses.dataclass
class Job:
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
    finish: Callable[[Result], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """A job's output; ``images`` and ``labels`` own their memory (``images`` is empty when
    the job had a ``finish``, whose return value is ``payload``)."""

    seq: int
    ids: np.ndarray
    images: np.ndarray
    labels: np.ndarray
    skipped: tuple[int, ...]
    payload: Any = None


class _Source:
    """The external_source callback: hands DALI the next job, remembers it."""

    def __init__(self) -> None:
        self.jobs: Iterator[Job] = iter(())
        self.retries: collections.deque[Job] = collections.deque()
        self.in_flight: collections.deque[Job] = collections.deque()
        self.empty: list[Job] = []

    def __call__(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        while True:
            job = self.retries.popleft() if self.retries else next(self.jobs, None)
            if job is None:
                raise StopIteration
            if not job.images:
                # Nothing left to run (every sample skipped): no DALI batch.
                self.empty.append(job)
                continue
            self.in_flight.append(job)
            meta = np.stack([np.full(len(job.ids), job.seq, np.int64), job.ids], axis=1)
            return job.images, job.labels, meta


def _build(
    spec: PipelineSpec,
    params: dict[str, float],
    ctx: BuildContext,
    *,
    batch_size: int,
    num_threads: int,
    device_id: int | None,
    prefetch: int,
    source: Any,
    synchronous: bool = False,
    read_workers: int = 0,
) -> Any:
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import Pipeline

    pipe = Pipeline(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=prefetch,
        # A synchronous pipeline calls its source exactly once per run and has
        # nothing in flight: what the one-sample probe needs.
        exec_pipelined=not synchronous,
        exec_async=not synchronous,
        # Parallel sources run in worker processes. They are started with
        # "spawn": pipelines are built while the server runs, when its process
        # has threads and may hold a CUDA context, and DALI's "fork" is only
        # safe before either.
        py_num_workers=max(read_workers, 1),
        py_start_method="spawn",
    )
    parallel: dict[str, Any] = {}
    if read_workers:
        # Each worker reads whole batches; keep every worker busy and DALI fed.
        parallel = {
            "parallel": True,
            "batch_info": True,
            "prefetch_queue_depth": max(prefetch, read_workers),
        }
    with pipe:
        encoded, labels, meta = fn.external_source(
            source=source,
            num_outputs=3,
            batch=True,
            dtype=[types.UINT8, types.INT64, types.INT64],
            ndim=[1, 0, 1],
            **parallel,
        )
        images, labels = spec.function(encoded, labels, ctx, params)
        pipe.set_outputs(images, labels, meta)
    pipe.build()
    return pipe


def _to_numpy(tensor_list: Any) -> np.ndarray:
    """A copy of a DALI output that owns its memory."""
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return np.asarray(tensor_list.as_array())


def _view(tensor_list: Any) -> np.ndarray:
    """A DALI output as an array over DALI's own buffer (no copy), valid until the
    pipeline's next run; a copy where the samples' shapes differ."""
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    if not tensor_list.is_dense_tensor():
        return np.asarray(tensor_list.as_array())
    return np.asarray(tensor_list.as_tensor())


class Runner:
    """A built pipeline for one :class:`RunnerKey`; used by one stream at a time."""

    def __init__(
        self,
        key: RunnerKey,
        spec: PipelineSpec,
        ctx: BuildContext,
        *,
        num_threads: int,
        prefetch: int = 2,
    ) -> None:
        self.key = key
        self._spec = spec
        self._params = dict(key.params)
        self._ctx = ctx
        self._num_threads = num_threads
        self._prefetch = prefetch
        self._source = _Source()
        self._pipe = self._build(key.batch_size, self._source)
        self._probe_sample: list[tuple[list[np.ndarray], np.ndarray, np.ndarray]] = []
        self._lock = threading.Lock()
        self.healthy = True

    def _build(self, batch_size: int, source: Any, synchronous: bool = False) -> Any:
        return _build(
            self._spec,
            self._params,
            self._ctx,
            batch_size=batch_size,
            num_threads=1 if synchronous else self._num_threads,
            device_id=self.key.device_id,
            prefetch=1 if synchronous else self._prefetch,
            source=source,
            synchronous=synchronous,
        )

    def run(self, jobs: Iterator[Job], first: int = 0) -> Generator[Result, None, None]:
        """Run ``jobs`` (seq first, first + 1, …) and yield their results in seq order.

        Closing the generator early drains what DALI still has in flight, so
        the runner can serve the next stream. One stream at a time.
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("a Runner serves one stream at a time")
        source = self._source
        source.jobs = jobs
        source.retries.clear()
        source.in_flight.clear()
        source.empty.clear()
        finished = False
        try:
            done: dict[int, Result] = {}
            next_seq = first
            while True:
                for job in source.empty:
                    done[job.seq] = _empty_result(job)
                source.empty.clear()
                if next_seq in done:
                    yield done.pop(next_seq)
                    next_seq += 1
                    continue
                try:
                    outputs = self._pipe.run()
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
                except RuntimeError as exc:
                    if not source.in_flight:
                        raise  # not a batch's failure: the source itself failed
                    # After an error DALI's reset() proved unsafe to rely on
                    # (a later run could crash), so the pipeline is replaced;
                    # the batches it held in flight run again on the new one.
                    failed = source.in_flight.popleft()
                    pending = list(source.in_flight)
                    source.in_flight.clear()
                    self._pipe = self._build(self.key.batch_size, self._source)
                    repaired = self._recover(failed, exc)
                    source.retries.extendleft(reversed([repaired, *pending]))
                    continue
                job = source.in_flight.popleft()
                done[job.seq] = self._result(job, outputs)
        finally:
            if not finished:
                self._drain()
            source.jobs = iter(())
            self._lock.release()

    def _result(self, job: Job, outputs: Any) -> Result:
        images = _to_numpy(outputs[0]) if job.finish is None else _view(outputs[0])
        labels, meta = _to_numpy(outputs[1]), _to_numpy(outputs[2])
        if meta.shape[0] != len(job.ids) or not np.array_equal(meta[:, 1], job.ids):
            raise RuntimeError(f"DALI output of batch {meta[0, 0]} does not match job {job.seq}")
        result = Result(
            seq=job.seq,
            ids=job.ids,
            images=images,
            labels=labels.reshape(-1).astype(np.int64, copy=False),
            skipped=tuple(job.skipped),
        )
        if job.finish is None:
            return result
        # Before the next run, while DALI's buffer holds these images.
        return dataclasses.replace(result, images=images[:0].copy(), payload=job.finish(result))

    def _recover(self, job: Job, exc: RuntimeError) -> Job:
        """Find which samples of a failed job break the pipeline; retry the rest."""
        message = str(exc).strip().splitlines()
        log.warning(
            "pipeline %r failed on a batch of %d samples (%s); checking them one by one",
            self._spec.name,
            len(job.ids),
            message[-1] if message else type(exc).__name__,
        )
        # A batch whose clean samples fail again is given up, not the stream.
        bad = list(range(len(job.ids))) if job.attempts >= 1 else self._find_bad(job)
        keep = [i for i in range(len(job.ids)) if i not in set(bad)]
        skipped = job.skipped + [int(job.ids[i]) for i in bad]
        log.warning(
            "skipping sample ids %s: they cannot be processed", [int(job.ids[i]) for i in bad]
        )
        return dataclasses.replace(
            job,
            ids=job.ids[keep],
            images=[job.images[i] for i in keep],
            labels=job.labels[keep],
            skipped=skipped,
            attempts=job.attempts + 1,
        )

    def _find_bad(self, job: Job) -> list[int]:
        """Indices of ``job``'s samples that fail alone in a batch-size-1 copy of the graph."""
        bad = []
        probe = self._build(1, self._probe_source, synchronous=True)
        for index in range(len(job.ids)):
            meta = np.array([[job.seq, job.ids[index]]], dtype=np.int64)
            self._probe_sample[:] = [
                (job.images[index : index + 1], job.labels[index : index + 1], meta)
            ]
            try:
                probe.run()
            except RuntimeError:
                bad.append(index)
                # A synchronous pipeline is dead after an error: use a new one.
                probe = self._build(1, self._probe_source, synchronous=True)
        return bad

    def _probe_source(self) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        if not self._probe_sample:
            raise StopIteration
        return self._probe_sample.pop()

    def _drain(self) -> None:
        """Run out what DALI holds so the next stream starts clean."""
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
            log.info("pipeline %r failed while draining (%s); discarding it", self._spec.name, exc)
        self.healthy = False


class UnreadableBatch(Exception):
    """No record of a batch can be fed to DALI (it cannot run an empty batch)."""


class PlannedSource:
    """A stream's batches, read in DALI's worker processes by ``read``.

    The parallel external_source calls it with the batch number; ``read`` is the
    engine's record path (``read_job``). It is pickled into each worker, which
    opens its own LMDB environment on first use.
    """

    def __init__(
        self, directory: str, batches: list[np.ndarray], read: Callable[[Any, int, np.ndarray], Job]
    ) -> None:
        self.directory = directory
        self.batches = batches
        self.read = read
        self._dataset: Any = None
        # The workers log skipped records as this process does (level, plain or JSON).
        root = logging.getLogger()
        formatter = next((h.formatter for h in root.handlers if h.formatter), None)
        try:
            pickle.dumps(formatter)
        except Exception:  # a formatter bound to something local: plain lines then
            formatter = None
        self._logging = (root.level, formatter)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_dataset": None}

    def __call__(self, info: Any) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        if info.iteration >= len(self.batches):
            raise StopIteration
        if self._dataset is None:
            from batchwire.server.data._dataset import Dataset

            root = logging.getLogger()
            if not root.handlers:  # a fresh worker process
                level, formatter = self._logging
                handler = logging.StreamHandler()
                handler.setFormatter(formatter)
                root.addHandler(handler)
                root.setLevel(level)
            self._dataset = Dataset(pathlib.Path(self.directory))
        job = self.read(self._dataset, info.iteration, self.batches[info.iteration])
        if not job.images:
            raise UnreadableBatch(f"no record of batch {job.seq} can be decoded")
        meta = np.stack([np.full(len(job.ids), job.seq, np.int64), job.ids], axis=1)
        return job.images, job.labels, meta


class ParallelRunner:
    """One stream's pipeline whose records are read by DALI worker processes.

    It is built for its stream (the source holds the stream's batches) and shut
    down after it. A batch that fails ends the parallel part: the stream goes on
    from that batch through ``fallback``, an inline :class:`Runner` that finds
    the culprits one by one and skips them.
    """

    def __init__(
        self,
        key: RunnerKey,
        spec: PipelineSpec,
        ctx: BuildContext,
        source: PlannedSource,
        *,
        num_threads: int,
        prefetch: int,
        workers: int,
    ) -> None:
        self.key = key
        self._name = spec.name
        self._batches = source.batches
        self._pipe: Any = _build(
            spec,
            dict(key.params),
            ctx,
            batch_size=key.batch_size,
            num_threads=num_threads,
            device_id=key.device_id,
            prefetch=prefetch,
            source=source,
            read_workers=workers,
        )

    def run(self, fallback: Callable[[int], Iterator[Result]]) -> Generator[Result, None, None]:
        """Every batch's result in order; ``fallback(seq)`` yields from batch ``seq`` on."""
        seq = 0
        try:
            while seq < len(self._batches):
                try:
                    outputs = self._pipe.run()
                except Exception as exc:  # a worker's error comes back as its own type
                    message = str(exc).strip().splitlines()
                    log.warning(
                        "pipeline %r failed at batch %d or a batch read ahead of it by the "
                        "worker processes (%s); reading the rest of the stream inline",
                        self._name,
                        seq,
                        message[-1] if message else type(exc).__name__,
                    )
                    self.close()
                    yield from fallback(seq)
                    return
                yield self._result(seq, outputs)
                seq += 1
        finally:
            self.close()

    def _result(self, seq: int, outputs: Any) -> Result:
        images, labels, meta = (_to_numpy(out) for out in outputs)
        if meta.shape[0] == 0 or np.any(meta[:, 0] != seq):
            raise RuntimeError(f"DALI's output does not match batch {seq} of the stream")
        ids = meta[:, 1].copy()
        read = set(ids.tolist())
        skipped = tuple(int(i) for i in self._batches[seq] if int(i) not in read)
        if skipped:
            # The workers log each record's reason.
            log.warning("skipping sample ids %s: unreadable records", list(skipped))
        return Result(
            seq=seq,
            ids=ids,
            images=images,
            labels=labels.reshape(-1).astype(np.int64, copy=False),
            skipped=skipped,
        )

    def close(self) -> None:
        """Let the pipeline go: DALI stops its worker processes with it. Idempotent."""
        self._pipe = None


def _empty_result(job: Job) -> Result:
    return Result(
        seq=job.seq,
        ids=job.ids[:0],
        images=np.zeros((0,), dtype=np.uint8),
        labels=np.zeros((0,), dtype=np.int64),
        skipped=tuple(job.skipped),
    )
