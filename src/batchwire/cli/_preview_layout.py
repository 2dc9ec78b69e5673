"""How ``batchwire preview`` draws a batch: pixels for display, grids and rows of tiles,
captions, and boxes.

A grid (``render_grid``): tiles in ``columns`` columns (default: the smallest square that
holds the batch) separated and surrounded by ``GAP`` pixels of white. A tile is ``max(W,
MIN_TILE_WIDTH)`` wide and ``H + lines * CAPTION_HEIGHT`` high: the image at its top,
centred, and a white caption strip below it, its text in black in Pillow's default font,
the first line at ``CAPTION_OFFSET`` within the strip and each next one ``CAPTION_HEIGHT``
lower (one line by default, cut with "..." where it is too wide).

Rows (``render_rows``), for samples of several images (views, a pipeline's image
outputs): one row a sample, its images side by side ``GAP`` apart, each scaled to
``height`` (nearest pixel, aspect kept), then its one-line caption strip; rows start at
``GAP`` from the left and are ``GAP`` apart.

A mask (``overlay_mask``): each pixel of class ``c`` (mask value ``c + 1``; 0 the
background, left as it is) half its class's colour (``box_colour``), half the image's.

Boxes (``draw_boxes``): each box's outline in its class's colour (``box_colour``), the
class name in white on that colour at its top left corner, inside the box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = [
    "CAPTION_HEIGHT",
    "CAPTION_OFFSET",
    "GAP",
    "MIN_TILE_WIDTH",
    "box_colour",
    "caption",
    "class_name",
    "draw_boxes",
    "overlay_mask",
    "render_grid",
    "render_rows",
    "to_pixels",
]

GAP = 4
MIN_TILE_WIDTH = 96
CAPTION_HEIGHT = 16
CAPTION_OFFSET = (2, 2)
_WHITE = (255, 255, 255)
_BLACK = (0, 0, 0)
# Tableau's ten colours: far apart, and unlike the flat colours of generated pictures.
_PALETTE = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)


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


def class_name(label: int, classes: Sequence[str]) -> str:
    """Class ``label``'s name, or the label where the dataset names no such class."""
    return classes[label] if 0 <= label < len(classes) else str(label)


def box_colour(label: int) -> tuple[int, int, int]:
    """The outline colour of class ``label``'s boxes (ten colours, then again)."""
    return _PALETTE[label % len(_PALETTE)]


def _fit(draw: Any, text: str, width: int, font: Any) -> str:
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def _wrap(draw: Any, text: str, width: int, font: Any, lines: int) -> list[str]:
    """``text`` in at most ``lines`` lines of ``width`` pixels, broken between words;
    the last one cut with "..." where the text goes on."""
    if lines == 1:
        return [_fit(draw, text, width, font)]
    words, wrapped = text.split(), list[str]()
    while words and len(wrapped) < lines - 1:
        n = 1
        while n < len(words) and draw.textlength(" ".join(words[: n + 1]), font=font) <= width:
            n += 1
        wrapped.append(" ".join(words[:n]))
        words = words[n:]
    if words:
        wrapped.append(" ".join(words))
    return [_fit(draw, line, width, font) for line in wrapped]


def _write(draw: Any, xy: tuple[int, int], text: str, width: int, lines: int = 1) -> None:
    """A caption strip's text, its top left corner at ``xy``."""
    from PIL import ImageFont

    font = ImageFont.load_default()
    fitted = _wrap(draw, text, width - 2 * CAPTION_OFFSET[0], font, lines)
    for k, line in enumerate(fitted):
        at = (xy[0] + CAPTION_OFFSET[0], xy[1] + CAPTION_OFFSET[1] + k * CAPTION_HEIGHT)
        draw.text(at, line, fill=_BLACK, font=font)


def _image(pixels: np.ndarray) -> Image.Image:
    """One HWC uint8 image (1 or 3+ channels) as an RGB picture."""
    from PIL import Image

    tile = pixels[:, :, 0] if pixels.shape[2] == 1 else pixels[:, :, :3]
    return Image.fromarray(tile).convert("RGB")


