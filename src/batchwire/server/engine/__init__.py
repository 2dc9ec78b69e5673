"""The engine: a server's streams over its datasets and pipelines, with no grpc.

:class:`Engine` takes the server's :class:`~batchwire.server.config.ServerConfig`, keeps the
catalog of datasets it serves (rescans, versions lent to streams), opens streams
(:class:`BatchStream`: the batches a client asks for, in order, each handed to the encoder
as a :class:`Batch`) and preprocesses images, on the runners (:mod:`batchwire.server.runners`)
that the scheduler (:mod:`batchwire.server.scheduling`) shares among streams. It takes plain
arguments and yields NumPy arrays; the serving layer (:mod:`batchwire.server.serving`) adapts
messages to :class:`~batchwire.common.stream.StreamSpec` and maps the errors of
:mod:`batchwire.server.errors` to status codes. What serving reads of the parts below is
the engine's to give, so that serving imports nothing below it (``tests/test_layout.py``):
:meth:`Engine.stats` (an :class:`EngineStats`, for metrics), :attr:`Engine.num_datasets`,
:meth:`Engine.broken_devices` and :meth:`Engine.watch_devices`::

    engine = Engine(ServerConfig(data_dir="data"))
    engine.open_datasets()
    for batch in engine.open_stream(StreamSpec(dataset="pets", batch_size=64)):
        ...
"""

from __future__ import annotations

from batchwire.server.engine._catalog import Change, DatasetDescription, check_data_dir
from batchwire.server.engine._cpus import pipeline_threads, usable_cpus
from batchwire.server.engine._devices import DeviceError, DevicePlan, visible_gpu_count
from batchwire.server.engine._engine import Engine
from batchwire.server.engine._gpu_wait import GPU_WAITS, gpu_wait_of, set_gpu_wait
from batchwire.server.engine._preprocess_request import PreprocessRequest, PreprocessResult
from batchwire.server.engine._stats import EngineStats
from batchwire.server.engine._stream import Batch, BatchStream, share_batches, wait_event

__all__ = [
    "GPU_WAITS",
    "Batch",
    "BatchStream",
    "Change",
    "DatasetDescription",
    "DeviceError",
    "DevicePlan",
    "Engine",
    "EngineStats",
    "PreprocessRequest",
    "PreprocessResult",
    "check_data_dir",
    "gpu_wait_of",
    "pipeline_threads",
    "set_gpu_wait",
    "share_batches",
    "usable_cpus",
    "visible_gpu_count",
    "wait_event",
]
