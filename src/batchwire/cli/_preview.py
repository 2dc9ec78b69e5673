"""``batchwire preview --address A --dataset D --pipeline P --out grid.png``: see a served batch.

Streams one batch exactly as a trainer would receive it and writes it as a PNG, drawn as
the pipeline's form says (``_preview_layout`` gives the layouts):

- images and labels: a grid, one tile an image, captioned with its label and class name;
- ``detection``: the same grid, each tile captioned with its boxes' classes, each box
  outlined on its image in its class's colour and named;
- ``segmentation``: the grid, each mask's classes blended over its image in their colours,
  each tile captioned with the classes it shows;
- ``captions``: the grid, each tile captioned with its sample's caption(s) in up to
  ``CAPTION_LINES`` lines;
- ``views`` (``multicrop``): one row a sample, its views side by side at the height of the
  first (a global view), captioned with its label;
- ``named`` (a custom pipeline's outputs): one row a sample, its image outputs side by side
  at the height of the tallest, captioned with its label and each other output's shape.

Use it to check what an augmentation does (``--pipeline train``, ``--param size=160``)
before training on it.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from batchwire.cli import _credentials as credentials
from batchwire.cli._datasets import DATASET_HELP, batched, dataset_or_mixture
from batchwire.cli._preview_layout import (
    CAPTION_HEIGHT,
    CAPTION_OFFSET,
    GAP,
    MIN_TILE_WIDTH,
    caption,
    class_name,
    draw_boxes,
    overlay_mask,
    render_grid,
    render_rows,
    to_pixels,
)
from batchwire.common.batchings import BATCHING_HELP, BATCHINGS

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from batchwire.v1.batchwire_pb2 import PipelineInfo

__all__ = [
    "CAPTION_HEIGHT",
    "CAPTION_LINES",
    "CAPTION_OFFSET",
    "DESCRIPTION",
    "GAP",
    "HELP",
    "MIN_TILE_WIDTH",
    "add_arguments",
    "caption",
    "render_grid",
    "run",
    "to_pixels",
]

CAPTION_LINES = 3  # of a captions pipeline's tile


HELP = "write one served batch as a PNG grid captioned with labels"
DESCRIPTION = (
    "Stream one batch of DATASET through PIPELINE from a server and write it as a PNG "
    "grid, each image captioned with its label and class name: see what a pipeline "
    "and its parameters do before training."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default="localhost:50051", help="HOST:PORT (default localhost:50051)"
    )
    parser.add_argument("--dataset", required=True, type=dataset_or_mixture, help=DATASET_HELP)
    parser.add_argument("--batching", choices=BATCHINGS, default="random", help=BATCHING_HELP)
    parser.add_argument("--pipeline", default="train", help="pipeline name (default train)")
    parser.add_argument(
        "--out", required=True, type=pathlib.Path, metavar="PNG", help="where to write the grid"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, metavar="N", help="images in the grid (default 16)"
    )
    parser.add_argument(
        "--columns", type=int, default=None, metavar="N", help="tiles per row (default: square)"
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a pipeline parameter, e.g. --param size=160 (repeatable)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="shuffle seed: another seed, other images (default 0)"
    )
    parser.add_argument("--epoch", type=int, default=0, help="epoch of the order (default 0)")
    parser.add_argument(
        "--no-shuffle", action="store_true", help="the first images in id order instead"
    )
    parser.add_argument(
        "--dtype",
        choices=["uint8", "float16", "float32"],
        default="uint8",
        help="output dtype to ask for; normalized floats are un-normalized for display",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the batch (default 60)"
    )
    credentials.add_arguments(parser)


def _params(items: Sequence[str]) -> dict[str, float]:
    params: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            params[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--param {item!r}: expected NAME=NUMBER, e.g. size=160") from None
    return params


class _NothingToDraw(Exception):
    """The batch, or the pipeline, has nothing the preview can draw."""


class Sheet(NamedTuple):
    """A drawn batch, and what the command says of it: ``shown`` (``"6 images"``) and
    ``detail`` (``"48x48 each"``)."""

    image: Image.Image
    shown: str
    detail: str


# Each sample's class names and, in a mixture, its dataset's name (else "").
Samples = Sequence[tuple[Sequence[str], str]]


def _pixels(spec: PipelineInfo, images: Any) -> np.ndarray:
    import numpy as np

    return to_pixels(np.asarray(images), layout="NCHW", mean=spec.mean, std=spec.std)


def _prefixed(source: str, text: str) -> str:
    return f"{source}: {text}" if source else text


def _labelled(labels: Any, samples: Samples) -> list[str]:
    return [
        caption(int(label), classes, source)
        for label, (classes, source) in zip(labels.tolist(), samples, strict=True)
    ]


def _classified(
    spec: PipelineInfo, images: Any, labels: Any, samples: Samples, columns: int | None
) -> Sheet:
    pixels = _pixels(spec, images)
    grid = render_grid(pixels, _labelled(labels, samples), columns=columns)
    count, height, width = pixels.shape[:3]
    return Sheet(grid, f"{count} images", f"{width}x{height} each")


def _detection(
    spec: PipelineInfo, images: Any, targets: Any, samples: Samples, columns: int | None
) -> Sheet:
    import numpy as np

    pixels = _pixels(spec, images)
    drawn, captions = [], []
    for image, target, (classes, source) in zip(pixels, targets, samples, strict=True):
        labels = target["labels"].tolist()
        drawn.append(draw_boxes(image, target["boxes"].numpy(), labels, classes))
        names = ", ".join(class_name(label, classes) for label in labels)
        captions.append(_prefixed(source, f"{len(labels)} boxes: {names}"))
    grid = render_grid(np.stack(drawn), captions, columns=columns)
    count, height, width = pixels.shape[:3]
    boxes = sum(len(t["labels"]) for t in targets)
    return Sheet(grid, f"{count} images", f"{width}x{height} each, {boxes} boxes")


def _segmentation(
    spec: PipelineInfo, images: Any, masks: Any, samples: Samples, columns: int | None
) -> Sheet:
    import numpy as np

    pixels, masks = _pixels(spec, images), masks.numpy()
    drawn = np.stack([overlay_mask(image, mask) for image, mask in zip(pixels, masks, strict=True)])
    captions = [
        _prefixed(source, ", ".join(class_name(int(v) - 1, classes) for v in np.unique(mask) if v))
        or "background"
        for mask, (classes, source) in zip(masks, samples, strict=True)
    ]
    grid = render_grid(drawn, captions, columns=columns)
    count, height, width = pixels.shape[:3]
    return Sheet(grid, f"{count} images", f"{width}x{height} each")


def _captions(
    spec: PipelineInfo, images: Any, texts: Any, samples: Samples, columns: int | None
) -> Sheet:
    pixels = _pixels(spec, images)
    captions = [
        _prefixed(source, text if isinstance(text, str) else " / ".join(text))
        for text, (_, source) in zip(texts, samples, strict=True)
    ]
    grid = render_grid(pixels, captions, columns=columns, lines=CAPTION_LINES)
    count, height, width = pixels.shape[:3]
    return Sheet(grid, f"{count} images", f"{width}x{height} each")


def _views(
    spec: PipelineInfo, views: Any, labels: Any, samples: Samples, columns: int | None
) -> Sheet:
    pixels = [_pixels(spec, view) for view in views]
    rows = [[view[i] for view in pixels] for i in range(len(labels))]
    sheet = render_rows(rows, _labelled(labels, samples), height=pixels[0].shape[1])
    return Sheet(sheet, f"{len(rows)} samples", f"{len(views)} views each")


def _shape(value: Any) -> str:
    """A sample's output in a caption: its shape, or its text."""
    if hasattr(value, "shape"):
        return "x".join(str(n) for n in value.shape) or "scalar"
    return repr(value)


