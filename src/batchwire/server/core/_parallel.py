"""A stream's pipeline whose records are read in DALI's worker processes.

:class:`PlannedSource` holds the stream's batches and reads them, in each worker, through
the engine's record path; :class:`ParallelRunner` runs the pipeline it feeds, until a
batch fails; :class:`WorkerFeed` runs it in a thread for the stream, and hands the stream
over to the server's pipelines (its ticket) from the batch that failed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import pickle
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import numpy as np

from batchwire.server.core._dali import build_pipeline, error_line, to_numpy
from batchwire.server.core._fair import Ticket
from batchwire.server.core._jobs import Job, Result
from batchwire.server.core._keys import RunnerKey
from batchwire.server.core._pipelines import BuildContext, PipelineSpec

__all__ = ["ParallelRunner", "PlannedSource", "ReplacedDataset", "UnreadableBatch", "WorkerFeed"]

log = logging.getLogger(__name__)

P = TypeVar("P")
_POLL_S = 0.1  # how often a feed waiting for its stream to take a batch checks for a close


class UnreadableBatch(Exception):
    """No record of a batch can be fed to DALI (it cannot run an empty batch)."""


class ReplacedDataset(Exception):
    """The dataset's directory holds another version than the stream's."""


class PlannedSource:
    """A stream's batches, read in DALI's worker processes by ``read``.

    The parallel external_source calls it with the batch number; ``read`` is the
    engine's record path (``read_job``). It is pickled into each worker, which
    opens its own LMDB environment on first use. A worker that finds another
    ``version`` of the dataset there (replaced since the stream opened; empty: not
    checked) fails its
    batch, and the stream goes on inline, on the server's Dataset of its version.
    """

    def __init__(
        self,
        directory: str,
        batches: list[np.ndarray],
        read: Callable[[Any, int, np.ndarray], Job],
        version: str = "",
    ) -> None:
        self.directory = directory
        self.version = version
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

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Only DALI's worker processes unpickle a source, before they read a record. They
        # never need a GPU: hide it before anything in them starts CUDA, or each would
        # open a CUDA context of its own (about 520 MiB of GPU memory, on an H200).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        self.__dict__.update(state)

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
            dataset = Dataset(pathlib.Path(self.directory))
            if self.version and dataset.version != self.version:
                dataset.close()
                raise ReplacedDataset(
                    f"dataset {self.directory} is now version {dataset.version}, not the "
                    f"stream's {self.version}: it was replaced"
                )
            self._dataset = dataset
        job = self.read(self._dataset, info.iteration, self.batches[info.iteration])
        if not job.images:
            raise UnreadableBatch(f"no record of batch {job.seq} can be decoded")
        return job.inputs()


class ParallelRunner:
    """A built pipeline for one stream whose records are read by DALI worker processes.

    It is built for its stream (the source holds the stream's batches) and shut down
    after it. A batch that fails ends it: the stream goes on from that batch on the
    server's pipelines (:class:`WorkerFeed`), whose runner finds the culprits (by
    bisection) and skips them.
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
        self.batches = source.batches
        self._pipe: Any = build_pipeline(
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

    def run(self) -> Generator[Result[Any], None, None]:
        """The batches' results in order, until one fails (logged): then it stops."""
        seq = 0
        try:
            while seq < len(self.batches):
                try:
                    outputs = self._pipe.run()
                except Exception as exc:  # a worker's error comes back as its own type
                    log.warning(
                        "pipeline %r failed at batch %d or a batch read ahead of it by the "
                        "worker processes (%s); reading the rest of the stream inline",
                        self._name,
                        seq,
                        error_line(exc),
                    )
                    return
                yield self._result(seq, outputs)
                seq += 1
        finally:
            self.close()

    def _result(self, seq: int, outputs: Any) -> Result[Any]:
        images, labels, meta = (to_numpy(out) for out in outputs)
        if meta.shape[0] == 0 or np.any(meta[:, 0] != seq):
            raise RuntimeError(f"DALI's output does not match batch {seq} of the stream")
        ids = meta[:, 1].copy()
        read = set(ids.tolist())
        skipped = tuple(int(i) for i in self.batches[seq] if int(i) not in read)
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


class WorkerFeed(Generic[P]):
    """Runs a stream's :class:`ParallelRunner` in a thread of its own and hands each batch,
    built by ``finish(seq, result)``, to the stream's ticket, at most ``window`` batches
    ahead of those the stream took (:meth:`took`). From a batch that fails on, the ticket
    asks the server's pipelines instead (``Ticket.start``)."""

    def __init__(
        self,
        runner: ParallelRunner,
        ticket: Ticket,
        finish: Callable[[int, Result[P]], P],
        window: int,
    ) -> None:
        self._runner = runner
        self._ticket = ticket
        self._finish = finish
        self._window = max(1, window)
        self._taken = 0
        self._room = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name=f"batchwire-read-workers-{runner.key.pipeline}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        seq = 0
        try:
            for result in self._runner.run():
                payload = self._finish(seq, result)
                self._ticket.deliver(seq, dataclasses.replace(result, payload=payload))
                seq += 1
                with self._room:
                    while seq - self._taken >= self._window and not self._stopped:
                        self._room.wait(_POLL_S)
                    if self._stopped:
                        return
        except Exception as exc:  # the stream fails, with the batch it waits for
            log.exception("reading batch %d in worker processes failed", seq)
            self._ticket.deliver(seq, exc)
            return
        finally:
            self._runner.close()
        if seq < len(self._runner.batches) and not self._stopped:
            self._ticket.start(seq)

    def took(self) -> None:
        """The stream took a batch: room for one more."""
        with self._room:
            self._taken += 1
            self._room.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Stop reading, and wait (at most ``timeout`` seconds) for the batch in progress."""
        with self._room:
            self._stopped = True
            self._room.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
