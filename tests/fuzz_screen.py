"""Run as a child process: mutated images through the screen, survivors through DALI.

``python fuzz_screen.py SEED COUNT [FORMAT,...] [DEVICE]`` mutates image files (default
JPEG, PNG, BMP, TIFF, WebP and PPM; header bytes, truncation, garbage behind a
signature, overwritten or flipped bytes), drops what ``unsupported_reason`` rejects,
and decodes the rest mixed into batches of good images with the decoders of both
presets (``decoders.image`` and ``decoders.image_random_crop``), on DEVICE: ``cpu``
(the default) or ``mixed`` (nvJPEG and nvImageCodec on GPU 0). DALI 2.4 crashes the
process on some inputs, so surviving is the result; it prints
``admitted N rejected M errors E``.
"""

from __future__ import annotations

import io
import sys

import numpy as np
import skimage.data
from PIL import Image

from batchwire.server.data import unsupported_reason

SOURCES = ("astronaut", "chelsea", "coffee", "rocket")
FORMATS = ("JPEG", "PNG", "BMP", "TIFF", "WEBP", "PPM")


def originals(formats: tuple[str, ...]) -> list[bytes]:
    files = []
    for i, fmt in enumerate(formats):
        for j, size in enumerate(((160, 120), (96, 72))):
            out = io.BytesIO()
            pixels = getattr(skimage.data, SOURCES[(i + j) % len(SOURCES)])()
            Image.fromarray(pixels).resize(size).save(out, fmt)
            files.append(out.getvalue())
    return files


def mutate(data: bytes, rng: np.random.Generator) -> bytes:
    out = bytearray(data)
    kind = int(rng.integers(0, 6))
    if kind == 0:  # bytes of the header changed
        for _ in range(int(rng.integers(1, 8))):
            out[int(rng.integers(2, min(len(out), 700)))] = int(rng.integers(0, 256))
    elif kind == 1:  # cut short
        out = out[: int(rng.integers(4, len(out)))]
    elif kind == 2:  # a signature, then garbage
        out = out[: int(rng.integers(2, 12))] + bytearray(rng.bytes(int(rng.integers(10, 5000))))
    elif kind == 3:  # a stretch overwritten
        start = int(rng.integers(2, len(out) - 10))
        span = min(int(rng.integers(1, 200)), len(out) - start)
        out[start : start + span] = rng.bytes(span)
    elif kind == 4:  # the header kept, the rest garbage
        cut = int(rng.integers(20, 800))
        out = out[:cut] + bytearray(rng.bytes(len(out) - cut))
    else:  # bytes flipped anywhere
        for _ in range(int(rng.integers(1, 30))):
            out[int(rng.integers(0, len(out)))] = int(rng.integers(0, 256))
    return bytes(out)


def decode_all(admitted: list[np.ndarray], good: list[np.ndarray], train: bool, device: str) -> int:
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import Pipeline

    pending: list[list[np.ndarray]] = []

    def source() -> list[np.ndarray]:
        if not pending:
            raise StopIteration
        return pending.pop(0)

    def build() -> Pipeline:
        pipe = Pipeline(batch_size=32, num_threads=2, device_id=None if device == "cpu" else 0)
        with pipe:
            encoded = fn.external_source(source=source, batch=True, dtype=types.UINT8)
            if train:
                images = fn.decoders.image_random_crop(encoded, device=device)
            else:
                images = fn.decoders.image(encoded, device=device)
            pipe.set_outputs(fn.resize(images, resize_x=64, resize_y=64))
        pipe.build()
        return pipe

    rng = np.random.default_rng(0)
    pipe, errors = build(), 0
    for start in range(0, len(admitted), 4):
        batch = [good[int(rng.integers(0, len(good)))] for _ in range(28)]
        for item in admitted[start : start + 4]:
            batch.insert(int(rng.integers(0, len(batch) + 1)), item)
        pending.append(batch)
        try:
            pipe.run()
        except StopIteration:
            pipe.reset()
        except RuntimeError:  # an ordinary decode error: what the server recovers from
            errors += 1
            pipe = build()
    return errors


def main(seed: int, count: int, formats: tuple[str, ...], device: str) -> None:
    rng = np.random.default_rng(seed)
    files = originals(formats)
    mutated = [mutate(files[int(rng.integers(0, len(files)))], rng) for _ in range(count)]
    admitted = [np.frombuffer(m, np.uint8) for m in mutated if unsupported_reason(m) is None]
    good = [np.frombuffer(f, np.uint8) for f in files]
    errors = decode_all(admitted, good, False, device) + decode_all(admitted, good, True, device)
    print(f"admitted {len(admitted)} rejected {count - len(admitted)} errors {errors}")


if __name__ == "__main__":
    chosen = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else FORMATS
    main(int(sys.argv[1]), int(sys.argv[2]), chosen, sys.argv[4] if len(sys.argv) > 4 else "cpu")
