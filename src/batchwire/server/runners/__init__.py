"""Runners: DALI pipelines built and run. A :class:`Runner` is one built pipeline for one
:class:`RunnerKey` (pipeline, parameters, batch size, output, device), which runs the
:class:`Job` of any stream of that key (a batch's screened records, from the record path)
and yields its :class:`Batch`. A batch that fails is bisected for the samples to blame,
which are skipped; a failure no sample causes is a :class:`~batchwire.server.errors.PipelineFault`,
which :class:`PipelineHealth` counts. :class:`StageTimes` adds up where the time goes.
Needs DALI only when a runner is built; never loads grpc.
"""

from __future__ import annotations

from batchwire.server.runners._dali import fault_kind
from batchwire.server.runners._health import FAULTS_IN_A_ROW, PipelineHealth
from batchwire.server.runners._jobs import Batch, Job, batch_entropy, empty_result, keep, read_job
from batchwire.server.runners._keys import OutputRequest, RunnerKey, pipeline_named, runner_key
from batchwire.server.runners._runner import Runner
from batchwire.server.runners._stages import STAGES, StageTimes

__all__ = [
    "FAULTS_IN_A_ROW",
    "STAGES",
    "Batch",
    "Job",
    "OutputRequest",
    "PipelineHealth",
    "Runner",
    "RunnerKey",
    "StageTimes",
    "batch_entropy",
    "empty_result",
    "fault_kind",
    "keep",
    "pipeline_named",
    "read_job",
    "runner_key",
]
