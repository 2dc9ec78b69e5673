"""Real photos on disk, in the encodings an ingest meets, for tests.

The pixels come from the photos bundled inside scikit-image's wheel (no
download); Pillow writes them as JPEG (baseline, progressive, grayscale, CMYK,
EXIF-rotated), PNG (alpha, palette), BMP, TIFF, PPM, WebP, at tiny and huge
sizes, next to files DALI must reject (truncated JPEG, random bytes, an empty
file, a GIF).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib

import numpy as np
import skimage.data
from PIL import Image

__all__ = [
    "Photo",
    "PhotoTree",
    "build_photo_tree",
    "build_repeated_tree",
    "encode",
    "impossible_huffman_table",
]

_EXIF_ORIENTATION = 0x0112


@dataclasses.dataclass(frozen=True)
class Photo:
    """A file that must decode: ``relpath`` is relative to the tree's root."""

    relpath: str
    label: int
    kind: str


@dataclasses.dataclass(frozen=True)
class PhotoTree:
    """A class-folder tree; ``photos`` are in the id order ingest must assign."""

    root: pathlib.Path
    classes: tuple[str, ...]
    photos: tuple[Photo, ...]
    bad: dict[str, str]  # relpath -> what is wrong with it
    stray: tuple[str, ...]  # files outside any class folder
    hidden: tuple[str, ...]  # files ingest must not even look at

    def path(self, relpath: str) -> pathlib.Path:
        return self.root / relpath

    def counts(self) -> list[int]:
        return [sum(p.label == label for p in self.photos) for label in range(len(self.classes))]


def encode(pixels: np.ndarray | Image.Image, fmt: str, **options: object) -> bytes:
    """``pixels`` encoded by Pillow as ``fmt`` (``"JPEG"``, ``"PNG"``, ...)."""
    image = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def impossible_huffman_table(jpeg: bytes) -> bytes:
    """``jpeg`` with its first Huffman table made impossible (more codes than a table
    holds): headers that Pillow and nvImageCodec accept, which the decoder rejects."""
    at = jpeg.index(b"\xff\xc4") + 5  # the table's 16 code counts
    return jpeg[:at] + b"\xff" * 16 + jpeg[at + 16 :]


def build_photo_tree(root: pathlib.Path, *, huge: tuple[int, int] = (4000, 3000)) -> PhotoTree:
    """Write the tree under ``root``: classes ``cat``, ``coffee``, ``space``.

    ``huge`` is the (width, height) of the one large JPEG.
    """
    cat = Image.fromarray(skimage.data.chelsea())  # 451x300
    coffee = Image.fromarray(skimage.data.coffee())  # 600x400
    astronaut = Image.fromarray(skimage.data.astronaut())  # 512x512
    rocket = Image.fromarray(skimage.data.rocket())  # 640x427
    logo = Image.fromarray(skimage.data.logo())  # 500x500 RGBA

    rotated = Image.Exif()
    rotated[_EXIF_ORIENTATION] = 6  # "rotate 90 CW to display"
    good: dict[str, tuple[str, bytes]] = {
        "cat/chelsea.jpg": ("baseline jpeg", encode(cat, "JPEG", quality=90)),
        "cat/gray.jpg": ("grayscale jpeg", encode(cat.convert("L"), "JPEG")),
        "cat/rotated.jpg": ("exif-rotated jpeg", encode(cat, "JPEG", exif=rotated.tobytes())),
        "cat/nested/progressive.jpg": (
            "progressive jpeg",
            encode(cat, "JPEG", quality=85, progressive=True),
        ),
        "cat/tiny.png": ("tiny png", encode(cat.resize((4, 3)), "PNG")),
        "coffee/cmyk.jpg": ("cmyk jpeg", encode(coffee.convert("CMYK"), "JPEG")),
        "coffee/coffee.bmp": ("bmp", encode(coffee, "BMP")),
        "coffee/coffee.tiff": ("tiff", encode(coffee, "TIFF")),
        "coffee/coffee.ppm": ("ppm", encode(coffee, "PPM")),
        "coffee/logo.png": ("png with alpha", encode(logo, "PNG")),
        "coffee/palette.png": ("palette png", encode(coffee.convert("P"), "PNG")),
        "space/astronaut.webp": ("webp", encode(astronaut, "WEBP", quality=80)),
        "space/astronaut.jpg": ("baseline jpeg", encode(astronaut, "JPEG")),
        "space/rocket-huge.jpg": (
            "huge jpeg",
            encode(rocket.resize(huge, Image.Resampling.BILINEAR), "JPEG", quality=80),
        ),
    }
    whole = encode(astronaut, "JPEG")
    bad = {
        "cat/truncated.jpg": ("truncated jpeg", whole[: len(whole) // 3]),
        "coffee/empty.jpg": ("empty file", b""),
        "space/anim.gif": ("gif", encode(rocket.convert("P"), "GIF")),
        "space/random.jpg": ("random bytes", np.random.default_rng(7).bytes(4096)),
    }
    hidden = {"cat/.thumbs.jpg": whole, "space/.cache/astronaut.jpg": whole}
    stray = {"README.txt": b"photos for tests\n"}

    # Written in reverse so that directory order differs from sorted order.
    everything = {**{p: d for p, (_, d) in good.items()}, **{p: d for p, (_, d) in bad.items()}}
    for relpath, data in sorted({**everything, **hidden, **stray}.items(), reverse=True):
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    classes = ("cat", "coffee", "space")
    photos = tuple(
        Photo(relpath=relpath, label=classes.index(relpath.split("/")[0]), kind=kind)
        for relpath, (kind, _) in sorted(good.items())
    )
    return PhotoTree(
        root=root,
        classes=classes,
        photos=photos,
        bad={relpath: kind for relpath, (kind, _) in bad.items()},
        stray=tuple(stray),
        hidden=tuple(hidden),
    )


def build_repeated_tree(root: pathlib.Path, count: int) -> pathlib.Path:
    """``count`` symlinks to one 512x512 JPEG in class ``a``: many files, little disk."""
    (root / "a").mkdir(parents=True)
    source = root / ".astronaut.jpg"  # hidden: ingest skips it
    source.write_bytes(encode(skimage.data.astronaut(), "JPEG"))
    for i in range(count):
        os.symlink(source, root / "a" / f"{i:06d}.jpg")
    return root
