"""Pipelines that take a sample's fields, against a real server and real LMDB datasets made
from generated COCO files: ``detection`` crops, resizes and flips images and boxes
together, ``captions`` keeps each caption with its image, a pipeline is refused for a
dataset without its fields, and a sample whose field is malformed is skipped and
reported."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import lmdb
import numpy as np
import pytest
import torch
from conftest import ingest_coco, start_server
from test_outputs import head_and_rest

from batchwire.client import InvalidArgumentError, Mixture, RemoteLoader
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer
from batchwire.server.data import (
    BACKGROUND,
    BOX_COLOURS,
    Dataset,
    IngestError,
    Manifest,
    encode_fields,
    ingest,
    sample_key,
    write_coco_boxes,
    write_image_folders,
)
from batchwire.v1 import datum_pb2

IMAGES = 48
PLAIN = 24  # samples of "plain": 4 classes of images without fields
BATCH = 8
SIZE = 96  # the detection pipeline's output side


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``boxes`` (COCO instances: boxes and classes), ``masked`` (the same, with masks) and
    ``captions`` (COCO captions) of the same 48 generated pictures, and ``plain``, images of
    classes without fields."""
    coco = write_coco_boxes(tmp_path_factory.mktemp("coco"), count=IMAGES, seed=5)
    root = ingest_coco(coco, tmp_path_factory.mktemp("data"), shard_size=16)
    plain = tmp_path_factory.mktemp("plain")
    write_image_folders(plain, per_class=PLAIN // 4, size=48, seed=1)
    ingest(plain, root, name="plain")
    return root


@pytest.fixture(scope="module")
def server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    server = start_server(data_dir)
    yield server
    server.stop(grace=1.0)


def detection(server: BatchwireServer, **kwargs: Any) -> RemoteLoader:
    options: dict[str, Any] = {
        "dataset": "boxes",
        "pipeline": "detection",
        "batch_size": BATCH,
        "return_ids": True,
        "normalize": False,
        "params": {"size": SIZE},
        "seed": 2,
    }
    return RemoteLoader(server.target, **{**options, **kwargs})


def colours(manifest: Manifest) -> list[np.ndarray]:
    """The colour of each class (by label): COCO's categories in id order."""
    ids = sorted(BOX_COLOURS)
    assert manifest.classes == tuple(BOX_COLOURS[i][0] for i in ids)
    return [np.array(BOX_COLOURS[i][1], dtype=np.float32) for i in ids]


def test_detection_keeps_every_box_over_its_colour_through_crop_resize_and_flip(
    server: BatchwireServer, data_dir: pathlib.Path
) -> None:
    """Two epochs: each sample's image (uint8, SIZE square) and a target as torchvision's
    detection models take them; under every box that is still a few pixels wide, the
    pixels are its class's colour; every sample once, in the epoch's order."""
    colour_of = colours(Manifest.load(data_dir / "boxes"))
    checked = 0
    with detection(server) as loader:
        for epoch in range(2):
            ids: list[int] = []
            for images, targets, batch_ids in loader:
                assert images.dtype == torch.uint8
                assert images.shape == (len(batch_ids), 3, SIZE, SIZE)
                assert isinstance(targets, list) and len(targets) == len(batch_ids)
                for image, target in zip(images, targets, strict=True):
                    boxes, labels = target["boxes"], target["labels"]
                    assert boxes.dtype == torch.float32 and labels.dtype == torch.int64
                    assert boxes.shape == (len(labels), 4)
                    assert ((boxes >= 0) & (boxes <= SIZE)).all()
                    for (left, top, right, bottom), label in zip(
                        boxes.tolist(), labels.tolist(), strict=True
                    ):
                        # Inside the box, away from its edges (resizing blends them).
                        x0, y0, x1, y1 = (
                            int(left) + 2,
                            int(top) + 2,
                            int(right) - 2,
                            int(bottom) - 2,
                        )
                        if x1 - x0 < 2 or y1 - y0 < 2:
                            continue
                        under = image[:, y0:y1, x0:x1].float().mean(dim=(1, 2)).numpy()
                        assert np.abs(under - colour_of[label]).max() < 25, (under, label)
                        checked += 1
                ids += batch_ids.tolist()
            plan = Plan(num_samples=IMAGES, batch_size=BATCH, seed=2, epoch=epoch, drop_last=False)
            assert ids == plan.share().tolist()
    assert checked > IMAGES  # most images keep a box or more


def test_a_detection_state_resumes_exactly_the_rest(server: BatchwireServer) -> None:
    plan = Plan(num_samples=IMAGES, batch_size=BATCH, seed=2, drop_last=False)
    assert head_and_rest(lambda: detection(server), 2) == plan.share().tolist()


def test_a_torchvision_detection_model_trains_a_step_on_a_served_batch(
    server: BatchwireServer,
) -> None:
    detection_models = pytest.importorskip(
        "torchvision.models.detection", reason="torchvision is not installed"
    )
    model = detection_models.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=len(BOX_COLOURS) + 1
    )
    model.train()
    with detection(server, return_ids=False) as loader:
        images, targets = next(iter(loader))
    # torchvision's models normalize 0..1 images themselves; their labels start at 1.
    targets = [{"boxes": t["boxes"], "labels": t["labels"] + 1} for t in targets]
    losses = model(list(images.float() / 255), targets)
    loss = sum(losses.values())
    loss.backward()
    assert torch.isfinite(loss)


