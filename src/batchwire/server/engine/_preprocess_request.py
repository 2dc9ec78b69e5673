"""A preprocessing request, the limits it is checked against (:class:`PreprocessLimits`),
its result, and the pending request that gathers the result.

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

from batchwire.server.config import ServerConfig
from batchwire.server.errors import InvalidRequest, OverCapacity
from batchwire.server.pipelines import OutputSpec, PipelineSpec

__all__ = [
    "ImageFailure",
    "Pending",
    "PreprocessLimits",
    "PreprocessRequest",
    "PreprocessResult",
    "settle",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessRequest:
    """Encoded images to run through ``pipeline``; the caller owns the buffers."""

    pipeline: str
    images: Sequence[bytes]
    dtype: str = "uint8"
    layout: str = "NCHW"
    params: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PreprocessLimits:
    """What bounds preprocessing: ``batch_size`` images at most in a DALI run, which waits
    up to ``max_delay`` seconds for more; ``max_images`` and ``max_bytes`` per request;
    ``max_queued`` images waiting in all."""

    batch_size: int
    max_delay: float
    max_images: int
    max_bytes: int
    max_queued: int

    @classmethod
    def of(cls, config: ServerConfig) -> PreprocessLimits:
        """The limits a server's settings set."""
        return cls(
            batch_size=config.preprocess_batch_size,
            max_delay=config.preprocess_max_delay_ms / 1000,
            max_images=config.max_batch_size,
            max_bytes=config.max_request_bytes,
            max_queued=config.preprocess_max_queued,
        )

    def check(self, request: PreprocessRequest, pipeline: PipelineSpec) -> None:
        """InvalidRequest, or OverCapacity, unless ``request`` of ``pipeline`` (one of one
        output) is within the limits."""
        if pipeline.outputs:
            raise InvalidRequest(
                f"pipeline {pipeline.name!r} has several named outputs, which Preprocess does "
                "not return: stream them with RemoteLoader, or preprocess with a pipeline of "
                "one output (val, train)"
            )
        count = len(request.images)
        if count == 0:
            raise InvalidRequest("send at least one encoded image")
        if count > self.max_images:
            raise InvalidRequest(
                f"{count} images exceed this server's limit of {self.max_images} per request "
                "(server setting max_batch_size): send them in several requests"
            )
        if count > self.max_queued:
            raise InvalidRequest(
                f"{count} images exceed this server's preprocessing queue of {self.max_queued} "
                "(server setting preprocess_max_queued): send them in several requests"
            )
        size = sum(len(image) for image in request.images)
        if size > self.max_bytes:
            raise OverCapacity(
                f"the request holds {size} bytes of images, over this server's limit of "
                f"{self.max_bytes} (server setting max_request_bytes): send fewer images per request"
            )


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
