"""The waiting pipeline: a stand-in for a GPU's work on a host without one.

Each batch's work is a wait (``wait_ms``, default 20 ms a batch, in DALI's
``fn.python_function``) that leaves the CPU idle, as a pipeline waiting for its GPU does;
each sample comes out a ``size`` x ``size`` x 3 uint8 image (default 16) of zeros. So what a
server spends on the CPU around the pipeline (records, scheduling, per-batch Python, the
copy of the output, the transport) is all its CPU, and whether it keeps every pipeline
busy shows as images/s: ``python -m benchmarks --host-trainers 1,2,4,8,16 --pipeline wait``.

DALI runs the Python functions of one process one at a time (whatever the pipelines), so a
server process completes at most ``1000 / wait_ms`` batches a second however many pipeline
slots it has: its workers (``--workers``) are what runs waits side by side, as GPUs would.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["WAIT_TOML", "waiting"]

# The waiting pipeline as a server config's [pipelines] table names it.
WAIT_TOML = """
[pipelines.wait]
function = "batchwire.bench._wait:waiting"
description = "a wait of wait_ms a batch (the CPU idle, as for a GPU), size x size x 3 zeros a sample"
params = { wait_ms = { default = 20, low = 0, high = 1000 }, size = { default = 16, low = 1, high = 256, integer = true } }
"""


def waiting(encoded: Any, labels: Any, ctx: Any, p: Mapping[str, float]) -> tuple[Any, Any]:
    """A batch's work is a wait of ``wait_ms`` ms; each sample a ``size`` x ``size`` x 3
    uint8 image of zeros, laid out as every pipeline's output."""
    import nvidia.dali.fn as fn

    seconds = float(p["wait_ms"]) / 1000
    size = int(p["size"])

    zeros = np.zeros((size, size, 3), np.uint8)  # DALI copies each sample out of it

    def wait(batch: list[np.ndarray]) -> list[np.ndarray]:
        time.sleep(seconds)
        return [zeros] * len(batch)

    images = fn.python_function(
        encoded, function=wait, batch_processing=True, num_outputs=1, output_layouts="HWC"
    )
    if ctx.device == "gpu":
        images = images.gpu()
    return ctx.finish(images), labels