def test_captions_come_with_their_images(server: BatchwireServer, data_dir: pathlib.Path) -> None:
    """Each sample's caption (or its two) as ingested, beside its image."""
    with Dataset(data_dir / "captions") as dataset:
        stored = {i: f["caption"] for i, f in enumerate(dataset.fields(range(IMAGES)))}
    seen = 0
    with RemoteLoader(
        server.target,
        dataset="captions",
        pipeline="captions",
        batch_size=BATCH,
        return_ids=True,
        params={"size": 32, "resize": 40},
    ) as loader:
        for images, captions, ids in loader:
            assert images.shape == (len(ids), 3, 32, 32) and images.dtype == torch.float32
            for caption, sample in zip(captions, ids.tolist(), strict=True):
                want = stored[sample]  # a caption, or a tuple of them
                texts = list(want) if isinstance(want, tuple) else [want]
                assert caption == (texts[0] if len(texts) == 1 else texts)
                seen += 1
    assert seen == IMAGES
    assert any(isinstance(c, tuple) and len(c) == 2 for c in stored.values())  # some have two


def test_a_pipeline_is_refused_for_a_dataset_without_its_fields(
    server: BatchwireServer,
) -> None:
    with (
        detection(server, dataset="captions") as loader,
        pytest.raises(InvalidArgumentError, match=r"'boxes'.*'captions'.*caption \(text\)"),
    ):
        next(iter(loader))


