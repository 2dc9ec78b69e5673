"""Which records may reach DALI's decoder: image formats it reads, with sane headers.

A record is screened before it is fed to a pipeline, by two parsers of its header
(no pixel decoding), and both must accept it:

* Pillow names its format. Records that are not images, are in a format DALI
  cannot decode (GIF), or whose header is corrupt are skipped.
* nvImageCodec, the library DALI's decoder is built on, must parse the stream and
  find the image's size (about 3 µs). Pillow accepts the header of a truncated
  PNG; nvImageCodec does not, and DALI's CPU decoder crashed the process on some.

DALI 2.4's batched CPU decoder (nvImageCodec 0.9) crashes the whole process,
instead of raising an error, on records that either parser alone lets through:
mutated JPEG and PNG headers and truncated PNGs found by fuzzing both. None of
them reached it with both checks. Damage the parsers cannot see (a JPEG's scan
data cut short) is left to DALI, which reports it as an ordinary error.
"""

from __future__ import annotations

import functools
import io
import warnings
from typing import Any

import numpy as np

__all__ = ["SUPPORTED_FORMATS", "unsupported_reason"]

# Pillow's format names for what DALI's image decoder reads.
SUPPORTED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "BMP", "TIFF", "PPM", "WEBP", "JPEG2000"})
# Smaller than any real image file worth serving (a 1x1 BMP is 58 bytes).
MIN_IMAGE_BYTES = 16


def unsupported_reason(data: bytes | np.ndarray) -> str | None:
    """Why DALI must not be given ``data``, or None when it may decode it."""
    from PIL import Image

    size = len(data)
    if size == 0:
        return "empty record"
    if size < MIN_IMAGE_BYTES:
        return f"only {size} bytes: not an image"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:  # type: ignore[arg-type]  # ndarray is a buffer
                name = image.format or "unknown"
    except Image.DecompressionBombError as exc:
        return f"too many pixels to decode safely ({exc})"
    except Exception:  # Pillow raises many types for unreadable headers
        return "cannot be decoded: not an image, or its header is corrupt"
    if name not in SUPPORTED_FORMATS:
        return f"{name}: DALI's image decoder does not support {name}"
    return _codec_stream_reason(data)


@functools.cache
def _nvimgcodec() -> Any:
    try:
        from nvidia import nvimgcodec
    except ImportError:  # no DALI here (a thin install): Pillow's check alone
        return None
    return nvimgcodec


def _codec_stream_reason(data: bytes | np.ndarray) -> str | None:
    nvimgcodec = _nvimgcodec()
    if nvimgcodec is None:
        return None
    try:
        stream = nvimgcodec.CodeStream(data)
        width, height = stream.width, stream.height  # reading these parses the stream
    except Exception:  # nvImageCodec raises RuntimeError, or ValueError for odd buffers
        return "cannot be decoded: DALI's codec library cannot parse it (corrupt or truncated)"
    if width <= 0 or height <= 0:
        return "cannot be decoded: DALI's codec library finds no image size in it"
    return None
