"""A DALI pipeline built for a :class:`PipelineSpec`, and its outputs as NumPy arrays.

The pipeline reads its input through ``fn.external_source`` from a callback that
returns a job's encoded images, labels and ``(seq, id)`` rows (:meth:`Job.inputs`);
it emits images, labels and those rows, which name each output sample.

DALI reports every failure as a ``RuntimeError`` whose text says what happened:
:func:`fault_kind` reads the failures that are never about a sample (memory, CUDA) from
it, and :func:`error_line` its gist for a log line or a client's message.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from batchwire.server.errors import PipelineFault
from batchwire.server.pipelines import BuildContext, Draws, PipelineSpec

__all__ = [
    "build_pipeline",
    "encoded_batch",
    "error_line",
    "fault_kind",
    "release",
    "samples",
    "to_numpy",
    "view",
]

log = logging.getLogger(__name__)

# DALI's words for failures that no sample causes, by PipelineFault kind (CUDA's error
# names, its allocators' messages, host allocation).
_OUT_OF_MEMORY = re.compile(
    r"out of memory|bad_alloc|allocation failed|can't allocate|cannot allocate memory|"
    r"failed to allocate memory|insufficient memory|cudaErrorMemoryAllocation|"
    r"CUDA_ERROR_OUT_OF_MEMORY|NVJPEG_STATUS_ALLOCATOR_FAILURE",
    re.IGNORECASE,
)
_CUDA = re.compile(
    r"CUDA (runtime|driver) API error|a CUDA call has failed|cudaError|CUDA_ERROR|"
    r"illegal (memory )?(address|access)|launch failure|\bnvml\b|ECC error",
    re.IGNORECASE,
)
# Lines of DALI's messages that say nothing about the cause.
_BOILERPLATE = ("Critical error in pipeline:", "Current pipeline object is no longer valid.")


def build_pipeline(
    pipeline: PipelineSpec,
    params: dict[str, float],
    ctx: BuildContext,
    *,
    batch_size: int,
    num_threads: int,
    device_id: int | None,
    prefetch: int,
    source: Any,
    synchronous: bool = False,
) -> Any:
    """A built pipeline of ``pipeline``'s graph fed by ``source``; PipelineFault (kind "build",
    or "out_of_memory"/"cuda" when DALI says so) when it cannot be built."""
    from nvidia.dali import Pipeline

    try:
        pipe = Pipeline(
            batch_size=batch_size,
            num_threads=num_threads,
            device_id=device_id,
            prefetch_queue_depth=prefetch,
            # A synchronous pipeline calls its source exactly once per run and has
            # nothing in flight: what the probe that looks for bad samples needs.
            exec_pipelined=not synchronous,
            exec_async=not synchronous,
        )
        _define(pipe, pipeline, params, ctx, source)
    except Exception as exc:  # DALI's own, or whatever the pipeline's function raised
        raise PipelineFault(pipeline.name, fault_kind(exc) or "build", error_line(exc)) from exc
    return pipe


def release(pipe: Any) -> None:
    """Shut a discarded pipeline down now, in this thread. DALI's ``Pipeline`` shuts down
    only in ``__del__``, wherever its last reference goes: an error it raised holds it in
    its traceback, and where that error is let go in one of the pipeline's own threads, its
    shutdown joins that thread and the process aborts ("Resource deadlock avoided").
    ``Pipeline._shutdown`` (DALI's, idempotent) makes the later ``__del__`` do nothing."""
    if pipe is None:
        return
    try:
        pipe._shutdown()
    except RuntimeError as exc:  # a pipeline broken past shutting down: nothing to keep
        log.debug("a discarded pipeline did not shut down cleanly: %s", exc)


def _define(
    pipe: Any,
    pipeline: PipelineSpec,
    params: dict[str, float],
    ctx: BuildContext,
    source: Any,
) -> None:
    """Define ``pipeline``'s graph on ``pipe``, fed by ``source``, and build it.

    ``source`` returns a job's inputs (:meth:`Job.inputs`) and, last, the entropy of its
    random draws: where DALI takes random states as inputs, they are fed beside the
    inputs, one per random operator the graph takes from ``ctx.rng()`` (:class:`Draws`)."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    kinds = {"int": types.INT64, "float": types.FLOAT}
    drawn = random_states_fed()
    draws = Draws() if drawn else None

    def feed() -> tuple[Any, ...]:  # DALI takes a callable of no arguments, not a partial
        return _feed(source, draws)

    with pipe:
        encoded, labels, meta, *fields = fn.external_source(
            source=feed,
            num_outputs=3 + len(pipeline.inputs) + drawn,
            batch=True,
            dtype=[types.UINT8, types.INT64, types.INT64]
            + [kinds.get(i.kind, types.UINT8) for i in pipeline.inputs]
            + [types.UINT32] * drawn,
            # The fields' dimensions are the dataset's (boxes 2, their classes 1): found
            # in the first batch.
            ndim=None if pipeline.inputs else [1, 0, 1] + [2] * drawn,
            # The records are in a buffer read for this batch and never written again:
            # DALI reads them in place (and holds them until it has), no copy of its own;
            # a job's fields are arrays of its own, likewise.
            no_copy=True,
        )
        if draws is not None:
            *fields, states = fields
            draws.feed(states)
            ctx = dataclasses.replace(ctx, draws=draws)
        if pipeline.inputs:
            named = {i.name: node for i, node in zip(pipeline.inputs, fields, strict=True)}
            made = pipeline.function(encoded, labels, ctx, params, named)
        else:
            made = pipeline.function(encoded, labels, ctx, params)
        pipe.set_outputs(*_outputs(pipeline, made, labels), meta)
    with warnings.catch_warnings():
        # A graph without random operators leaves the states unused: DALI warns of it.
        warnings.filterwarnings("ignore", message="The external source node .* is not used")
        pipe.build()


def _outputs(pipeline: PipelineSpec, made: Any, labels: Any) -> tuple[Any, ...]:
    """The nodes ``pipeline``'s function ``made`` as the pipe's outputs, in order: its images
    and labels, or its named outputs, the samples' ``labels`` after them."""
    if not pipeline.outputs:
        images, labels = made
        return images, labels
    missing = [o.name for o in pipeline.outputs if o.name not in made]
    if missing:
        raise ValueError(
            f"pipeline {pipeline.name!r} declares outputs {missing} that its function "
            f"does not return (it returned {sorted(made)})"
        )
    # The samples' labels pass through, as a one-output pipeline's do.
    return (*(made[o.name] for o in pipeline.outputs), labels)


def _feed(source: Any, draws: Draws | None) -> tuple[Any, ...]:
    """``source``'s inputs for DALI: its entropy turned into the batch's random states
    where the graph takes them (``draws``), else left out."""
    *inputs, entropy = source()
    if draws is None:
        return tuple(inputs)
    return (*inputs, _states(draws.count, entropy, len(inputs[1])))


def _states(count: int, entropy: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """The ``count`` random states of a batch of ``batch_size`` samples whose draws
    ``entropy`` fixes (empty: fresh entropy, draws of their own), as
    ``fn.external_source`` takes them: the rows of DALI's states, the same for every
    sample (DALI reads a batch's from its first)."""
    seeds = np.random.SeedSequence(list(entropy) or None)
    rows = seeds.generate_state(max(count, 1) * Draws.WORDS, np.uint32).reshape(-1, Draws.WORDS)
    return [rows] * batch_size


@functools.cache
def random_states_fed() -> bool:
    """Whether DALI's random operators take their states as inputs (DALI 2's
    ``_random_state``): then a batch's draws are a function of the batch."""
    from nvidia.dali import backend

    try:
        return bool(backend.GetSchema("random__CoinFlip").HasRandomStateArg())
    except AttributeError:
        return False


def encoded_batch(images: list[np.ndarray]) -> Any:
    """A batch's encoded images as one DALI ``TensorListCPU`` over their own bytes (no
    copy; it holds them until DALI is done). Given the list, ``external_source`` would
    build the same, checking each sample's type in Python on the way: twice the time."""
    from nvidia.dali.backend import TensorCPU, TensorListCPU

    return TensorListCPU([TensorCPU(image) for image in images], None, False)


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


def samples(tensor_list: Any) -> list[np.ndarray]:
    """A DALI output's samples, each an array of its own (their shapes may differ): DALI's
    ``at`` copies a sample out, once."""
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return [np.asarray(tensor_list.at(i)) for i in range(len(tensor_list))]


def error_line(exc: BaseException) -> str:
    """The gist of a pipeline's error for a log line (DALI's run to dozens of lines): the
    first line after DALI's "encountered:", else the last line that says something."""
    lines = [line.strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line and line not in _BOILERPLATE]
    if "encountered:" in lines[:-1]:
        return lines[lines.index("encountered:") + 1]
    return lines[-1] if lines else type(exc).__name__


def fault_kind(exc: BaseException) -> str | None:
    """ "out_of_memory" or "cuda" when ``exc`` says so (no sample is to blame: the device
    or the host is), else None: the failure may be a sample's."""
    if isinstance(exc, MemoryError):
        return "out_of_memory"
    text = str(exc)
    if _OUT_OF_MEMORY.search(text):
        return "out_of_memory"
    if _CUDA.search(text):
        return "cuda"
    return None
