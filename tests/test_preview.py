"""`batchwire preview`: a PNG grid of one served batch, each tile captioned with its label."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import ingest_coco, start_server
from PIL import Image, ImageDraw, ImageFont
from test_outputs import PAIR

from batchwire.cli import main
from batchwire.cli._preview import (
    CAPTION_HEIGHT,
    CAPTION_LINES,
    CAPTION_OFFSET,
    GAP,
    MIN_TILE_WIDTH,
)
from batchwire.cli._preview_layout import box_colour
from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer
from batchwire.server.data import BOX_COLOURS, write_coco_boxes
from batchwire.server.pipelines import PRESETS

PARAMS = {"size": 48, "resize": 56}
CLASSES = ("circle", "cross", "square", "triangle")  # the sorted class folders of `shapes`


def served(server: BatchwireServer, count: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """The batch the preview must show, fetched as a trainer would (uint8 NCHW)."""
    with RemoteLoader(
        server.target,
        dataset="shapes",
        pipeline="val",
        batch_size=count,
        seed=seed,
        drop_last=False,
        normalize=False,
        params=PARAMS,
    ) as loader:
        images, labels = next(iter(loader))
    return images.numpy(), labels.tolist()


def expected_strip(text: str, width: int) -> np.ndarray:
    """A caption strip drawn independently: black default-font text on white."""
    strip = Image.new("RGB", (width, CAPTION_HEIGHT), (255, 255, 255))
    ImageDraw.Draw(strip).text(CAPTION_OFFSET, text, fill=(0, 0, 0), font=ImageFont.load_default())
    return np.asarray(strip)


def preview(server: BatchwireServer, out: pathlib.Path, *extra: str) -> int:
    return main(
        [
            "preview",
            "--address",
            server.target,
            "--dataset",
            "shapes",
            "--pipeline",
            "val",
            "--out",
            str(out),
            "--batch-size",
            "6",
            "--seed",
            "3",
            "--param",
            "size=48",
            "--param",
            "resize=56",
            *extra,
        ]
    )


def tiles(grid: np.ndarray, count: int, columns: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(image, caption strip) of each tile, cut where the documented layout puts them."""
    tile_w, size = max(48, MIN_TILE_WIDTH), 48
    cut = []
    for i in range(count):
        x = GAP + (i % columns) * (tile_w + GAP)
        y = GAP + (i // columns) * (size + CAPTION_HEIGHT + GAP)
        left = x + (tile_w - size) // 2
        cut.append(
            (
                grid[y : y + size, left : left + size],
                grid[y + size : y + size + CAPTION_HEIGHT, x : x + tile_w],
            )
        )
    return cut


def test_preview_writes_the_served_batch_with_captions(
    server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "grid.png"
    assert preview(server, out) == 0
    assert f"wrote {out}: 6 images" in capsys.readouterr().out
    with Image.open(out) as png:
        assert png.format == "PNG"
        grid = np.asarray(png.convert("RGB"))
    # 6 tiles: 3 columns x 2 rows of (96 + gap) x (48 + caption + gap), plus the outer gap.
    assert grid.shape == (GAP + 2 * (48 + CAPTION_HEIGHT + GAP), GAP + 3 * (96 + GAP), 3)

    images, labels = served(server, 6, seed=3)
    captions = []
    for (tile, strip), image, label in zip(tiles(grid, 6, 3), images, labels, strict=True):
        assert np.array_equal(tile, image.transpose(1, 2, 0))
        text = f"{label} {CLASSES[label]}"
        captions.append(text)
        assert (strip != 255).any(), f"caption strip of {text!r} is blank"
        assert np.array_equal(strip, expected_strip(text, 96)), f"caption is not {text!r}"
    assert len(set(labels)) > 1, "the batch should show more than one class"


def test_normalized_output_is_unnormalized_for_display(
    server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    out = tmp_path / "float.png"
    assert preview(server, out, "--dtype", "float16", "--columns", "6") == 0
    with Image.open(out) as png:
        grid = np.asarray(png.convert("RGB"))
    assert grid.shape == (GAP + 48 + CAPTION_HEIGHT + GAP, GAP + 6 * (96 + GAP), 3)
    images, _ = served(server, 6, seed=3)
    for (tile, _strip), image in zip(tiles(grid, 6, 6), images, strict=True):
        # float16 keeps about 3 significant digits: within 1 of the uint8 value.
        difference = np.abs(tile.astype(int) - image.transpose(1, 2, 0).astype(int))
        assert difference.max() <= 1


def test_preview_errors_say_what_is_wrong(
    server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.png"
    args = ["preview", "--address", server.target, "--out", str(out)]
    assert main([*args, "--dataset", "imagenet"]) == 2
    assert "no dataset named 'imagenet'" in capsys.readouterr().err
    assert main([*args, "--dataset", "shapes", "--pipeline", "resnet"]) == 2
    assert "no pipeline 'resnet'" in capsys.readouterr().err
    assert main([*args, "--dataset", "shapes", "--param", "size"]) == 2
    assert "expected NAME=NUMBER" in capsys.readouterr().err
    assert main([*args, "--dataset", "shapes", "--param", "bogus=1"]) == 2
    assert "no parameter 'bogus'" in capsys.readouterr().err
    missing = ["--out", str(tmp_path / "no" / "such" / "dir.png")]
    assert main([*args[:3], *missing, "--dataset", "shapes"]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert main(["preview", "--address", "localhost:1", "--dataset", "d", "--out", str(out)]) == 1
    assert "unavailable" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def fields_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchwireServer]:
    """``boxes``, ``masked`` and ``captions`` (COCO instances, their masks and captions of 16
    generated pictures),
    served with the presets and ``pair``, a custom pipeline of named outputs."""
    coco = write_coco_boxes(tmp_path_factory.mktemp("coco"), count=16)
    root = ingest_coco(coco, tmp_path_factory.mktemp("fields"))
    server = start_server(root, pipelines={**PRESETS, "pair": PAIR})
    yield server
    server.stop(grace=1.0)


def preview_of(server: BatchwireServer, out: pathlib.Path, dataset: str, *extra: str) -> int:
    argv = ["preview", "--address", server.target, "--dataset", dataset, "--out", str(out)]
    return main([*argv, "--batch-size", "6", "--seed", "3", *extra])


def read_png(path: pathlib.Path) -> np.ndarray:
    with Image.open(path) as png:
        assert png.format == "PNG"
        return np.asarray(png.convert("RGB"))


def grid_origin(i: int, columns: int, tile_h: int) -> tuple[int, int]:
    return GAP + (i % columns) * (MIN_TILE_WIDTH + GAP), GAP + (i // columns) * (tile_h + GAP)


# The full picture, not flipped: each target's boxes are those of the picture, resized.
WHOLE = {"size": 96, "flip": 0, "scale_min": 1, "aspect_min": 1, "aspect_max": 1}


def test_detection_boxes_are_outlined_in_their_class_colour(
    fields_server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "boxes.png"
    params = [arg for name, v in WHOLE.items() for arg in ("--param", f"{name}={v}")]
    assert preview_of(fields_server, out, "boxes", "--pipeline", "detection", *params) == 0
    assert "6 images of 'boxes' through 'detection' (96x96 each" in capsys.readouterr().out
    grid = read_png(out)
    assert grid.shape == (GAP + 2 * (96 + CAPTION_HEIGHT + GAP), GAP + 3 * (96 + GAP), 3)
    with RemoteLoader(
        fields_server.target, dataset="boxes", pipeline="detection", batch_size=6, seed=3,
        drop_last=False, normalize=False, params=WHOLE,
    ) as loader:  # fmt: skip
        images, targets = next(iter(loader))
        classes = loader.classes
    checked = 0
    for i, target in enumerate(targets):
        x, y = grid_origin(i, 3, 96 + CAPTION_HEIGHT)
        tile = grid[y : y + 96, x : x + 96]
        boxes, labels = target["boxes"].tolist(), target["labels"].tolist()
        for (left, top, right, bottom), label in zip(boxes, labels, strict=True):
            x0, y0, x1, y1 = round(left), round(top), round(right) - 1, round(bottom) - 1
            if x1 - x0 < 16 or y1 - y0 < 16:
                continue  # its name may cover a small box's edges
            # Its bottom and right edges, mostly in its class's colour (another box may cross).
            edges = np.concatenate([tile[y1, x0 : x1 + 1], tile[y0 : y1 + 1, x1]])
            drawn = (edges == box_colour(label)).all(axis=1).mean()
            assert drawn > 0.5, (i, label, drawn)
            checked += 1
        served = images[i].numpy().transpose(1, 2, 0)
        assert (tile != served).any(axis=2).sum() > 0, "nothing drawn on the image"
        names = ", ".join(classes[label] for label in labels)
        text = f"{len(labels)} boxes: {names}"
        strip = grid[y + 96 : y + 96 + CAPTION_HEIGHT, x : x + 96]
        assert np.array_equal(strip, expected_strip(fit(text, 96), 96)), text
    assert checked >= 3


def fit(text: str, width: int) -> str:
    """``text`` cut with "..." to the caption strip's width, as the preview cuts it."""
    draw, font = ImageDraw.Draw(Image.new("RGB", (1, 1))), ImageFont.load_default()
    room = width - 2 * CAPTION_OFFSET[0]
    if draw.textlength(text, font=font) <= room:
        return text
    while draw.textlength(text + "...", font=font) > room:
        text = text[:-1]
    return text + "..."


def test_multicrop_shows_each_samples_ten_views_in_a_row(
    server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "views.png"
    sizes = ["--param", "global_size=64", "--param", "local_size=32"]
    assert (
        preview_of(server, out, "shapes", "--pipeline", "multicrop", "--batch-size", "4", *sizes)
        == 0
    )
    assert "4 samples of 'shapes' through 'multicrop' (10 views each" in capsys.readouterr().out
    sheet = read_png(out)
    row_w, row_h = 10 * 64 + 9 * GAP, 64 + CAPTION_HEIGHT
    assert sheet.shape == (GAP + 4 * (row_h + GAP), 2 * GAP + row_w, 3)
    _, labels = served(server, 4, seed=3)  # the same samples, through val
    for r, label in enumerate(labels):
        y = GAP + r * (row_h + GAP)
        for k in range(10):
            x = GAP + k * (64 + GAP)
            view = sheet[y : y + 64, x : x + 64]
            assert view.std() > 0, f"view {k} of row {r} is blank"
            if k >= 2:  # a local view, 32 pixels scaled to 64: each pixel twice each way
                assert np.array_equal(view, view[::2, ::2].repeat(2, 0).repeat(2, 1))
        strip = sheet[y + 64 : y + row_h, GAP : GAP + row_w]
        assert np.array_equal(strip, expected_strip(f"{label} {CLASSES[label]}", row_w))


def wrapped(text: str, width: int) -> list[str]:
    """``text`` broken between words into lines that fit the caption strip."""
    draw, font = ImageDraw.Draw(Image.new("RGB", (1, 1))), ImageFont.load_default()
    lines = [""]
    for word in text.split():
        longer = f"{lines[-1]} {word}".strip()
        if lines[-1] and draw.textlength(longer, font=font) > width - 2 * CAPTION_OFFSET[0]:
            lines.append(word)
        else:
            lines[-1] = longer
    return lines


def test_captions_are_written_under_their_images(
    fields_server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    out = tmp_path / "captions.png"
    sizes = ["--param", "size=64", "--param", "resize=72"]
    assert preview_of(fields_server, out, "captions", "--pipeline", "captions", *sizes) == 0
    grid = read_png(out)
    tile_h = 64 + CAPTION_LINES * CAPTION_HEIGHT
    assert grid.shape == (GAP + 2 * (tile_h + GAP), GAP + 3 * (96 + GAP), 3)
    with RemoteLoader(
        fields_server.target, dataset="captions", pipeline="captions", batch_size=6, seed=3,
        drop_last=False, normalize=False, params={"size": 64, "resize": 72},
    ) as loader:  # fmt: skip
        images, captions = next(iter(loader))
    broken = 0
    for i, (image, text) in enumerate(zip(images, captions, strict=True)):
        x, y = grid_origin(i, 3, tile_h)
        assert np.array_equal(grid[y : y + 64, x + 16 : x + 80], image.numpy().transpose(1, 2, 0))
        lines = wrapped(text if isinstance(text, str) else " / ".join(text), 96)
        assert len(lines) <= CAPTION_LINES, lines
        broken += len(lines) > 1
        for k, line in enumerate(lines):
            top = y + 64 + k * CAPTION_HEIGHT
            strip = grid[top : top + CAPTION_HEIGHT, x : x + 96]
            assert np.array_equal(strip, expected_strip(line, 96)), f"line {k} is not {line!r}"
    assert broken, "some caption should be longer than a line"


def test_named_outputs_show_the_images_and_the_other_outputs_shapes(
    fields_server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "named.png"
    assert preview_of(fields_server, out, "boxes", "--pipeline", "pair") == 0
    assert "6 samples of 'boxes' through 'pair' (image outputs small, large" in (
        capsys.readouterr().out
    )
    sheet = read_png(out)
    row_h = 40 + CAPTION_HEIGHT  # the tallest image output, "large"
    assert sheet.shape == (GAP + 6 * (row_h + GAP), 2 * GAP + MIN_TILE_WIDTH, 3)
    with RemoteLoader(
        fields_server.target, dataset="boxes", pipeline="pair", batch_size=6, seed=3,
        drop_last=False, normalize=False,
    ) as loader:  # fmt: skip
        outputs, labels = next(iter(loader))
        classes = loader.classes
    for r, label in enumerate(labels.tolist()):
        y = GAP + r * (row_h + GAP)
        large = sheet[y : y + 40, 2 * GAP + 40 : 2 * GAP + 80]
        assert np.array_equal(large, outputs["large"][r].numpy().transpose(1, 2, 0))
        size = outputs["encoded"][r].shape[0]
        named = f"{label} {classes[label]}" if 0 <= label < len(classes) else str(label)
        text = fit(f"{named}; encoded {size}", MIN_TILE_WIDTH)
        strip = sheet[y + 40 : y + row_h, GAP : GAP + MIN_TILE_WIDTH]
        assert np.array_equal(strip, expected_strip(text, MIN_TILE_WIDTH)), text


def test_segmentation_masks_are_blended_in_their_class_colour(
    fields_server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The generated pictures' boxes are flat class colours, and their masks cover them:
    inside, a pixel is half the picture's colour, half the class's outline colour."""
    out = tmp_path / "masks.png"
    params = ["--pipeline", "segmentation", "--param", "size=96", "--param", "flip=0"]
    assert preview_of(fields_server, out, "masked", *params) == 0
    assert "6 images of 'masked' through 'segmentation' (96x96 each" in capsys.readouterr().out
    grid = read_png(out)
    assert grid.shape == (GAP + 2 * (96 + CAPTION_HEIGHT + GAP), GAP + 3 * (96 + GAP), 3)
    seen = set()
    for i in range(6):
        x, y = grid_origin(i, 3, 96 + CAPTION_HEIGHT)
        tile = grid[y : y + 96, x : x + 96].astype(int)
        for label, coco_id in enumerate(sorted(BOX_COLOURS)):
            blend = (np.array(BOX_COLOURS[coco_id][1]) + box_colour(label)) // 2
            if (np.abs(tile - blend).max(axis=2) <= 2).sum() > 20:
                seen.add(label)
        strip = grid[y + 96 : y + 96 + CAPTION_HEIGHT, x : x + 96]
        assert (strip != 255).any(), f"caption strip {i} is blank"
    assert len(seen) >= 2, seen
