"""`batchwire preview`: a PNG grid of one served batch, each tile captioned with its label."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from batchwire.cli import main
from batchwire.cli._preview import CAPTION_HEIGHT, CAPTION_OFFSET, GAP, MIN_TILE_WIDTH
from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer

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
