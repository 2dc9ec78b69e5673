"""Generated image folders with learnable classes, for the demo and benchmarks.

Each class is a shape (circle, square, triangle, cross) drawn at a random size,
position and colour over a random-coloured, noisy background, so a model can
learn the class from the pixels while colours carry no label information.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import numpy as np

__all__ = ["SHAPES", "write_image_folders", "write_photo_folders"]

SHAPES = ("circle", "square", "triangle", "cross")


def _draw(shape: str, size: int, rng: np.random.Generator) -> object:
    from PIL import Image, ImageDraw

    background = tuple(int(c) for c in rng.integers(0, 256, 3))
    noise = rng.normal(0, 12, (size, size, 3))
    base = np.clip(np.array(background, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(base)
    draw = ImageDraw.Draw(image)
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    radius = int(rng.integers(size // 6, size // 3))
    cx, cy = (int(v) for v in rng.integers(radius, size - radius, 2))
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon(
            [(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=colour
        )
    else:
        width = max(2, radius // 3)
        draw.rectangle((cx - width, cy - radius, cx + width, cy + radius), fill=colour)
        draw.rectangle((cx - radius, cy - width, cx + radius, cy + width), fill=colour)
    return image


def write_image_folders(
    root: pathlib.Path,
    *,
    per_class: int,
    size: int = 160,
    seed: int = 0,
    classes: tuple[str, ...] = SHAPES,
    on_image: Callable[[], None] | None = None,
) -> int:
    """Write ``root/<shape>/<i>.jpg`` (JPEG, ``size`` x ``size``); returns the count."""
    rng = np.random.default_rng(seed)
    count = 0
    for shape in classes:
        folder = root / shape
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            _draw(shape, size, rng).save(folder / f"{i:05d}.jpg", quality=90)  # type: ignore[attr-defined]
            count += 1
            if on_image is not None:
                on_image()
    return count


def _photo(size: tuple[int, int], rng: np.random.Generator) -> object:
    """An image with a photo's statistics: detail at every scale, falling with frequency."""
    from PIL import Image

    width, height = size
    coarse = np.zeros((height // 4, width // 4, 3), dtype=np.float64)
    for level, weight in ((4, 70.0), (16, 40.0), (48, 24.0)):
        layer = rng.normal(0, weight, (max(2, level * height // width), level, 3)).astype(
            np.float32
        )
        coarse += np.stack(
            [
                np.asarray(
                    Image.fromarray(layer[..., c]).resize(
                        coarse.shape[1::-1], Image.Resampling.BICUBIC
                    )
                )
                for c in range(3)
            ],
            axis=-1,
        )
    coarse += rng.normal(0, 20, coarse.shape)
    base = Image.fromarray(np.clip(coarse + rng.uniform(60, 190, 3), 0, 255).astype(np.uint8))
    fine = np.asarray(base.resize(size, Image.Resampling.BICUBIC), dtype=np.int16)
    fine = fine + rng.integers(-18, 19, fine.shape, dtype=np.int16)
    return Image.fromarray(np.clip(fine, 0, 255).astype(np.uint8))


def write_photo_folders(
    root: pathlib.Path,
    *,
    count: int,
    classes: int = 10,
    size: tuple[int, int] = (500, 375),
    seed: int = 0,
    on_image: Callable[[], None] | None = None,
) -> int:
    """Write ``count`` ImageNet-sized JPEGs (quality 90, about 100 KB) in ``classes`` folders.

    For benchmarks: their decode cost is that of photos, unlike flat synthetic shapes.
    """
    rng = np.random.default_rng(seed)
    for i in range(count):
        folder = root / f"class{i % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        _photo(size, rng).save(folder / f"{i:06d}.jpg", quality=90)  # type: ignore[attr-defined]
        if on_image is not None:
            on_image()
    return count
