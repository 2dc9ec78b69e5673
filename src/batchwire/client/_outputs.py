"""A batch of named outputs (``batchwire.common.outputs``) as the loop takes it: each output
a view of the batch's payload, ragged ones split per sample, arranged as the pipeline's
``form`` says."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from batchwire.client._transport import BatchwireError, StatusCode
from batchwire.common.outputs import TEXT_SEPARATOR
from batchwire.common.tensors import DTYPES
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["TORCH_DTYPES", "Named", "arrange", "unpack"]

TORCH_DTYPES = {
    np.dtype("u1"): torch.uint8,
    np.dtype("<i4"): torch.int32,
    np.dtype("<i8"): torch.int64,
    np.dtype("<f2"): torch.float16,
    np.dtype("<f4"): torch.float32,
}

# An output as the loop takes it: a batch tensor, a ragged output's tensor per sample, or
# a text output's text per sample.
Named = dict[str, Any]


def unpack(payload: torch.Tensor, heads: Sequence[pb.Tensor]) -> Named:
    """Each output of ``heads`` as a view of ``payload`` (flat uint8; no copy); a ragged
    one as a list of its samples. INTERNAL where a head does not fit the payload."""
    named: Named = {}
    for head in heads:
        dtype = DTYPES.get(head.dtype)
        shape = tuple(head.shape)
        size = int(np.prod(shape, dtype=np.int64)) * (dtype.itemsize if dtype else 0)
        if dtype is None or head.offset + size > payload.numel() or head.offset % dtype.itemsize:
            raise BatchwireError(
                f"output {head.name!r} ({shape}, dtype {head.dtype}, at byte {head.offset}) does "
                f"not fit the batch's {payload.numel()} bytes: the server sent a malformed batch",
                code=StatusCode.INTERNAL,
            )
        data = payload[head.offset : head.offset + size].view(TORCH_DTYPES[dtype]).reshape(shape)
        if head.kind not in ("ragged", "text"):
            named[head.name] = data
            continue
        lengths = [int(n) for n in head.lengths]
        if sum(lengths) != (shape[0] if shape else 0):
            raise BatchwireError(
                f"output {head.name!r}: its samples' lengths {lengths} do not add up to its "
                f"shape {shape}: the server sent a malformed batch",
                code=StatusCode.INTERNAL,
            )
        samples = list(torch.split(data, lengths)) if lengths else []
        named[head.name] = [_text(t) for t in samples] if head.kind == "text" else samples
    return named


def _text(data: torch.Tensor) -> str | list[str]:
    """A sample's text: one string, or the strings of a sample that holds several."""
    texts = bytes(data.numpy()).decode("utf-8", errors="replace").split(TEXT_SEPARATOR.decode())
    return texts[0] if len(texts) == 1 else texts


def arrange(
    form: str, named: Named, heads: Sequence[pb.Tensor], labels: torch.Tensor
) -> tuple[object, ...]:
    """What the loop yields: ``(views, labels)`` for the "views" form (the image outputs in
    the pipeline's order); ``(images, targets)`` for "detection", a target a sample as
    torchvision's detection models take them (``{"boxes": [n, 4] float32 left, top, right,
    bottom pixels, "labels": [n] int64}``); ``(images, masks)`` for "segmentation" (int64
    ``[B, H, W]``, a pixel 1 + its class, 0 the background); ``(images, captions)`` for "captions" (a
    sample's caption, or its list of them); else ``(outputs, labels)``, a dict of every
    output by name."""
    if form == "views":
        return [named[head.name] for head in heads if head.kind == "image"], labels
    if form == "detection":
        boxes, classes = named["boxes"], named["labels"]
        assert isinstance(boxes, list) and isinstance(classes, list)
        targets = [{"boxes": b, "labels": c} for b, c in zip(boxes, classes, strict=True)]
        return named["images"], targets
    if form == "segmentation":
        return named["images"], named["mask"].long()
    if form == "captions":
        return named["images"], named["caption"]
    return dict(named), labels
