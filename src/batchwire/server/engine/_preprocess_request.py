"""A preprocessing request, its result, and the pending request that gathers the result.

A request's images travel through the batcher's queues in parts; :class:`Pending` collects
each part's rows and failures and, once the last part is done, completes the request's
future with a :class:`PreprocessResult`. Never imports grpc.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from batchwire.server.errors import InvalidRequest
from batchwire.server.pipelines import OutputSpec, PipelineSpec

__all__ = ["ImageFailure", "Pending", "PreprocessRequest", "PreprocessResult", "settle"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessRequest:
    """Encoded images to run through ``pipeline``; the caller owns the buffers."""

    pipeline: str
    images: Sequence[bytes]
    dtype: str = "uint8"
    layout: str = "NCHW"
    params: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ImageFailure:
    """Image ``index`` of a request could not be preprocessed, because ``reason``."""

    index: int
    reason: str


@dataclasses.dataclass(frozen=True)
class PreprocessResult:
    """``images[i]`` is the request's image ``indices[i]``; the rest are in ``failures``.

    ``images`` owns its memory; it has shape ``(0,)`` when nothing succeeded.
    """

    images: np.ndarray
    indices: tuple[int, ...]
    failures: tuple[ImageFailure, ...]
    normalized: bool
    layout: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


def settle(
    future: concurrent.futures.Future[PreprocessResult],
    *,
    result: PreprocessResult | None = None,
    exception: BaseException | None = None,
) -> None:
    """Complete ``future`` unless it is already done (the client may have cancelled it)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except concurrent.futures.InvalidStateError:
        pass


class Pending:
    """A submitted request whose parts are on their way through the queues."""

    def __init__(self, size: int, parts: int, output: OutputSpec, pipeline: PipelineSpec) -> None:
        self.future: concurrent.futures.Future[PreprocessResult] = concurrent.futures.Future()
        self.rows: list[np.ndarray | None] = [None] * size
        self.reasons: dict[int, str] = {}
        self.parts_left = parts
        self.output = output
        self.pipeline = pipeline
        self.lock = threading.Lock()

    def fail(self, index: int, reason: str) -> None:
        self.reasons[index] = reason

    def part_done(self) -> None:
        with self.lock:
            self.parts_left -= 1
            if self.parts_left > 0:
                return
        try:
            result = self._result()
        except Exception as exc:  # e.g. rows of different shapes from a custom pipeline
            settle(self.future, exception=exc)
        else:
            settle(self.future, result=result)

    def _result(self) -> PreprocessResult:
        indices = tuple(i for i, row in enumerate(self.rows) if row is not None)
        if indices:
            rows = [self.rows[i] for i in indices]
            shapes = {row.shape for row in rows}  # type: ignore[union-attr]
            if len(shapes) > 1:
                raise InvalidRequest(
                    f"pipeline {self.pipeline.name!r} gave images of different shapes "
                    f"{sorted(shapes)}: preprocessing needs one output shape (crop to a size)"
                )
            images = np.stack(rows)  # type: ignore[arg-type]
        else:
            images = np.zeros((0,), dtype=np.uint8)
        failures = tuple(ImageFailure(i, self.reasons[i]) for i in sorted(self.reasons))
        return PreprocessResult(
            images=images,
            indices=indices,
            failures=failures,
            normalized=self.output.normalized,
            layout=self.output.layout,
            mean=tuple(self.pipeline.mean),
            std=tuple(self.pipeline.std),
        )
