"""What the pipelines compute: served bytes equal in-process DALI, and a PIL reference."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import skimage.data
import torch
from conftest import start_server
from nvidia.dali import Pipeline, fn, types
from PIL import Image

from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer
from batchwire.server.data import Dataset, ingest
from batchwire.server.pipelines import PRESETS, BuildContext, OutputSpec

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "hubble_deep_field")


@pytest.fixture(scope="module")
def photo_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A dataset of real photos (scikit-image's bundled ones) as JPEG, PNG and BMP."""
    root = tmp_path_factory.mktemp("photos")
    for i, name in enumerate(PHOTOS):
        pixels = getattr(skimage.data, name)()
        image = Image.fromarray(pixels).convert("RGB")
        folder = root / "images" / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{name}.jpg", quality=92)
        image.save(folder / f"{name}.png")
        image.save(folder / f"{name}.bmp")
    ingest(root / "images", root / "datasets", name="photos")
    server = start_server(root / "datasets")
    yield server, root / "datasets" / "photos"
    server.stop(grace=1.0)


def served_and_stored(
    server: BatchwireServer, dataset_dir: pathlib.Path
) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray | None], np.ndarray]:
    """One `val` batch of every photo as served, and the same records read from disk."""
    remote = RemoteLoader(
        server.target,
        dataset="photos",
        pipeline="val",
        batch_size=3 * len(PHOTOS),
        normalize=False,
        shuffle=False,
        drop_last=False,
        return_ids=True,
    )
    served, labels, ids = next(iter(remote))
    remote.close()
    with Dataset(dataset_dir) as dataset:
        encoded, stored_labels = dataset.read(ids.numpy())
    return served, labels, encoded, stored_labels


def in_process_val(encoded: list[np.ndarray], labels: np.ndarray) -> np.ndarray:
    """The `val` preset run by DALI in this process, no gRPC."""
    spec = PRESETS["val"]
    ctx = BuildContext(device="cpu", output=OutputSpec())
    pipe = Pipeline(batch_size=len(encoded), num_threads=2, device_id=None)
    with pipe:
        images_in = fn.external_source(source=lambda: encoded, batch=True, dtype=types.UINT8)
        labels_in = fn.external_source(source=lambda: labels, batch=True, dtype=types.INT64)
        images, _ = spec.function(images_in, labels_in, ctx, spec.resolve())
        pipe.set_outputs(images)
    pipe.build()
    (out,) = pipe.run()
    return np.asarray(out.as_array())


def pil_val(path_bytes: bytes, resize: int = 256, size: int = 224) -> np.ndarray:
    """Resize the shorter side with PIL's antialiased bilinear filter, centre crop, CHW."""
    import io

    image = Image.open(io.BytesIO(path_bytes)).convert("RGB")
    w, h = image.size
    scale = resize / min(w, h)
    image = image.resize((round(w * scale), round(h * scale)), Image.BILINEAR)
    w, h = image.size
    # DALI's centre crop anchors at (w - size) / 2 rounded half up.
    left, top = int((w - size) / 2 + 0.5), int((h - size) / 2 + 0.5)
    crop = np.asarray(image.crop((left, top, left + size, top + size)))
    return crop.transpose(2, 0, 1)


def test_val_over_grpc_equals_dali_in_process_byte_for_byte(photo_server) -> None:  # type: ignore[no-untyped-def]
    served, labels, encoded, stored_labels = served_and_stored(*photo_server)
    expected = in_process_val(encoded, stored_labels)  # type: ignore[arg-type]
    assert served.shape == (18, 3, 224, 224)
    assert np.array_equal(served.numpy(), expected)
    assert np.array_equal(labels.numpy(), stored_labels)


def test_val_matches_a_pil_resize_and_centre_crop(photo_server) -> None:  # type: ignore[no-untyped-def]
    served, _, encoded, _ = served_and_stored(*photo_server)
    for image, data in zip(served.numpy(), encoded, strict=True):
        reference = pil_val(bytes(data))  # type: ignore[arg-type]
        difference = np.abs(image.astype(np.int16) - reference.astype(np.int16))
        assert difference.mean() < 1.0, f"mean abs difference {difference.mean():.2f} levels"
        assert np.percentile(difference, 99) <= 12


def test_train_output_varies_with_the_seed_and_keeps_shape(server: BatchwireServer) -> None:
    """The same samples (no shuffling) under two seeds: other crops and flips; under one
    seed twice: the same."""
    options = {
        "dataset": "shapes",
        "pipeline": "train",
        "batch_size": 8,
        "shuffle": False,
        "normalize": False,
    }

    def first(seed: int) -> np.ndarray:
        with RemoteLoader(server.target, seed=seed, **options) as loader:  # type: ignore[arg-type]
            return next(iter(loader))[0].numpy()

    one, other, again = first(0), first(1), first(0)
    assert one.shape == other.shape == (8, 3, 224, 224)
    assert not np.array_equal(one, other), "another seed draws other crops and flips"
    assert np.array_equal(one, again)
