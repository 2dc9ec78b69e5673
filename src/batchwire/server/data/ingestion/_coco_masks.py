"""COCO's segmentations as one mask per image, made once the image's size is known.

With ``ingest --masks``, a COCO instances sample gets a ``mask`` field: a single-channel PNG
of the image's size whose pixel is ``1 + the class`` of the annotation covering it, and 0
where none does (the background), as VOC's and torchvision's segmentation targets count.
Polygons and RLE (``iscrowd``) are rasterized by pycocotools, COCO's own API; where
annotations overlap, the later one is on top. The mask is a :class:`CocoMask`, called by
the dataset writer with the decoded image's size: masks are not all held at once.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchwire.server.errors import IngestError

__all__ = ["MASK_FORMAT", "CocoMask", "segmentation_problem", "write_coco_masks"]

# The mask field's format in the manifest: a pixel is 1 + its class, 0 the background.
MASK_FORMAT = "class+1"
# A PNG pixel holds 255 classes (0 is the background).
_MAX_CLASSES = 255


def segmentation_problem(annotation: Mapping[str, Any]) -> str | None:
    """Why an annotation's ``segmentation`` cannot be rasterized, or None."""
    segmentation = annotation.get("segmentation")
    if isinstance(segmentation, list) and segmentation:
        if all(isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0 for p in segmentation):
            return None
        return "a polygon needs at least 3 points, as [x, y, x, y, ...]"
    if isinstance(segmentation, Mapping) and "counts" in segmentation and "size" in segmentation:
        return None
    return f"segmentation {segmentation!r:.40} is neither polygons nor RLE"


@dataclasses.dataclass(frozen=True)
class CocoMask:
    """The mask of one image: its annotations' segmentations and classes, in order."""

    segmentations: Sequence[Any]
    labels: Sequence[int]

    def __post_init__(self) -> None:
        if any(label + 1 > _MAX_CLASSES for label in self.labels):
            raise IngestError(
                f"a PNG mask holds {_MAX_CLASSES} classes at most: this dataset has more; "
                "ingest it without --masks"
            )

    def __call__(self, width: int, height: int) -> bytes:
        """The PNG of the mask of an image of ``width`` x ``height`` pixels."""
        from PIL import Image

        mask = np.zeros((height, width), dtype=np.uint8)
        for segmentation, label in zip(self.segmentations, self.labels, strict=True):
            mask[_rasterized(segmentation, width, height)] = label + 1
        out = io.BytesIO()
        Image.fromarray(mask, mode="L").save(out, "PNG")
        return out.getvalue()


def _rasterized(segmentation: Any, width: int, height: int) -> np.ndarray:
    """The pixels ``segmentation`` covers, as a boolean ``[height, width]`` array."""
    from pycocotools import mask as coco_mask

    if isinstance(segmentation, list):  # polygons
        rle = coco_mask.merge(coco_mask.frPyObjects(segmentation, height, width))
    elif isinstance(segmentation["counts"], list):  # uncompressed RLE
        rle = coco_mask.frPyObjects(segmentation, height, width)
    else:  # compressed RLE
        rle = segmentation
    return np.asarray(coco_mask.decode(rle), dtype=bool)[:height, :width]


def write_coco_masks(coco: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Each image's mask of COCO instances file ``coco`` as a PNG of its own in ``out``
    (``out/<image stem>.png``, as ``ingest --masks`` makes them: a pixel ``1 + class``,
    the classes COCO's categories in id order, 0 the background), as VOC, ADE20K and
    Cityscapes lay masks out beside their images; ``out``."""
    import json

    instances = json.loads(coco.read_text())
    categories = sorted(int(c["id"]) for c in instances["categories"])
    classes = {category: n for n, category in enumerate(categories)}
    by_image: dict[int, list[Mapping[str, Any]]] = {}
    for annotation in instances["annotations"]:
        by_image.setdefault(annotation["image_id"], []).append(annotation)
    out.mkdir(parents=True, exist_ok=True)
    for image in instances["images"]:
        annotations = by_image.get(image["id"], [])
        mask = CocoMask(
            [a["segmentation"] for a in annotations],
            [classes[a["category_id"]] for a in annotations],
        )
        stem = pathlib.Path(image["file_name"]).stem
        (out / f"{stem}.png").write_bytes(mask(image["width"], image["height"]))
    return out