def render_grid(
    pixels: np.ndarray, captions: Sequence[str], *, columns: int | None = None, lines: int = 1
) -> Image.Image:
    """The grid image of ``pixels`` (uint8 NHWC, 1 or 3 channels) with one caption per
    tile, each in at most ``lines`` lines."""
    from PIL import Image, ImageDraw

    count, height, width = pixels.shape[:3]
    columns = columns or max(1, math.ceil(math.sqrt(count)))
    rows = max(1, math.ceil(count / columns))
    tile_w, tile_h = max(width, MIN_TILE_WIDTH), height + lines * CAPTION_HEIGHT
    grid = Image.new(
        "RGB",
        (GAP + columns * (tile_w + GAP), GAP + rows * (tile_h + GAP)),
        _WHITE,
    )
    draw = ImageDraw.Draw(grid)
    for i in range(count):
        x = GAP + (i % columns) * (tile_w + GAP)
        y = GAP + (i // columns) * (tile_h + GAP)
        grid.paste(_image(pixels[i]), (x + (tile_w - width) // 2, y))
        _write(draw, (x, y + height), captions[i], tile_w, lines)
    return grid


def render_rows(
    rows: Sequence[Sequence[np.ndarray]], captions: Sequence[str], *, height: int
) -> Image.Image:
    """One row a sample: its images (uint8 HWC) side by side, each scaled to ``height``
    pixels high, over the sample's caption."""
    from PIL import Image, ImageDraw

    def scale(pixels: np.ndarray) -> Image.Image:
        width = max(1, round(pixels.shape[1] * height / pixels.shape[0]))
        return _image(pixels).resize((width, height), Image.Resampling.NEAREST)

    scaled = [[scale(pixels) for pixels in row] for row in rows]
    widths = [sum(im.width for im in row) + GAP * max(0, len(row) - 1) for row in scaled]
    row_w, row_h = max([MIN_TILE_WIDTH, *widths]), height + CAPTION_HEIGHT
    sheet = Image.new("RGB", (2 * GAP + row_w, GAP + len(rows) * (row_h + GAP)), _WHITE)
    draw = ImageDraw.Draw(sheet)
    for r, row in enumerate(scaled):
        x, y = GAP, GAP + r * (row_h + GAP)
        for im in row:
            sheet.paste(im, (x, y))
            x += im.width + GAP
        _write(draw, (GAP, y + height), captions[r], row_w)
    return sheet


def draw_boxes(
    pixels: np.ndarray, boxes: np.ndarray, labels: Sequence[int], classes: Sequence[str]
) -> np.ndarray:
    """``pixels`` (uint8 HWC) as RGB with each box (``[left, top, right, bottom]`` pixels)
    outlined in its class's colour and named at its top left corner."""
    import numpy as np
    from PIL import ImageDraw, ImageFont

    image = _image(pixels)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    line = max(1, round(image.height / 160))  # thin on small tiles, visible on large ones
    for (left, top, right, bottom), label in zip(boxes.tolist(), labels, strict=True):
        colour = box_colour(label)
        corner = (round(left), round(top))
        draw.rectangle((*corner, round(right) - 1, round(bottom) - 1), outline=colour, width=line)
        name = class_name(label, classes)
        name_box = draw.textbbox(corner, name, font=font)
        draw.rectangle(name_box, fill=colour)
        draw.text(corner, name, fill=_WHITE, font=font)
    return np.asarray(image)


def overlay_mask(pixels: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``pixels`` (uint8 HWC) as RGB, each pixel whose ``mask`` value (HW) is ``c + 1``
    blended half and half with class ``c``'s colour; 0, the background, kept."""
    import numpy as np

    image = np.asarray(_image(pixels)).astype(np.uint16)
    colours = np.asarray([(0, 0, 0), *_PALETTE], dtype=np.uint16)
    classes = mask.astype(np.int64)
    index = np.where(classes > 0, (classes - 1) % len(_PALETTE) + 1, 0)
    blended = (image + colours[index]) // 2
    return np.where((classes > 0)[..., None], blended, image).astype(np.uint8)
