"""Checking that encoded images decode with DALI's own CPU decoder.

``ImageValidator`` runs the decoder the server uses (``fn.decoders.image``,
RGB) over batches fed through ``fn.external_source`` and reports, per image,
either the decoded shape or a short reason why it cannot be decoded. When a
batch raises and DALI names the sample it could not decode, that sample is
judged from that run and the rest of the batch runs again: one bad file is
decoded once, so DALI's own ``[ERROR]`` line about it is printed once. A batch
that raises again, or without naming a sample, is retried one image at a time.

DALI facts this relies on (DALI 2.4): after ``Pipeline.run`` raises, ``reset()``
makes the pipeline usable again, but only with the default (pipelined)
executor; with ``exec_pipelined=False`` the pipeline stays dead after an error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from batchwire.server.data.records import unsupported_reason

if TYPE_CHECKING:
    from nvidia.dali import Pipeline

__all__ = ["DEFAULT_BATCH_SIZE", "Decoded", "ImageValidator", "Undecodable"]

logger = logging.getLogger(__name__)

# Decoded buffers of a batch live in the pipeline at once (a 6000x4000 image
# is 72 MB): keep batches modest.
DEFAULT_BATCH_SIZE = 16
_INPUT = "encoded"


@dataclasses.dataclass(frozen=True, slots=True)
class Decoded:
    """An image that decodes: its shape as DALI's RGB decoder outputs it (HWC).

    EXIF orientation is applied, so a rotated photo has height and width swapped
    relative to its stored pixel grid.
    """

    height: int
    width: int
    channels: int


@dataclasses.dataclass(frozen=True, slots=True)
class Undecodable:
    """An image DALI cannot decode; ``reason`` is short and meant for people."""

    reason: str


class ImageValidator:
    """Decodes encoded images with DALI on the CPU to check that they are readable.

    Owns one DALI pipeline (and its worker threads) until ``close()``; not
    thread-safe. ``check`` accepts any number of images and feeds them in
    batches of at most ``batch_size``.
    """

    def __init__(self, *, batch_size: int = DEFAULT_BATCH_SIZE, num_threads: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        threads = num_threads or min(os.cpu_count() or 1, 8)
        if threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {threads}")
        self.batch_size = batch_size
        self._pipe: Pipeline | None = _build_pipeline(batch_size, threads)

    def check(self, images: Sequence[bytes | np.ndarray]) -> list[Decoded | Undecodable]:
        """The verdict for each image, in order. Never raises for bad image data."""
        if self._pipe is None:
            raise ValueError("ImageValidator is closed")
        verdicts: list[Decoded | Undecodable | None] = [None] * len(images)
        arrays: list[np.ndarray] = []
        where: list[int] = []
        for i, image in enumerate(images):
            array = np.frombuffer(image, dtype=np.uint8) if isinstance(image, bytes) else image
            if array.size == 0:
                verdicts[i] = Undecodable("empty file")
                continue
            reason = unsupported_reason(array)
            if reason is not None:
                # Never fed to DALI: it can crash on such input (see _formats).
                verdicts[i] = Undecodable(reason)
                continue
            arrays.append(array)
            where.append(i)
        for start in range(0, len(arrays), self.batch_size):
            chunk = arrays[start : start + self.batch_size]
            for offset, verdict in enumerate(self._check_batch(chunk)):
                verdicts[where[start + offset]] = verdict
        return [v for v in verdicts if v is not None]

    def close(self) -> None:
        """Release the pipeline; the validator cannot be used afterwards."""
        self._pipe = None

    def __enter__(self) -> ImageValidator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_batch(self, arrays: list[np.ndarray]) -> list[Decoded | Undecodable]:
        try:
            return [_decoded(shape) for shape in self._run(arrays)]
        except RuntimeError as exc:
            self._reset()
            culprit = _failed_sample(exc, len(arrays))
            if culprit is None:
                return self._check_one_by_one(arrays)
            verdict = Undecodable(_reason(exc, arrays[culprit]))
        rest = arrays[:culprit] + arrays[culprit + 1 :]
        verdicts: list[Decoded | Undecodable]
        try:
            verdicts = [_decoded(shape) for shape in self._run(rest)] if rest else []
        except RuntimeError:
            # Another bad one: rather than run the batch again per culprit, one by one.
            self._reset()
            verdicts = self._check_one_by_one(rest)
        verdicts.insert(culprit, verdict)
        return verdicts

    def _check_one_by_one(self, arrays: list[np.ndarray]) -> list[Decoded | Undecodable]:
        if len(arrays) > 1:
            logger.debug("a batch of %d images failed to decode; retrying one by one", len(arrays))
        verdicts: list[Decoded | Undecodable] = []
        for array in arrays:
            try:
                (shape,) = self._run([array])
            except RuntimeError as exc:
                self._reset()
                verdicts.append(Undecodable(_reason(exc, array)))
            else:
                verdicts.append(_decoded(shape))
        return verdicts

    def _reset(self) -> None:
        assert self._pipe is not None
        self._pipe.reset()

    def _run(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        assert self._pipe is not None
        self._pipe.feed_input(_INPUT, arrays)
        (shapes,) = self._pipe.run()
        return [np.asarray(shapes[i]) for i in range(len(shapes))]


def _build_pipeline(batch_size: int, num_threads: int) -> Pipeline:
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import Pipeline

    # device_id=None: a CPU-only pipeline, the same on GPU hosts. Depth 1 so
    # each run() decodes exactly the batch just fed; only shapes leave DALI.
    pipe = Pipeline(
        batch_size=batch_size, num_threads=num_threads, device_id=None, prefetch_queue_depth=1
    )
    with pipe:
        encoded = fn.external_source(name=_INPUT, dtype=types.DALIDataType.UINT8, ndim=1)
        images = fn.decoders.image(encoded, device="cpu", output_type=types.DALIImageType.RGB)
        pipe.set_outputs(images.shape())
    pipe.build()
    return pipe


def _decoded(shape: np.ndarray) -> Decoded:
    height, width, channels = (int(x) for x in shape)
    return Decoded(height=height, width=width, channels=channels)


# nvImageCodec status codes seen in DALI's messages.
_CODEC_STATUS = {
    2: "not a valid image",
    3: "corrupt image data",
    4: "not an image format DALI can decode",
}


_FAILED_SAMPLE = re.compile(r"Failed to decode sample #(\d+)")


def _failed_sample(exc: RuntimeError, count: int) -> int | None:
    """The index in its batch of the sample DALI says it could not decode, if it says."""
    found = _FAILED_SAMPLE.search(str(exc))
    index = int(found.group(1)) if found else -1
    return index if 0 <= index < count else None


def _reason(exc: RuntimeError, array: np.ndarray) -> str:
    head = array[:8].tobytes()
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF: DALI's image decoder does not support GIF"
    message = str(exc)
    if "Failed to decode sample" in message:
        return "corrupt or truncated image data"
    status = re.search(r"nvImageCodec failure: '#(\d+)'", message)
    if status:
        code = int(status.group(1))
        return _CODEC_STATUS.get(code, f"DALI cannot decode it (nvImageCodec status {code})")
    # Keep the operator's own words, without DALI's pipeline traceback.
    detail = message.rsplit("encountered:", 1)[-1]
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    lines = [ln for ln in lines if "pipeline object is no longer valid" not in ln]
    return "DALI cannot decode it: " + (lines[0][:160] if lines else "unknown error")
