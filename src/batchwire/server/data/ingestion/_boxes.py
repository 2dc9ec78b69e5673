"""Boxes checked against their decoded image before they are stored.

A box (a field of format ``ltrb``: absolute pixels ``[left, top, right, bottom]``) is
dropped, and reported, where it has no area (``right <= left`` or ``bottom <= top``, a
COCO box of zero or negative width or height) or reaches more than :data:`TOLERANCE`
pixels outside its image; the entries of the fields that follow it (``along``: its class,
its crowd flag) go with it. A box within the tolerance is clipped to the image. The
sample itself is kept, with its other boxes: one bad annotation does not cost the image.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from batchwire.server.data.records import BOX_FORMAT, FieldSpec

__all__ = ["TOLERANCE", "check_boxes"]

# Pixels a box may reach past its image's edge (annotation tools round outward): clipped.
TOLERANCE = 1.0


def check_boxes(
    fields: Mapping[str, object], specs: tuple[FieldSpec, ...], *, width: int, height: int
) -> tuple[dict[str, object], list[tuple[str, str]]]:
    """``fields`` with the bad boxes (and what follows them) dropped and the rest clipped
    to the ``width`` x ``height`` image, and (part, reason) for each box dropped."""
    kept = dict(fields)
    dropped: list[tuple[str, str]] = []
    for spec in specs:
        boxes = kept.get(spec.name)
        if spec.format != BOX_FORMAT or not isinstance(boxes, np.ndarray) or not len(boxes):
            continue
        left, top, right, bottom = boxes.T
        empty = (right <= left) | (bottom <= top)
        outside = (
            (left < -TOLERANCE)
            | (top < -TOLERANCE)
            | (right > width + TOLERANCE)
            | (bottom > height + TOLERANCE)
        )
        for i in np.flatnonzero(empty | outside).tolist():
            where = "has no area" if empty[i] else f"lies outside the {width}x{height} image"
            corners = ", ".join(f"{v:g}" for v in boxes[i].tolist())
            dropped.append(
                (f"{spec.name} {i}", f"box [{corners}] (ltrb) {where}; the box was dropped")
            )
        good = ~(empty | outside)
        clipped = boxes[good].copy()
        np.clip(clipped[:, 0::2], 0, width, out=clipped[:, 0::2])
        np.clip(clipped[:, 1::2], 0, height, out=clipped[:, 1::2])
        kept[spec.name] = clipped
        for follower in specs:
            value = kept.get(follower.name)
            if follower.along == spec.name and isinstance(value, np.ndarray):
                kept[follower.name] = value[good]
    return kept, dropped
