"""Which records may reach DALI's decoder: image formats it reads, with sane headers.

A record is screened before it is fed to a pipeline, by two parsers of its header
(no pixel decoding), and both must accept it:

* Pillow names its format. Records that are not images, are in a format DALI
  cannot decode (GIF), or whose header is corrupt are skipped.
* nvImageCodec, the library DALI's decoder is built on, must parse the stream and
  find the image's size (about 3 µs). Pillow accepts the header of a truncated
  PNG; nvImageCodec does not, and DALI's CPU decoder crashed the process on some.

* A JPEG 2000 record must also decode fully in Pillow (milliseconds; the format
  is rare). DALI decodes it on the CPU through OpenCV's OpenJPEG, which crashed
  on corrupt codestreams whose headers both parsers accept.

DALI 2.4's batched CPU decoder (nvImageCodec 0.9) crashes the whole process,
instead of raising an error, on records that any one of these checks alone lets
through. Fuzzing found them: mutated JPEG, PNG and TIFF headers, truncated PNGs,
corrupt JPEG 2000 codestreams. None reached the decoder with all the checks
(``tests/fuzz_screen.py``).

* A JPEG must have its end-of-image marker after its scan. The GPU decoder
  (nvJPEG, through nvImageCodec) decodes a JPEG cut short without an error, its
  missing rows grey, where the CPU decoder fails on it (seen on an H200): screened
  here, it is skipped on both. Damage the parsers cannot see, inside scan data that
  still ends with the marker, is left to the decoder; the CPU's reports it as an
  ordinary error.

A server screens each record once per dataset version (:class:`ScreenedRecords`), and
again only where the bytes the screen reads have changed since.
"""

from __future__ import annotations

import functools
import io
import threading
import warnings
import zlib
from typing import Any

import numpy as np

__all__ = ["SUPPORTED_FORMATS", "ScreenedRecords", "fingerprint", "unsupported_reason"]

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
    if name == "JPEG2000":
        reason = _decodes_fully(data)
        if reason is not None:
            return reason
    if name in ("JPEG", "MPO") and _jpeg_cut_short(data):
        return "cannot be decoded: its JPEG is truncated (no end-of-image marker after its scan)"
    return _codec_stream_reason(data)


def _jpeg_cut_short(data: bytes | np.ndarray) -> bool:
    """True where a JPEG has no end-of-image marker (FF D9) after its first scan: a file
    cut short. The marker cannot occur inside scan data, so one found after the scan's
    start ends the image (data may follow it: a second image, a video). Almost every
    JPEG ends with it, which is checked first; the rest are searched."""
    if len(data) >= 2 and data[-2] == 0xFF and data[-1] == 0xD9:
        return False
    buffer = data if isinstance(data, bytes) else np.asarray(data).tobytes()
    scan = _first_scan(buffer)
    return scan is not None and buffer.find(b"\xff\xd9", scan) < 0


def _first_scan(data: bytes | memoryview) -> int | None:
    """Where a JPEG's first scan data begins (after its SOS segment), following the
    marker segments from the start; None where they cannot be followed."""
    at = 2  # after SOI
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            at += 2
            continue
        end = at + 2 + ((data[at + 2] << 8) | data[at + 3])
        if marker == 0xDA:  # start of scan
            return end
        at = end
    return None


def _decodes_fully(data: bytes | np.ndarray) -> str | None:
    """JPEG 2000 only: Pillow must decode all of it (milliseconds; the format is rare)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a truncated stream only warns otherwise
            with Image.open(io.BytesIO(data)) as image:  # type: ignore[arg-type]
                image.load()
    except Exception:
        return "cannot be decoded: its JPEG 2000 codestream is corrupt or truncated"
    return None


def fingerprint(data: np.ndarray, span: int | None = None) -> tuple[int, int]:
    """A checksum of the bytes of ``data`` that :func:`unsupported_reason` reads, and how
    many bytes it covers (0: all of them): for a JPEG that ends with its end-of-image
    marker, the marker segments before its first scan (the two parsers read no further,
    and the marker is there); for anything else, all of it. ``span``: where the scan began
    when this record was last screened; those bytes, unchanged, lead to the same scan, so
    the segments are not followed again."""
    view = memoryview(data)  # type: ignore[arg-type]  # an ndarray is a buffer
    jpeg = len(view) >= 4 and view[0] == 0xFF and view[1] == 0xD8
    if jpeg and view[-2] == 0xFF and view[-1] == 0xD9:
        scan = span if span else _first_scan(view)
        if scan is not None and scan <= len(view):
            return zlib.crc32(view[:scan]), scan
    return zlib.crc32(view), 0


class ScreenedRecords:
    """Which records of one dataset version passed :func:`unsupported_reason`, so that a
    record is screened once, not on every read of every epoch.

    A record is remembered by its length and :func:`fingerprint`; one whose bytes changed
    since (rot on disk) no longer matches and is screened again before it may reach the
    decoder. Records that fail are not remembered: they are screened (and reported) on
    each read. Thread-safe; about 16 bytes per sample.
    """

    def __init__(self, num_samples: int) -> None:
        self._lengths = np.zeros(num_samples, dtype=np.int64)  # 0: not screened
        self._fingerprints = np.zeros(num_samples, dtype=np.uint32)
        self._spans = np.zeros(num_samples, dtype=np.uint32)  # the bytes checksummed; 0: all
        self._lock = threading.Lock()

    def reason(self, sample_id: int, data: np.ndarray) -> str | None:
        """Why record ``sample_id``, now ``data``, must not reach the decoder, or None."""
        return self.reasons(np.array([sample_id]), [data])[0]

    def reasons(self, ids: np.ndarray, records: list[np.ndarray]) -> list[str | None]:
        """:meth:`reason` of each record of a batch: ``records[i]`` is now the bytes of
        ``ids[i]``. The remembered screens are looked up, and the new ones stored, under
        one lock acquisition each: a batch's cost is a checksum per record."""
        ids = np.asarray(ids, dtype=np.int64)
        lengths = np.fromiter((len(record) for record in records), np.int64, len(records))
        with self._lock:
            known = self._lengths[ids] == lengths
            spans = np.where(known, self._spans[ids], 0).tolist()
        sums = [
            fingerprint(record, span or None) for record, span in zip(records, spans, strict=True)
        ]
        checksums = np.fromiter((checksum for checksum, _ in sums), np.uint32, len(sums))
        with self._lock:
            passed = (self._lengths[ids] == lengths) & (self._fingerprints[ids] == checksums)
        reasons: list[str | None] = [None] * len(records)
        screened: list[int] = []
        for i in np.flatnonzero(~passed).tolist():
            reasons[i] = unsupported_reason(records[i])
            if reasons[i] is None:
                if spans[i]:  # checksummed up to a scan remembered: where it begins now
                    sums[i] = fingerprint(records[i])
                screened.append(i)
        if screened:
            with self._lock:
                for i in screened:
                    sample_id = ids[i]
                    self._lengths[sample_id] = lengths[i]
                    self._fingerprints[sample_id], self._spans[sample_id] = sums[i]
        return reasons


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
