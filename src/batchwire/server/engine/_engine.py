"""The engine: the datasets under the data directory, their streams, and preprocessing.

Takes plain arguments, yields NumPy arrays, never imports grpc. The servicer
adapts messages to :class:`StreamSpec` and :class:`Batch`, and maps the
errors of ``batchwire.server.errors`` to status codes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import pathlib
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from batchwire.common.params import check_batch_size
from batchwire.common.sampler import Plan
from batchwire.common.stream import StreamSpec
from batchwire.server.config import ServerConfig
from batchwire.server.data.records import (
    Dataset,
    MixedDataset,
    ReadAhead,
    Records,
    StreamReadAhead,
)
from batchwire.server.engine._catalog import (
    Catalog,
    Change,
    DatasetDescription,
    check_inputs,
    check_version,
)
from batchwire.server.engine._cpus import pipeline_threads, usable_cpus
from batchwire.server.engine._devices import DevicePlan
from batchwire.server.engine._gpu_wait import set_gpu_wait
from batchwire.server.engine._preprocess import PreprocessBatcher
from batchwire.server.engine._preprocess_request import (
    PreprocessLimits,
    PreprocessRequest,
    PreprocessResult,
)
from batchwire.server.engine._stats import EngineStats
from batchwire.server.engine._stream import Batch, BatchStream, StreamSetup, share_batches
from batchwire.server.errors import (
    Draining,
    InvalidRequest,
    OverCapacity,
)
from batchwire.server.pipelines import BuildContext, OutputSpec, PipelineSpec
from batchwire.server.runners import (
    PipelineHealth,
    Runner,
    RunnerKey,
    StageTimes,
    keep,
    pipeline_named,
    runner_key,
)
from batchwire.server.scheduling import Scheduler

__all__ = ["DatasetDescription", "Engine"]

log = logging.getLogger(__name__)


class Engine:
    """Datasets discovered under the data directory, pipelines, and streams."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.devices = DevicePlan.resolve(config.device, config.devices)
        if self.devices.kind == "gpu":  # before any pipeline makes a GPU's context active
            set_gpu_wait(config.gpu_wait, [i for i in self.devices.device_ids if i is not None])
        self.usable_cpus = usable_cpus()
        # DALI threads of each pipeline (see _cpus: not the node's cores, those this
        # process may use).
        self.threads = pipeline_threads(
            config.num_threads, self.devices.kind, len(self.devices.device_ids), self.usable_cpus
        )
        log.info(
            "pipelines run on %s, %d DALI threads each (%d CPUs usable by this process%s)",
            "the CPU: no GPU visible"
            if self.devices.kind == "cpu" and config.device == "auto"
            else ("the CPU" if self.devices.kind == "cpu" else f"GPUs {self.devices.device_ids}"),
            self.threads,
            self.usable_cpus,
            "; --num-threads" if config.num_threads else "",
        )
        self.stages = StageTimes()  # where the pipelines' time goes, by stage
        read = functools.partial(self.stages.add, "read")  # every stream's read-ahead's time
        self.readahead = ReadAhead.sized(config.read_ahead_reads, config.read_ahead_mib, read)
        # Faults, broken devices and a sample known to run, from every pipeline.
        self._pipeline_health = PipelineHealth(self.devices.device_ids)
        # The datasets under the data directory, as of the last rescan.
        self._catalog = Catalog(pathlib.Path(config.data_dir))
        # Every stream's batches and every Preprocess batch run on these pipelines.
        self.scheduler = Scheduler(
            self._build_runner,
            self.devices.device_ids,
            slots_per_device=config.slots_per_device,
            max_idle_pipelines=config.max_idle_pipelines,
        )
        self._streams = 0
        self._streams_lock = threading.Lock()
        self._device_cycle = itertools.cycle(self.devices.device_ids)
        self._open_streams: weakref.WeakSet[BatchStream] = weakref.WeakSet()
        self._drain = threading.Event()  # set by drain(); streams poll it between batches
        self.preprocessing = PreprocessBatcher(
            pipelines=config.pipelines,
            scheduler=self.scheduler,
            stages=self.stages,
            device=self.devices.kind,
            next_device=lambda: next(self._device_cycle),
            draining=self._drain.is_set,
            limits=PreprocessLimits.of(config),
        )

    # -- datasets --------------------------------------------------------------------

    def open_datasets(self) -> None:
        """Open every dataset directory directly under the data directory (the first
        :meth:`rescan`); ``DatasetError`` if the data directory is not one."""
        self.rescan()

    def rescan(self) -> list[Change]:
        """Serve what the data directory holds now: datasets added, replaced or removed
        since the last scan, each logged. Streams open on a replaced or removed dataset
        finish on the version they started with; new streams get the new one.
        ``DatasetError`` (and no change) if the data directory is missing."""
        changes = self._catalog.scan()
        for change in changes:
            if change.change == "removed":
                log.info("dataset %r removed (was version %s)", change.name, change.old)
            elif change.change == "added":
                log.info(
                    "dataset %r added: %d samples, version %s",
                    change.name,
                    change.num_samples,
                    change.new,
                )
            else:
                log.info(
                    "dataset %r replaced: %d samples, version %s (was %s); open streams "
                    "finish on the old version",
                    change.name,
                    change.num_samples,
                    change.new,
                    change.old,
                )
        return changes

    @property
    def datasets(self) -> Mapping[str, Dataset]:
        """The datasets served now, by name (a snapshot)."""
        return self._catalog.snapshot()

    @property
    def num_datasets(self) -> int:
        """How many datasets are served now."""
        return len(self._catalog)

    def list_datasets(self) -> list[DatasetDescription]:
        return self._catalog.describe_all()

    def describe(self, name: str) -> DatasetDescription:
        return self._catalog.describe(name)

    @property
    def pipelines(self) -> Mapping[str, PipelineSpec]:
        return self.config.pipelines

    # -- streams ---------------------------------------------------------------------

    def open_stream(
        self,
        spec: StreamSpec,
        *,
        encode: Callable[[Batch], Any] = keep,
        batches: Callable[[Plan], Sequence[int]] | None = share_batches,
    ) -> BatchStream[Any]:
        """Validate ``spec`` and start its stream.

        ``batches(plan)`` are the batches it runs, asked for at open (by default its whole
        share from its cursor; a ``StreamBatches`` call's are its lane's). None: its client
        asks for them as it goes (:meth:`BatchStream.want`). The stream hands out ``encode(batch)`` for
        each batch, called while the images are still in DALI's output buffer, so that
        they are copied once, into what it builds (by default Batches of their own)."""
        if self._drain.is_set():
            raise Draining("the server is shutting down; resume the stream on another server")
        # The stream holds its Datasets to its end, whatever a rescan does meanwhile.
        datasets: list[Dataset] = []
        try:
            for name in spec.datasets:
                datasets.append(self._catalog.acquire(name))
            return self._open(spec, datasets, encode, batches)
        except BaseException:
            for dataset in datasets:
                self._catalog.release(dataset)
            raise

    def _open(
        self,
        spec: StreamSpec,
        datasets: list[Dataset],
        encode: Callable[[Batch], Any],
        batches: Callable[[Plan], Sequence[int]] | None,
    ) -> BatchStream[Any]:
        if spec.sources:
            for source, dataset in zip(spec.sources, datasets, strict=True):
                check_version(source.dataset, source.version, dataset)
        else:
            check_version(spec.dataset, spec.dataset_version, datasets[0])
        records: Records = MixedDataset(datasets) if spec.sources else datasets[0]
        pipeline = pipeline_named(self.pipelines, spec.pipeline)
        for dataset in datasets:
            check_inputs(pipeline, dataset)
        try:
            check_batch_size(spec.batch_size, self.config.max_batch_size)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        plan = self._plan(spec, [dataset.num_samples for dataset in datasets])
        key, output = runner_key(
            pipeline, spec, batch_size=spec.batch_size, device=self.devices.kind
        )
        self._reserve_stream()
        ahead: StreamReadAhead | None = None
        try:
            key = dataclasses.replace(key, device_id=next(self._device_cycle))
            if self.readahead is not None:
                ahead = self.readahead.open(records)
            # A stream asks for a few batches beyond the pipelines' own prefetch, so that
            # one stream alone keeps more than one pipeline busy.
            window = self.config.prefetch + 2
            setup = StreamSetup(
                dataset=records,
                plan=plan,
                normalized=output.normalized,
                layout=output.layout,
                schedule=functools.partial(self.scheduler.ticket, key, 0, window=window),
                ahead=ahead,
                stages=self.stages,
                release=functools.partial(self._release, datasets, ahead),
                draining=self._drain.is_set,
                inputs=tuple((i.name, i.kind) for i in pipeline.inputs),
            )
            stream = BatchStream(setup, encode, None if batches is None else batches(plan))
            self._open_streams.add(stream)
            return stream
        except BaseException:
            if ahead is not None:
                ahead.close()
            self._uncount()
            raise

    def _plan(self, spec: StreamSpec, sizes: list[int]) -> Plan:
        try:
            return spec.plan(sizes if spec.sources else sizes[0])
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc

    def _context(self, key: RunnerKey) -> tuple[PipelineSpec, BuildContext]:
        pipeline = self.pipelines[key.pipeline]
        output = OutputSpec(
            dtype=key.dtype, layout=key.layout, mean=pipeline.mean, std=pipeline.std
        )
        return pipeline, BuildContext(
            device=key.device,
            output=output,
            host_padding=self.config.decoder_host_padding_mib << 20,
            device_padding=self.config.decoder_device_padding_mib << 20,
            hw_decoder_load=self.config.hw_decoder_load,
        )

    def _build_runner(self, key: RunnerKey) -> Runner:
        pipeline, ctx = self._context(key)
        return Runner(
            key,
            pipeline,
            ctx,
            num_threads=self.threads,
            prefetch=self.config.prefetch,
            stages=self.stages,
            health=self._pipeline_health,
        )

    def _reserve_stream(self) -> None:
        """Count a new stream, or refuse it at the limit (``_uncount`` uncounts it)."""
        with self._streams_lock:
            if self._streams >= self.config.max_streams:
                raise OverCapacity(
                    f"the server already serves {self._streams} streams, its limit "
                    f"(--max-streams {self.config.max_streams}); retry later or add servers"
                )
            self._streams += 1

    def _uncount(self) -> None:
        with self._streams_lock:
            self._streams -= 1

    def _release(self, datasets: list[Dataset], ahead: StreamReadAhead | None) -> None:
        """A stream ended: uncount it, end its read-ahead and give its datasets back."""
        self._uncount()
        if ahead is not None:
            ahead.close()  # before the datasets may close: it reads their maps
        for dataset in datasets:
            self._catalog.release(dataset)

    @property
    def active_streams(self) -> int:
        return self._streams

    def streams(self) -> list[BatchStream]:
        """The streams open now (for introspection and metrics)."""
        return [stream for stream in list(self._open_streams) if not stream.closed]

    # -- what it shows ---------------------------------------------------------------

    def stats(self) -> EngineStats:
        """What the stages, the scheduler's slots, the pipelines' faults and the read-ahead
        show now, read at once (for metrics; each part is read under its own lock)."""
        slots, waits = self.scheduler.stats.snapshot()
        health = self._pipeline_health
        return EngineStats(
            stage_seconds=self.stages.snapshot(),
            slots=slots,
            queue_waits=waits,
            queued=self.scheduler.queued(),
            faults=health.faults(),
            batches_failed=health.batches_failed(),
            devices=health.devices(),
            readahead=None if self.readahead is None else self.readahead.stats(),
            pipeline_slots=len(self.devices.device_ids) * self.config.slots_per_device,
        )

    def broken_devices(self) -> dict[str, str]:
        """The devices broken now (``cpu`` or a GPU's id), with why: a CUDA error, or
        faults in a row (see ``PipelineHealth``). Empty while every device runs."""
        return self._pipeline_health.broken()

    def watch_devices(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` whenever a device becomes broken or recovers, from the
        thread of the pipeline that showed it (what it returns is ignored)."""
        self._pipeline_health.listen(callback)

    # -- life cycle ------------------------------------------------------------------

    def warm_up(self) -> None:
        """Run one small batch of every dataset's first pipeline: proves DALI works."""
        names = self._catalog.names()
        if not names:
            log.warning("no datasets under %s: nothing to serve yet", self.config.data_dir)
            return
        name = names[0]
        pipeline = next(iter(self.pipelines))
        stream = self.open_stream(
            StreamSpec(
                dataset=name, pipeline=pipeline, batch_size=2, shuffle=False, drop_last=False
            ),
            batches=lambda plan: share_batches(plan)[:1],
        )
        try:
            batch = next(stream, None)
        finally:
            stream.close()
        if batch is None:
            log.warning("warm-up of pipeline %r on %r produced no batch", pipeline, name)
        else:
            log.info("pipeline %r warm on %s (%s)", pipeline, name, self.devices.kind)

    def preprocess(self, request: PreprocessRequest) -> Future[PreprocessResult]:
        """Validate and queue encoded images for a pipeline (see ``_preprocess``)."""
        return self.preprocessing.submit(request)

    @property
    def draining(self) -> bool:
        """Whether the engine drains (:meth:`drain`)."""
        return self._drain.is_set()

    def drain(self) -> None:
        """Refuse new streams and preprocessing (Draining), and end the streams open at
        their next batch, so that their clients resume elsewhere from their cursors."""
        self._drain.set()

    def close(self) -> None:
        self.preprocessing.close()
        # A stream whose handler was cancelled at shutdown before closing it would
        # otherwise outlive its pipeline and datasets.
        for stream in self.streams():
            stream.close()
        self.scheduler.close()
        if self.readahead is not None:
            self.readahead.close()
        self._catalog.close()
