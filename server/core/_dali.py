"""A DALI pipeline built for a :class:`PipelineSpec`, and its outputs as NumPy arrays.

The pipeline reads its input through ``fn.external_source`` from a callback that
returns a job's encoded images, labels and ``(seq, id)`` rows (:meth:`Job.inputs`);
it emits images, labels and those rows, which name each output sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchwire.server.core._pipelines import BuildContext, PipelineSpec

__all__ = ["build_pipeline", "error_line", "to_numpy", "view"]


def build_pipeline(
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


def to_numpy(tensor_list: Any) -> np.ndarray:
    """A copy of a DALI output that owns its memory."""
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return np.asarray(tensor_list.as_array())


def view(tensor_list: Any) -> np.ndarray:
    """A DALI output as an array over DALI's own buffer (no copy), valid until the
    pipeline's next run; a copy where the samples' shapes differ."""
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    if not tensor_list.is_dense_tensor():
        return np.asarray(tensor_list.as_array())
    return np.asarray(tensor_list.as_tensor())


def error_line(exc: BaseException) -> str:
    """The gist of a pipeline's error for a log line: its last line (DALI's are long)."""
    message = str(exc).strip().splitlines()
    return message[-1] if message else type(exc).__name__
