"""The DALI core: named pipelines, the scheduler that runs them for every stream, the engine.

Takes plain arguments and yields NumPy arrays; it never loads grpc. The serving layer
(:mod:`batchwire.server.serving`) adapts messages to :class:`~batchwire.common.stream.StreamSpec` and
:class:`Batch` and maps the errors below to status codes::

    engine = Engine(ServerConfig(data_dir="data"))
    engine.open_datasets()
    for batch in engine.open_stream(StreamSpec(dataset="pets", batch_size=64)):
        ...
"""

from __future__ import annotations

from batchwire.server.core._catalog import Change, DatasetDescription, check_data_dir
from batchwire.server.core._cpus import pipeline_threads, usable_cpus
from batchwire.server.core._devices import DeviceError, DevicePlan, visible_gpu_count
from batchwire.server.core._engine import Engine
from batchwire.server.core._errors import (
    Draining,
    InvalidRequest,
    NotFound,
    OverCapacity,
    PipelineFault,
    ServiceError,
    VersionMismatch,
)
from batchwire.server.core._health import FAULTS_IN_A_ROW, PipelineHealth
from batchwire.server.core._jobs import Job, Result, read_job
from batchwire.server.core._keys import RunnerKey
from batchwire.server.core._preprocess_request import PreprocessRequest, PreprocessResult
from batchwire.server.core._runner import Runner
from batchwire.server.core._scheduler import Scheduler, SchedulerStats
from batchwire.server.core._stages import STAGES, StageTimes
from batchwire.server.core._stream import Batch, BatchStream, share_batches, wait_event
from batchwire.server.core._ticket import Ticket

__all__ = [
    "FAULTS_IN_A_ROW",
    "STAGES",
    "Batch",
    "BatchStream",
    "Change",
    "DatasetDescription",
    "DeviceError",
    "DevicePlan",
    "Draining",
    "Engine",
    "InvalidRequest",
    "Job",
    "NotFound",
    "OverCapacity",
    "PipelineFault",
    "PipelineHealth",
    "PreprocessRequest",
    "PreprocessResult",
    "Result",
    "Runner",
    "RunnerKey",
    "Scheduler",
    "SchedulerStats",
    "ServiceError",
    "StageTimes",
    "Ticket",
    "VersionMismatch",
    "check_data_dir",
    "pipeline_threads",
    "read_job",
    "share_batches",
    "usable_cpus",
    "visible_gpu_count",
    "wait_event",
]
