"""Which records may reach DALI's decoder: image formats it reads, with sane headers.

A record is screened before it is fed to a pipeline: Pillow parses its header
(no pixel decoding, tens of microseconds) and names its format. Records that
are not images, are in a format DALI cannot decode (GIF), or whose header is
corrupt are skipped: DALI's batched CPU decoder (DALI 2.4, nvImageCodec 0.9)
can crash the whole process on such inputs instead of raising an error, so
they must never get there. Damage past the header (a truncated scan) is left
to DALI, which reports it as an ordinary error.
"""

from __future__ import annotations

import io
import warnings

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
    return None
