"""``Preprocessor``: encoded images in, preprocessed tensors out, by a server's pipeline.

For serving-time preprocessing: a model server sends the JPEG/PNG bytes it
received and gets back the tensor a pipeline (usually ``val``) makes of them,
exactly as ``RemoteLoader`` would serve those images from a dataset. The
server batches the images of concurrent requests into one DALI batch.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from batchwire.client._delivery import channel_stats, normalize
from batchwire.client._transport import (
    BadImagesError,
    ChannelSecurity,
    GrpcTransport,
    InvalidArgumentError,
    PemSource,
    Pending,
    Server,
    Transport,
    check_target,
)
from batchwire.common.stream import LAYOUTS, OUTPUT_DTYPES, check_name
from batchwire.common.tensors import from_proto
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["ImageError", "Preprocessed", "Preprocessor"]

# Requests are cut so that each stays well inside a server's default
# max_request_bytes (64 MiB) and batches well with other clients' requests.
_REQUEST_IMAGES = 64
_REQUEST_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class ImageError:
    """Image ``index`` of the list passed in could not be preprocessed, because ``reason``."""

    index: int
    reason: str


class Preprocessed(NamedTuple):
    """What ``Preprocessor(images)`` returns; unpacks as ``images, indices, errors``.

    ``images`` has one row per image that succeeded, in input order;
    ``indices[i]`` (int64) is the position in the input list of row ``i``, so
    ``images[i]`` belongs to ``inputs[indices[i]]``. ``errors`` lists the
    images that failed. With no failure, ``indices`` is ``0..len-1``.
    """

    images: torch.Tensor
    indices: torch.Tensor
    errors: list[ImageError]

    def raise_for_errors(self) -> Preprocessed:
        """Raise ``BadImagesError`` if any image failed; else return ``self``."""
        if self.errors:
            shown = "; ".join(f"image {e.index}: {e.reason}" for e in self.errors[:3])
            more = f" (and {len(self.errors) - 3} more)" if len(self.errors) > 3 else ""
            raise BadImagesError(
                f"{len(self.errors)} of {len(self.errors) + len(self.indices)} images could "
                f"not be preprocessed: {shown}{more}",
                errors=tuple(self.errors),
            )
        return self


class Preprocessor:
    """Preprocess encoded images with a named pipeline on a batchwire server.

    ``preprocessor(images)`` takes a list of encoded image files (``bytes``,
    as read with ``open(path, "rb").read()`` or received by a model server)
    and returns :class:`Preprocessed` ``(images, indices, errors)``. With
    ``normalize=True`` (default) ``images`` is float32 normalized on
    ``device`` with the pipeline's mean/std, as ``RemoteLoader`` does; with
    ``normalize=False`` it is the tensor as served (uint8 NCHW for the
    presets). ``dtype="float16"|"float32"`` normalizes on the server instead,
    ``layout="NHWC"`` changes the layout and ``params`` overrides declared
    pipeline parameters (e.g. ``{"size": 256}``).

    An image that cannot be decoded (random bytes, a GIF, a truncated file) is
    left out of ``images`` and reported in ``errors`` with its index and a
    reason; the other images still come back, and ``indices`` maps rows back
    to inputs. Call ``.raise_for_errors()`` on the result for all-or-nothing.
    Request-level failures raise ``BatchwireError`` subclasses
    (``NotFoundError`` for an unknown pipeline, ``InvalidArgumentError``,
    ``ResourceExhaustedError`` when the server's queue is full,
    ``UnavailableError``, ``AuthenticationError``).

    The pipeline ``train`` (or any random pipeline) is allowed and gives a
    new random crop and flip on every call. Long lists are sent as several
    requests of at most 64 images, at most ``max_in_flight`` at a time.
    ``timeout`` is seconds per request. Thread-safe; the channel opens on
    first use (and again after a fork). ``close()`` or a ``with`` block
    closes it.
    """

    def __init__(
        self,
        address: str,
        *,
        pipeline: str = "val",
        device: str | torch.device | None = None,
        normalize: bool = True,
        dtype: str = "uint8",
        layout: str = "NCHW",
        params: Mapping[str, float] | None = None,
        timeout: float = 60.0,
        max_in_flight: int = 4,
        token: str | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
    ) -> None:
        checks = (
            (isinstance(address, str) and bool(address), "address must be 'host:port'"),
            (
                dtype in OUTPUT_DTYPES,
                f"dtype must be one of {sorted(OUTPUT_DTYPES)}, got {dtype!r}",
            ),
            (layout in LAYOUTS, f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}"),
            (timeout > 0, f"timeout must be positive, got {timeout}"),
            (max_in_flight >= 1, f"max_in_flight must be at least 1, got {max_in_flight}"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidArgumentError(message)
        check_target(address)
        try:
            check_name("pipeline", pipeline)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from exc
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgumentError(
                f"device={device!r} but torch sees no CUDA device; use device='cpu'"
            )
        self._security = ChannelSecurity.from_options(
            token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        self.address = address
        self.pipeline = pipeline
        self.normalize = normalize
        self.dtype = dtype
        self.layout = layout
        self.params = dict(params or {})
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self._transport: Transport = GrpcTransport(self._security)

    # -- calls -------------------------------------------------------------------------

    def __call__(self, images: Sequence[bytes]) -> Preprocessed:
        """Preprocess ``images`` (encoded files); see the class docstring."""
        if isinstance(images, bytes | bytearray | memoryview | str):
            raise InvalidArgumentError(
                "pass a list of encoded images, e.g. [data], not a single one"
            )
        encoded = [_as_bytes(i, image) for i, image in enumerate(images)]
        rows: list[np.ndarray] = []
        indices: list[int] = []
        errors: list[ImageError] = []
        normalized, mean, std = False, (), ()
        for offset, response in self._responses(encoded):
            array = from_proto(response.images)
            if len(response.indices):
                rows.append(array)
            indices.extend(offset + i for i in response.indices)
            errors.extend(ImageError(offset + e.index, e.reason) for e in response.errors)
            normalized = response.normalized
            mean, std = tuple(response.mean), tuple(response.std)
        index_tensor = torch.tensor(indices, dtype=torch.int64)
        if not rows:
            return Preprocessed(torch.empty((0,), dtype=torch.uint8), index_tensor, errors)
        batch = torch.from_numpy(rows[0] if len(rows) == 1 else np.concatenate(rows))
        return Preprocessed(self._to_device(batch, normalized, mean, std), index_tensor, errors)

    def _responses(self, encoded: list[bytes]) -> Iterator[tuple[int, pb.PreprocessResponse]]:
        """(offset, response) per request, in order; at most max_in_flight outstanding."""
        server = Server(self.address)
        waiting: collections.deque[tuple[int, Pending[pb.PreprocessResponse]]] = collections.deque()
        try:
            for offset, chunk in _chunks(encoded):
                request = pb.PreprocessRequest(
                    pipeline=self.pipeline,
                    images=chunk,
                    dtype=OUTPUT_DTYPES[self.dtype],
                    layout=LAYOUTS[self.layout],
                    params=self.params,
                )
                call = self._transport.preprocess(server, request, timeout=self.timeout)
                waiting.append((offset, call))
                if len(waiting) >= self.max_in_flight:
                    start, reply = waiting.popleft()
                    yield start, reply.result()
            while waiting:
                start, reply = waiting.popleft()
                yield start, reply.result()
        finally:
            for _, call in waiting:
                call.cancel()

    def _to_device(
        self,
        images: torch.Tensor,
        normalized: bool,
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ) -> torch.Tensor:
        if self.device.type == "cuda":
            images = images.pin_memory().to(self.device, non_blocking=True)
        if not self.normalize or normalized:
            return images
        return normalize(images, *channel_stats(mean, std, self.layout, self.device))

    # -- life cycle --------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel; a later call opens a new one."""
        self._transport.close()

    def __enter__(self) -> Preprocessor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Preprocessor({self.address!r}, pipeline={self.pipeline!r}, "
            f"device={str(self.device)!r}, normalize={self.normalize})"
        )


def _as_bytes(index: int, image: object) -> bytes:
    if isinstance(image, bytes):
        return image
    if isinstance(image, bytearray | memoryview):
        return bytes(image)
    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 1:
        return image.tobytes()
    if isinstance(image, str | os.PathLike):
        raise InvalidArgumentError(
            f"image {index} is a path ({str(image)[:80]!r}): pass the file's bytes, "
            "e.g. open(path, 'rb').read()"
        )
    raise InvalidArgumentError(
        f"image {index} is a {type(image).__name__}: pass encoded image files as bytes "
        "(decoded pixels are not accepted)"
    )


def _chunks(encoded: list[bytes]) -> Iterator[tuple[int, list[bytes]]]:
    """(offset, images) runs of at most _REQUEST_IMAGES images and about _REQUEST_BYTES."""
    start, size = 0, 0
    for i, image in enumerate(encoded):
        if i > start and (i - start >= _REQUEST_IMAGES or size + len(image) > _REQUEST_BYTES):
            yield start, encoded[start:i]
            start, size = i, 0
        size += len(image)
    if start < len(encoded):
        yield start, encoded[start:]