def _named(
    spec: PipelineInfo, outputs: Any, labels: Any, samples: Samples, columns: int | None
) -> Sheet:
    kinds = {output.name: output.kind for output in spec.outputs}
    drawn = [n for n, v in outputs.items() if kinds.get(n) == "image" and v.ndim == 4]
    if not drawn:
        raise _NothingToDraw(f"pipeline {spec.name!r} has no image output to draw")
    pixels = [_pixels(spec, outputs[name]) for name in drawn]
    rows = [[image[i] for image in pixels] for i in range(len(labels))]
    others = [name for name in outputs if name not in drawn]
    captions = [
        "; ".join([text, *(f"{n} {_shape(outputs[n][i])}" for n in others)])
        for i, text in enumerate(_labelled(labels, samples))
    ]
    sheet = render_rows(rows, captions, height=max(image.shape[1] for image in pixels))
    return Sheet(sheet, f"{len(rows)} samples", f"image outputs {', '.join(drawn)}")


Draw = Callable[[Any, Any, Any, Samples, "int | None"], Sheet]
# A pipeline's form ("" for images and labels) to its drawing; a form this client does
# not know comes as the loader gives it, a dict of outputs by name.
_FORMS: dict[str, Draw] = {
    "": _classified,
    "detection": _detection,
    "segmentation": _segmentation,
    "captions": _captions,
    "views": _views,
    "named": _named,
}


