"""COCO annotation files as an ingest source: instances (boxes and their categories) and
captions.

``read_coco(JSON, images_dir)`` reads ``instances_*.json`` (``images``, ``annotations``,
``categories``) or ``captions_*.json`` (``images``, and ``annotations`` holding a
``caption`` each). A sample is an image of ``images``, in id order, read from
``images_dir / file_name``, with these fields:

- ``image_id`` (int, ``[]``): the image's COCO id, to match predictions with the file;
- instances: ``boxes`` (float32 ``[n, 4]``, absolute pixel ``ltrb``: COCO's ``bbox``
  ``[x, y, w, h]`` becomes ``[x, y, x + w, y + h]``), ``labels`` (int64 ``[n]``, the
  category as a class index) and ``iscrowd`` (int64 ``[n]``), both along ``boxes``;
- captions: ``caption`` (text ``[n]``);
- with ``masks``: ``mask`` (an image: a PNG of the image's size, each pixel 1 + the class
  of the annotation covering it, 0 for none; ``_coco_masks``).

Categories, sorted by id, are the classes ``0..K-1`` (their names), the COCO ids kept as
the manifest's ``class_ids``. An image has no image-level label (``NO_LABEL``). An
annotation that cannot be read (an unknown category or image, a ``bbox`` that is not four
numbers, a caption that is not text) is left out and reported; whether a box lies in its
image is checked once the image is decoded (``_boxes``).
"""

from __future__ import annotations

import collections
import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from batchwire.server.data.ingestion._batches import Rejected
from batchwire.server.data.ingestion._coco_masks import MASK_FORMAT, CocoMask, segmentation_problem
from batchwire.server.data.ingestion._sample_source import NO_LABEL, SampleSource, SourceSample
from batchwire.server.data.records import BOX_FORMAT, CLASS_FORMAT, FieldSpec
from batchwire.server.errors import IngestError

__all__ = ["is_coco", "read_coco"]

_INSTANCES = (
    FieldSpec(name="image_id", kind="int"),
    FieldSpec(name="boxes", kind="float", shape=(-1, 4), format=BOX_FORMAT),
    FieldSpec(name="labels", kind="int", shape=(-1,), format=CLASS_FORMAT, along="boxes"),
    FieldSpec(name="iscrowd", kind="int", shape=(-1,), along="boxes"),
)
_CAPTIONS = (
    FieldSpec(name="image_id", kind="int"),
    FieldSpec(name="caption", kind="text", shape=(-1,)),
)
_MASK = FieldSpec(name="mask", kind="image", format=MASK_FORMAT)


def is_coco(body: object) -> bool:
    """Whether a parsed JSON document is a COCO annotation file."""
    return (
        isinstance(body, Mapping)
        and isinstance(body.get("images"), list)
        and (isinstance(body.get("annotations"), list))
    )


def read_coco(path: pathlib.Path, images_dir: pathlib.Path, *, masks: bool = False) -> SampleSource:
    """The samples of the COCO file ``path``, their images under ``images_dir``; with
    ``masks``, each instances sample's ``mask`` too (``_coco_masks``)."""
    body = _load(path)
    captions = "categories" not in body
    categories = [] if captions else _categories(body["categories"], path)
    label_of = {int(c["id"]): i for i, c in enumerate(categories)}
    images = _images(body["images"], path)
    rejected: list[Rejected] = []
    by_image: dict[int, list[Mapping[str, Any]]] = collections.defaultdict(list)
    for annotation in body["annotations"]:
        image_id = annotation.get("image_id") if isinstance(annotation, Mapping) else None
        if image_id not in images:
            rejected.append(
                Rejected(
                    path.name,
                    f"annotation of image {image_id!r}, which is not in images",
                    part=f"annotation {_id(annotation)}",
                )
            )
            continue
        by_image[image_id].append(annotation)
    samples = []
    for image_id, file_name in sorted(images.items()):
        annotations = by_image.get(image_id, [])
        if captions:
            fields, bad = _captions(annotations)
        else:
            fields, bad = _instances(annotations, label_of)
            if masks:
                fields["mask"], unpainted = _mask(annotations, label_of)
                bad += unpainted
        rejected.extend(Rejected(file_name, reason, part=part) for part, reason in bad)
        samples.append(
            SourceSample(
                relpath=file_name,
                label=NO_LABEL,
                fields={"image_id": np.int64(image_id), **fields},
                path=images_dir / file_name,
            )
        )
    return SampleSource(
        classes=tuple(str(c.get("name", c["id"])) for c in categories),
        class_ids=tuple(label_of),
        specs=_CAPTIONS if captions else (*_INSTANCES, *((_MASK,) if masks else ())),
        samples=tuple(samples),
        ignored=tuple(rejected),
    )


