"""A generated detection and captioning dataset in COCO's form, for tests and demos.

Each image is a plain background with a few filled rectangles, each of its category's
known colour (:data:`BOX_COLOURS`), none overlapping, so every pixel inside a box is that
colour: a pipeline that crops, resizes or flips images and boxes together can be checked
by looking under each box. Images are PNG (lossless: the colours are exact). Written as
COCO writes a dataset: ``instances.json`` (boxes ``[x, y, width, height]`` in pixels,
categories with ids that are not ``0..K-1``), ``captions.json`` (a caption or two per
image, saying what it shows) and ``images/``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

__all__ = ["BACKGROUND", "BOX_COLOURS", "write_coco_boxes"]

BACKGROUND = (128, 128, 128)
# Category id → (name, colour): ids as COCO has them, with gaps.
BOX_COLOURS = {1: ("red", (230, 20, 20)), 3: ("green", (20, 200, 40)), 7: ("blue", (30, 40, 220))}


def write_coco_boxes(
    root: pathlib.Path,
    *,
    count: int,
    size: tuple[int, int] = (160, 120),
    seed: int = 0,
) -> pathlib.Path:
    """Write ``count`` images (``size``: width, height) with 1 to 3 boxes each under
    ``root``; returns the path of ``instances.json`` (``captions.json`` beside it)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    width, height = size
    (root / "images").mkdir(parents=True, exist_ok=True)
    images: list[dict[str, object]] = []
    annotations: list[dict[str, object]] = []
    captions: list[dict[str, object]] = []
    cell_w, cell_h = width // 3, height // 2  # one box a cell of a 3x2 grid: none overlap
    for index in range(count):
        image_id = 1000 + index
        file_name = f"{index:06d}.png"
        picture = Image.new("RGB", size, BACKGROUND)
        draw = ImageDraw.Draw(picture)
        cells = rng.choice(6, size=int(rng.integers(1, 4)), replace=False)
        names = []
        for cell in cells.tolist():
            category = int(rng.choice(list(BOX_COLOURS)))
            name, colour = BOX_COLOURS[category]
            w = int(rng.integers(cell_w // 3, cell_w - 2))
            h = int(rng.integers(cell_h // 3, cell_h - 2))
            x = (cell % 3) * cell_w + int(rng.integers(0, cell_w - w))
            y = (cell // 3) * cell_h + int(rng.integers(0, cell_h - h))
            draw.rectangle((x, y, x + w - 1, y + h - 1), fill=colour)  # w x h pixels
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": category,
                    "bbox": [x, y, w, h],
                    # The rectangle as COCO's polygon: its mask is the box's pixels.
                    "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]],
                    "area": w * h,
                    "iscrowd": 0,
                }
            )
            names.append(name)
        picture.save(root / "images" / file_name)
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        described = ", ".join(f"{names.count(n)} {n}" for n in sorted(set(names)))
        texts = [f"{described} on grey", f"a picture of {len(names)} boxes"][: 1 + index % 2]
        captions.extend(
            {"id": len(captions) + 1, "image_id": image_id, "caption": text} for text in texts
        )
    categories = [{"id": i, "name": name} for i, (name, _) in BOX_COLOURS.items()]
    instances = {"images": images, "annotations": annotations, "categories": categories}
    (root / "instances.json").write_text(json.dumps(instances, indent=1))
    (root / "captions.json").write_text(
        json.dumps({"images": images, "annotations": captions}, indent=1)
    )
    return root / "instances.json"
