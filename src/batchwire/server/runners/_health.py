"""What the server's pipelines have shown: faults, broken devices, a sample known to run.

Every :class:`~batchwire.server.runners._runner.Runner` of a server reports here each batch
it ran and each :class:`PipelineFault` that ended its run. From that:

* **A control sample.** An encoded image of the last batch that ran. When every sample
  of a failed batch also fails alone, the control is tried: if it fails too, the
  pipeline is broken (a fault), else the samples are bad (skipped).
* **Output shapes.** The shape of one output sample per pipeline configuration, so that
  a batch whose every sample was skipped still comes out with the right trailing shape.
* **Broken devices.** A device is broken after a CUDA error on it (for good: a CUDA
  context does not recover from most errors; restart the server), or after
  ``faults_in_a_row`` faults on it with no batch run there between them (until a batch
  runs there again). While a device is broken the server reports NOT_SERVING.
* **Counts** of faults by pipeline and kind, and of the batches they failed, for metrics.

Thread-safe: runners report from their own threads; listeners are called from them.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from batchwire.server.errors import FAULT_KINDS, PipelineFault
from batchwire.server.runners._keys import RunnerKey

__all__ = ["FAULTS_IN_A_ROW", "PipelineHealth", "device_label"]

log = logging.getLogger(__name__)

FAULTS_IN_A_ROW = 3  # faults on a device, with no batch run between, that make it broken

# (pipeline, params, dtype, layout): what fixes the shape of an output sample.
_ShapeKey = tuple[str, tuple[tuple[str, float], ...], str, str]


def device_label(device_id: int | None) -> str:
    """A device as logs and metrics name it: "cpu", or the GPU's id."""
    return "cpu" if device_id is None else str(device_id)


class PipelineHealth:
    """See the module docstring. ``devices`` are the device ids the pipelines run on."""

    def __init__(
        self, devices: Sequence[int | None] = (None,), *, faults_in_a_row: int = FAULTS_IN_A_ROW
    ) -> None:
        self._lock = threading.Lock()
        self._faults_in_a_row = faults_in_a_row
        self._streaks = dict.fromkeys(devices, 0)
        self._broken: dict[int | None, str] = {}  # device -> why
        self._for_good: set[int | None] = set()  # broken by a CUDA error
        self._control: tuple[np.ndarray, int] | None = None
        self._shapes: dict[_ShapeKey, tuple[tuple[int, ...], np.dtype]] = {}
        # A pipeline of named outputs: the heads of its last batch (Batch.outputs).
        self._heads: dict[_ShapeKey, tuple[Any, ...]] = {}
        self._faults: collections.Counter[tuple[str, str]] = collections.Counter()
        self._batches_failed: collections.Counter[str] = collections.Counter()
        self._listeners: list[Callable[[], object]] = []

    def listen(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` whenever a device becomes broken or recovers (what it returns
        is ignored)."""
        self._listeners.append(callback)

    # -- reports --------------------------------------------------------------------------

    def ran(
        self,
        key: RunnerKey,
        images: np.ndarray | None,
        image: np.ndarray,
        label: int,
        heads: tuple[Any, ...] = (),
    ) -> None:
        """A batch of ``key`` ran, its output ``images`` (a pipeline of named outputs: None,
        and the ``heads`` of its outputs); ``image`` (encoded) was in it."""
        shape_key = (key.pipeline, key.params, key.dtype, key.layout)
        control = (np.array(image, copy=True), int(label))  # owns its bytes
        with self._lock:
            self._control = control
            if images is None:
                self._heads[shape_key] = heads
            else:
                self._shapes[shape_key] = (tuple(images.shape[1:]), images.dtype)
            self._streaks[key.device_id] = 0
            recovered = key.device_id in self._broken and key.device_id not in self._for_good
            if recovered:
                del self._broken[key.device_id]
        if recovered:
            log.info("device %s runs batches again", device_label(key.device_id))
            self._notify()

    def failed(self, key: RunnerKey, fault: PipelineFault, batches: int) -> None:
        """A fault ended a run of ``key``'s pipeline, failing ``batches`` batches: logged
        here, once (DALI's whole message at DEBUG)."""
        device = key.device_id
        log.error(
            "pipeline %r failed on device %s (%s: %s); the %d batches it held fail over",
            key.pipeline,
            device_label(device),
            FAULT_KINDS[fault.kind],
            fault.cause,
            batches,
        )
        log.debug("pipeline %r: the fault in full", key.pipeline, exc_info=fault)
        with self._lock:
            self._faults[(key.pipeline, fault.kind)] += 1
            self._batches_failed[key.pipeline] += batches
            self._streaks[device] = self._streaks.get(device, 0) + 1
            why = None
            if fault.kind == "cuda":
                self._for_good.add(device)
                why = f"a CUDA error ({fault.cause}); restart the server"
            elif self._streaks[device] >= self._faults_in_a_row and device not in self._broken:
                why = f"{self._streaks[device]} pipeline faults in a row, the last: {fault.cause}"
            newly = why is not None and device not in self._broken
            if why is not None:
                self._broken[device] = why
        if newly:
            log.error(
                "device %s is broken (%s): health reports NOT_SERVING", device_label(device), why
            )
            self._notify()

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback()

    # -- what they show ---------------------------------------------------------------------

    def control(self) -> tuple[np.ndarray, int] | None:
        """An encoded image and its label from the last batch that ran, if any did."""
        with self._lock:
            return self._control

    def output_shape(self, key: RunnerKey) -> tuple[tuple[int, ...], np.dtype] | None:
        """The shape and dtype of one output sample of ``key``'s configuration, once one
        of its batches ran (on any device, at any batch size)."""
        with self._lock:
            return self._shapes.get((key.pipeline, key.params, key.dtype, key.layout))

    def output_heads(self, key: RunnerKey) -> tuple[Any, ...]:
        """The heads of the named outputs of ``key``'s configuration, once one of its
        batches ran (on any device, at any batch size); none before."""
        with self._lock:
            return self._heads.get((key.pipeline, key.params, key.dtype, key.layout), ())

    def broken(self) -> dict[str, str]:
        """The devices broken now (by label), with why."""
        with self._lock:
            return {device_label(d): why for d, why in self._broken.items()}

    def devices(self) -> dict[str, bool]:
        """Every device the pipelines ran on (by label), and whether it is healthy."""
        with self._lock:
            devices = set(self._streaks) | set(self._broken)
            return {device_label(d): d not in self._broken for d in devices}

    def faults(self) -> dict[tuple[str, str], int]:
        """Faults so far, by (pipeline, kind)."""
        with self._lock:
            return dict(self._faults)

    def batches_failed(self) -> dict[str, int]:
        """Batches failed by faults so far, by pipeline."""
        with self._lock:
            return dict(self._batches_failed)