def _load(path: pathlib.Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IngestError(f"cannot read the COCO file {path}: {exc}") from exc
    if not is_coco(body):
        raise IngestError(
            f"{path} is not a COCO annotation file: it needs 'images' and 'annotations' "
            "lists (and 'categories' for boxes)"
        )
    return dict(body)


def _categories(categories: object, path: pathlib.Path) -> list[Mapping[str, Any]]:
    if not isinstance(categories, list) or not all(
        isinstance(c, Mapping) and isinstance(c.get("id"), int) for c in categories
    ):
        raise IngestError(f"{path}: 'categories' must be a list of objects with an integer id")
    ids = [c["id"] for c in categories]
    if len(set(ids)) != len(ids):
        raise IngestError(f"{path}: 'categories' lists an id twice")
    return sorted(categories, key=lambda c: int(c["id"]))


def _images(images: list[object], path: pathlib.Path) -> dict[int, str]:
    found: dict[int, str] = {}
    for image in images:
        if not (
            isinstance(image, Mapping)
            and isinstance(image.get("id"), int)
            and isinstance(image.get("file_name"), str)
        ):
            raise IngestError(
                f"{path}: every image needs an integer 'id' and a 'file_name', got {image!r:.80}"
            )
        if image["id"] in found:
            raise IngestError(f"{path}: image id {image['id']} is listed twice")
        found[image["id"]] = image["file_name"]
    return found


def _instances(
    annotations: list[Mapping[str, Any]], label_of: dict[int, int]
) -> tuple[dict[str, object], list[tuple[str, str]]]:
    boxes, labels, crowd = [], [], []
    bad: list[tuple[str, str]] = []
    for annotation in annotations:
        part = f"annotation {_id(annotation)}"
        bbox = annotation.get("bbox")
        if not (
            isinstance(bbox, list)
            and len(bbox) == 4
            and all(isinstance(v, int | float) and math.isfinite(v) for v in bbox)
        ):
            bad.append((part, f"bbox {bbox!r:.60} is not four numbers [x, y, width, height]"))
            continue
        if annotation.get("category_id") not in label_of:
            bad.append((part, f"category {annotation.get('category_id')!r} is not in categories"))
            continue
        x, y, w, h = (float(v) for v in bbox)
        boxes.append((x, y, x + w, y + h))
        labels.append(label_of[annotation["category_id"]])
        crowd.append(int(bool(annotation.get("iscrowd", 0))))
    fields: dict[str, object] = {
        "boxes": np.array(boxes, dtype=np.float32).reshape(-1, 4),
        "labels": np.array(labels, dtype=np.int64),
        "iscrowd": np.array(crowd, dtype=np.int64),
    }
    return fields, bad


def _mask(
    annotations: list[Mapping[str, Any]], label_of: dict[int, int]
) -> tuple[CocoMask, list[tuple[str, str]]]:
    """The image's mask, of its annotations whose segmentation can be rasterized (the
    others reported: their boxes are kept)."""
    painted, labels, bad = [], [], []
    for annotation in annotations:
        if annotation.get("category_id") not in label_of:
            continue  # reported with its box
        problem = segmentation_problem(annotation)
        if problem is not None:
            bad.append((f"annotation {_id(annotation)}", f"not in the mask: {problem}"))
            continue
        painted.append(annotation["segmentation"])
        labels.append(label_of[annotation["category_id"]])
    return CocoMask(painted, labels), bad


def _captions(
    annotations: list[Mapping[str, Any]],
) -> tuple[dict[str, object], list[tuple[str, str]]]:
    texts, bad = [], []
    for annotation in annotations:
        caption = annotation.get("caption")
        if isinstance(caption, str):
            texts.append(caption)
        else:
            bad.append((f"annotation {_id(annotation)}", f"caption {caption!r:.40} is not text"))
    return {"caption": tuple(texts)}, bad


def _id(annotation: object) -> object:
    return annotation.get("id", "?") if isinstance(annotation, Mapping) else "?"
