"""``batchwire preview --address A --dataset D --pipeline P --out grid.png``: see a served batch.

Streams one batch exactly as a trainer would receive it and writes it as a PNG
grid: one tile per image, captioned with its label and class name. Use it to
check what an augmentation does (``--pipeline train``, ``--param size=160``)
before training on it.

Layout of the PNG, for people and tests: tiles sit in a grid of ``--columns``
columns (default: the smallest square that holds the batch) separated and
surrounded by ``GAP`` pixels of white. A tile is ``max(W, MIN_TILE_WIDTH)``
wide and ``H + CAPTION_HEIGHT`` high: the image at its top, centred, and a
white caption strip below it with ``"<label> <class name>"`` in black,
written with Pillow's default font at ``CAPTION_OFFSET`` within the strip.
"""

from __future__ import annotations

import argparse
import importlib
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from batchwire.cli import _credentials as credentials
from batchwire.cli._datasets import DATASET_HELP, batched, dataset_or_mixture
from batchwire.common.batchings import BATCHING_HELP, BATCHINGS

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = [
    "CAPTION_HEIGHT",
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

GAP = 4
MIN_TILE_WIDTH = 96
CAPTION_HEIGHT = 16
CAPTION_OFFSET = (2, 2)
_WHITE = (255, 255, 255)
_BLACK = (0, 0, 0)


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


def to_pixels(
    images: np.ndarray, *, layout: str, mean: Sequence[float], std: Sequence[float]
) -> np.ndarray:
    """A batch as displayable uint8 NHWC: uint8 as is, normalized floats as ``x * std + mean``."""
    import numpy as np

    if layout == "NCHW":
        images = images.transpose(0, 2, 3, 1)
    if images.dtype == np.uint8:
        return np.ascontiguousarray(images)
    channels = images.shape[-1]
    m = np.asarray(list(mean) or [0.0], dtype=np.float32)[:channels]
    s = np.asarray(list(std) or [1.0], dtype=np.float32)[:channels]
    restored = images.astype(np.float32) * s + m
    return np.clip(np.rint(restored), 0, 255).astype(np.uint8)


def caption(label: int, classes: Sequence[str], source: str = "") -> str:
    """A tile's caption: the label, and its class name when the dataset names it
    differently; a mixed sample's starts with its ``source`` dataset's name."""
    name = classes[label] if 0 <= label < len(classes) else ""
    text = f"{label} {name}" if name and name != str(label) else str(label)
    return f"{source}: {text}" if source else text


def _fit(draw: Any, text: str, width: int, font: Any) -> str:
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def render_grid(
    pixels: np.ndarray, captions: Sequence[str], *, columns: int | None = None
) -> Image.Image:
    """The grid image of ``pixels`` (uint8 NHWC, 1 or 3 channels) with one caption per tile."""
    from PIL import Image, ImageDraw, ImageFont

    count, height, width, channels = pixels.shape
    columns = columns or max(1, math.ceil(math.sqrt(count)))
    rows = max(1, math.ceil(count / columns))
    tile_w, tile_h = max(width, MIN_TILE_WIDTH), height + CAPTION_HEIGHT
    grid = Image.new(
        "RGB",
        (GAP + columns * (tile_w + GAP), GAP + rows * (tile_h + GAP)),
        _WHITE,
    )
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i in range(count):
        x = GAP + (i % columns) * (tile_w + GAP)
        y = GAP + (i // columns) * (tile_h + GAP)
        tile = pixels[i, :, :, 0] if channels == 1 else pixels[i, :, :, :3]
        grid.paste(Image.fromarray(tile).convert("RGB"), (x + (tile_w - width) // 2, y))
        text = _fit(draw, captions[i], tile_w - 2 * CAPTION_OFFSET[0], font)
        draw.text(
            (x + CAPTION_OFFSET[0], y + height + CAPTION_OFFSET[1]), text, fill=_BLACK, font=font
        )
    return grid


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from batchwire.client import BatchwireError, RemoteLoader

    # Pillow draws the grid: where it is missing, say so before streaming anything.
    importlib.import_module("PIL.Image")

    if args.batch_size < 1 or (args.columns is not None and args.columns < 1):
        print("error: --batch-size and --columns must be at least 1", file=sys.stderr)
        return 2
    try:
        params = _params(args.param)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        dataset = batched(args.dataset, args.batching)
    except argparse.ArgumentTypeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
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
            images, labels, ids = next(iter(loader))
            # Each sample's dataset: a mixture's tiles say it, as labels are each one's own.
            names = list(classes)
            sources = loader.split_ids(ids)[0].tolist()
    except BatchwireError as exc:
        print(f"error: {exc.details}", file=sys.stderr)
        return 2 if exc.code.name in ("INVALID_ARGUMENT", "NOT_FOUND") else 1
    except StopIteration:
        print(f"error: {loader.dataset_name!r} gave no decodable image", file=sys.stderr)
        return 1
    pixels = to_pixels(np.asarray(images), layout="NCHW", mean=spec.mean, std=spec.std)
    mixed = loader.mixture is not None
    captions = [
        caption(int(label), classes[names[s]], names[s] if mixed else "")
        for label, s in zip(labels.tolist(), sources, strict=True)
    ]
    grid = render_grid(pixels, captions, columns=args.columns)
    try:
        grid.save(args.out, format="PNG")
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    count, height, width = pixels.shape[:3]
    print(
        f"wrote {args.out}: {count} images of {loader.dataset_name!r} through {args.pipeline!r} "
        f"({width}x{height} each, {grid.width}x{grid.height} grid)"
    )
    return 0
