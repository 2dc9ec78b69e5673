"""Which samples made a batch fail: bisection through a synchronous copy of the graph.

DALI cannot leave a sample out of a batch it is running, so a failed batch is taken
apart: its halves run through a synchronous copy of the pipeline (a *probe*), a half that
fails is halved again, down to single samples. ``k`` bad samples of ``n`` cost about
``2k·log2(n/k)`` probe runs instead of ``n``.

What bisection shows decides between a bad sample and a broken pipeline:

* a failure that names no sample (out of memory, CUDA) is a fault at once;
* the control, a sample known to have run (see
  :class:`~batchwire.server.runners._health.PipelineHealth`), is tried first: if it fails
  too, the pipeline is broken whatever the batch holds (kind ``control``), found in one
  run rather than ``2n``;
* a set of samples that fails while both its halves run is a fault (kind ``batch``):
  the pipeline fails on samples that run fine apart.

Without a control (no batch has run on the server yet), samples that fail alone are
taken to be bad, even all of a batch's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from batchwire.server.errors import PipelineFault
from batchwire.server.runners._dali import error_line, fault_kind, release
from batchwire.server.runners._jobs import Job

__all__ = ["Probe", "find_culprits"]

log = logging.getLogger(__name__)

_Inputs = tuple[Any, ...]


class Probe:
    """A synchronous pipeline of ``build(source)`` that runs given samples once each call.

    A synchronous pipeline is dead after an error, so a failed run replaces it.
    """

    def __init__(self, build: Callable[[Callable[[], _Inputs]], Any]) -> None:
        self._build = build
        self._inputs: list[_Inputs] = []
        self._pipe: Any = None

    def _source(self) -> _Inputs:
        if not self._inputs:
            raise StopIteration
        return self._inputs.pop()

    def error(
        self,
        images: list[np.ndarray],
        labels: np.ndarray,
        fields: tuple[list[np.ndarray], ...] = (),
    ) -> Exception | None:
        """Why running ``images`` (with their ``fields``, if the pipeline takes some)
        failed, or None when they ran."""
        if self._pipe is None:
            self._pipe = self._build(self._source)  # PipelineFault when it cannot be built
        meta = np.stack([np.zeros(len(images), np.int64), np.arange(len(images))], axis=1)
        # A probe's draws are its own (no entropy): whether a sample fails does not
        # depend on them.
        self._inputs[:] = [(images, labels, meta, *fields, ())]
        try:
            self._pipe.run()
        except Exception as exc:
            release(self._pipe)
            self._pipe = None
            return exc
        return None


def find_culprits(
    job: Job,
    error: Exception,
    probe: Probe,
    *,
    pipeline: str,
    control: tuple[np.ndarray, int] | None,
) -> list[int]:
    """Positions in ``job`` of the samples that made it fail with ``error``; raises
    :class:`PipelineFault` when the failure is not theirs (see the module docstring)."""

    def fails(positions: list[int]) -> Exception | None:
        images = [job.images[i] for i in positions]
        fields = tuple([values[i] for i in positions] for values in job.fields)
        found = probe.error(images, job.labels[positions], fields)
        if found is not None and (kind := fault_kind(found)) is not None:
            raise PipelineFault(pipeline, kind, error_line(found)) from found
        return found

    if control is not None:
        image, label = control
        found = probe.error([image], np.array([label], np.int64))
        if found is not None:
            kind = fault_kind(found) or "control"
            raise PipelineFault(pipeline, kind, error_line(found)) from found
    bad: list[int] = []

    def search(positions: list[int], failure: Exception) -> None:
        """``positions`` fail together with ``failure``: find which of them fail."""
        if len(positions) == 1:
            parts = [positions]
        else:
            middle = len(positions) // 2
            parts = [positions[:middle], positions[middle:]]
        failing = [(part, found) for part in parts if (found := fails(part)) is not None]
        if not failing:
            raise PipelineFault(pipeline, "batch", error_line(failure)) from failure
        for part, found in failing:
            if len(part) == 1:
                bad.append(part[0])
            else:
                search(part, found)

    search(list(range(len(job.ids))), error)
    if control is None and len(bad) == len(job.ids):
        log.warning(
            "pipeline %r: every sample of a batch fails alone, and no batch has run on this "
            "server yet to tell bad samples from a broken pipeline: skipping them",
            pipeline,
        )
    return sorted(bad)
