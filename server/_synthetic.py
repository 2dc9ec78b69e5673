"""Generated image folders with learnable classes, for the demo and benchmarks.

Each class is a shape (circle, square, triangle, cross) drawn at a random size,
position and colour over a random-coloured, noisy background, so a model can
learn the class from the pixels while colours carry no label information.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import numpy as np

__all__ = ["SHAPES", "write_image_folders"]

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