def _fetch(
    args: argparse.Namespace, dataset: Any, params: dict[str, float]
) -> tuple[str, PipelineInfo, tuple[Any, Any], Samples]:
    """One batch as the loop takes it, with the dataset's name, the pipeline, and each
    sample's classes and source."""
    from batchwire.client import RemoteLoader

    loader = RemoteLoader(
        args.address,
        dataset=dataset,
        pipeline=args.pipeline,
        batch_size=args.batch_size,
        shuffle=not args.no_shuffle,
        drop_last=False,
        seed=args.seed,
        rank=0,
        world_size=1,
        normalize=False,
        return_ids=True,
        dtype=args.dtype,
        params=params,
        timeout=args.timeout,
        retry_timeout=min(args.timeout, 10.0),
        **credentials.loader_options(args),
    )
    with loader:
        loader.set_epoch(args.epoch)
        classes = loader.source_classes
        spec = next(p for p in loader._describe().info.pipelines if p.name == args.pipeline)
        try:
            first, second, ids = next(iter(loader))
        except StopIteration:
            raise _NothingToDraw(f"{loader.dataset_name!r} gave no decodable image") from None
        # Each sample's dataset: a mixture's tiles say it, as labels are each one's own.
        names = list(classes)
        sources = loader.split_ids(ids)[0].tolist()
    mixed = loader.mixture is not None
    samples = [(classes[names[s]], names[s] if mixed else "") for s in sources]
    return loader.dataset_name, spec, (first, second), samples


def run(args: argparse.Namespace) -> int:
    from batchwire.client import BatchwireError

    # Pillow draws the grid: where it is missing, say so before streaming anything.
    importlib.import_module("PIL.Image")

    if args.batch_size < 1 or (args.columns is not None and args.columns < 1):
        print("error: --batch-size and --columns must be at least 1", file=sys.stderr)
        return 2
    try:
        params = _params(args.param)
        dataset = batched(args.dataset, args.batching)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        name, spec, batch, samples = _fetch(args, dataset, params)
        draw = _FORMS.get(spec.form, _named)
        sheet = draw(spec, *batch, samples, args.columns)
    except BatchwireError as exc:
        print(f"error: {exc.details}", file=sys.stderr)
        return 2 if exc.code.name in ("INVALID_ARGUMENT", "NOT_FOUND") else 1
    except _NothingToDraw as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        sheet.image.save(args.out, format="PNG")
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    width, height = sheet.image.size
    print(
        f"wrote {args.out}: {sheet.shown} of {name!r} through {args.pipeline!r} "
        f"({sheet.detail}, {width}x{height} grid)"
    )
    return 0