def test_a_sample_whose_fields_are_malformed_is_skipped_and_reported(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Sample 5's boxes are stored as text, sample 9's fields are bytes that are no
    Fields message: both are skipped and reported, the rest of the epoch comes."""
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    dataset = copy / "boxes"
    manifest = Manifest.load(dataset)
    env = lmdb.open(str(dataset / manifest.shards[0].path), lock=False)
    with env.begin(write=True) as txn:
        datum = datum_pb2.Datum.FromString(txn.get(sample_key(5)))
        datum.fields.CopyFrom(
            encode_fields({"boxes": ("text", "four numbers"), "labels": ("int", [0])})
        )
        txn.put(sample_key(5), datum.SerializeToString())
        raw = txn.get(sample_key(9))
        damaged = datum_pb2.Datum.FromString(raw)
        damaged.ClearField("fields")
        # Field 100 (fields) holding bytes that do not parse as a Fields message.
        txn.put(sample_key(9), damaged.SerializeToString() + b"\xa2\x06\x03\xff\xff\xff")
    env.close()
    server = start_server(copy)
    try:
        with detection(server, shuffle=False) as loader:
            ids = [i for _, _, batch in loader for i in batch.tolist()]
            skipped = sorted(loader.skipped_ids)
    finally:
        server.stop(grace=1.0)
    assert skipped == [5, 9]
    assert ids == [i for i in range(IMAGES) if i not in (5, 9)]


def test_a_mixture_of_a_classification_and_a_detection_source(server: BatchwireServer) -> None:
    """Per-source batches: those of ``boxes`` through detection (images and targets),
    those of ``plain`` through val (images and labels); each sample of both once an epoch."""
    mixture = Mixture(
        counts={"boxes": IMAGES, "plain": PLAIN},
        batching="per_source",
        per_source={"plain": {"pipeline": "val", "params": {"size": 32}}},
    )
    seen: dict[int, list[int]] = {0: [], 1: []}
    with detection(server, dataset=mixture) as loader:
        for images, second, ids in loader:
            sources, local = loader.split_ids(ids)
            source = int(sources[0])
            assert (sources == source).all()
            if source == 0:
                assert images.shape[2:] == (SIZE, SIZE)
                assert isinstance(second, list) and all("boxes" in t for t in second)
            else:
                assert images.shape[2:] == (32, 32) and second.dtype == torch.int64
            seen[source] += local.tolist()
    assert sorted(seen[0]) == list(range(IMAGES)) and sorted(seen[1]) == list(range(PLAIN))


def test_masks_follow_their_images_pixel_for_pixel(
    server: BatchwireServer, data_dir: pathlib.Path
) -> None:
    """segmentation crops, resizes and flips each image and its mask together: inside
    every region of one colour (away from its edges, which resizing blends), the mask is
    1 + the class of that colour, and 0 on the grey background."""
    colour_of = colours(Manifest.load(data_dir / "masked"))
    checked = 0
    with RemoteLoader(
        server.target,
        dataset="masked",
        pipeline="segmentation",
        batch_size=BATCH,
        normalize=False,
        params={"size": 64},
        seed=4,
    ) as loader:
        for images, masks in loader:
            assert images.shape == (len(masks), 3, 64, 64) and masks.shape == (len(masks), 64, 64)
            assert masks.dtype == torch.int64
            for image, mask in zip(images.numpy(), masks.numpy(), strict=True):
                pixels = image.transpose(1, 2, 0).astype(np.float32)
                expected = np.full(mask.shape, -1)
                for label, colour in enumerate([np.array(BACKGROUND, np.float32), *colour_of]):
                    expected[np.abs(pixels - colour).max(axis=2) < 8] = label
                # Pixels whose 3x3 neighbourhood is of one class in the mask: not an edge.
                padded = np.pad(mask, 1, mode="edge")
                uniform = np.ones(mask.shape, bool)
                for dy in range(3):
                    for dx in range(3):
                        uniform &= padded[dy : dy + 64, dx : dx + 64] == mask
                inside = uniform & (expected >= 0)
                assert (mask[inside] == expected[inside]).mean() > 0.99
                checked += int(inside.sum())
    assert checked > IMAGES * 64 * 64 // 2


def test_ingest_masks_only_from_coco_instances(tmp_path: pathlib.Path) -> None:
    plain = tmp_path / "plain"
    write_image_folders(plain, per_class=2, size=32, seed=1)
    with pytest.raises(IngestError, match="--masks is for COCO"):
        ingest(plain, tmp_path / "out", name="x", masks=True)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["detection", "segmentation", "multicrop"])
def test_the_presets_of_several_outputs_on_the_gpu(data_dir: pathlib.Path, pipeline: str) -> None:
    """The same graphs with the GPU decoder and ops (their boxes, masks and crop windows
    on the CPU beside them): every sample, each output at its declared shape."""
    server = start_server(data_dir, device="gpu")
    dataset = {"detection": "boxes", "segmentation": "masked", "multicrop": "boxes"}[pipeline]
    params = {"multicrop": {"global_size": 64, "local_size": 32}}.get(pipeline, {"size": SIZE})
    try:
        with RemoteLoader(
            server.target,
            dataset=dataset,
            pipeline=pipeline,
            batch_size=BATCH,
            normalize=False,
            params=params,
        ) as loader:
            batches = list(loader)
    finally:
        server.stop(grace=1.0)
    assert sum(len(second) for _, second in batches) == IMAGES
    first, second = batches[0]
    if pipeline == "multicrop":
        assert [tuple(v.shape[1:]) for v in first] == [(3, 64, 64)] * 2 + [(3, 32, 32)] * 8
    elif pipeline == "detection":
        assert first.shape[1:] == (3, SIZE, SIZE) and "boxes" in second[0]
    else:
        assert first.shape[1:] == (3, SIZE, SIZE) and second.shape[1:] == (SIZE, SIZE)
