"""A batch's augmentation is a function of the stream's seed, its epoch and the batch's
samples: every preset gives the same bytes over the messages, shared memory and the bulk
connection, a pass of one epoch draws the same each time (also resumed mid-epoch, and with
its batches shared by two servers), and another epoch draws anew. Real servers, real DALI
on the CPU, real LMDB datasets of generated COCO files."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import ingest_coco, start_server

from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer
from batchwire.server.data import write_coco_boxes
from batchwire.server.runners._dali import random_states_fed

pytestmark = pytest.mark.skipif(
    not random_states_fed(), reason="this DALI draws from its operators' own seeds"
)

IMAGES = 24
BATCH = 8
# Each preset, the dataset it runs on and small outputs.
PRESETS: dict[str, tuple[str, dict[str, float]]] = {
    "train": ("boxes", {"size": 32}),
    "multicrop": ("boxes", {"global_size": 32, "local_size": 16}),
    "detection": ("boxes", {"size": 48}),
    "segmentation": ("masked", {"size": 32}),
    "captions": ("captions", {"size": 32, "resize": 40}),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    coco = write_coco_boxes(tmp_path_factory.mktemp("coco"), count=IMAGES, seed=7)
    return ingest_coco(coco, tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def servers(data_dir: pathlib.Path) -> Iterator[list[BatchwireServer]]:
    started = [start_server(data_dir), start_server(data_dir)]
    yield started
    for server in started:
        server.stop(grace=1.0)


def loader(targets: str | list[str], preset: str, **kwargs: Any) -> RemoteLoader:
    dataset, params = PRESETS[preset]
    options: dict[str, Any] = {
        "dataset": dataset,
        "pipeline": preset,
        "batch_size": BATCH,
        "params": params,
        "return_ids": True,
        "normalize": False,
        "seed": 11,
    }
    return RemoteLoader(targets, **{**options, **kwargs})


def epoch(targets: str | list[str], preset: str, **kwargs: Any) -> list[Any]:
    with loader(targets, preset, **kwargs) as batches:
        return list(batches)


def same(a: Any, b: Any) -> bool:
    """Whether two batches as a loader yields them hold the same values, whatever their
    form (tensors, lists of views or targets, dicts, captions)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_is_byte_identical_over_every_transport(
    servers: list[BatchwireServer], preset: str
) -> None:
    target = servers[0].target
    messages = epoch(target, preset, shared_memory=False, bulk=False)
    shared = epoch(target, preset)
    bulk = epoch(target, preset, shared_memory=False)
    assert len(messages) == IMAGES // BATCH
    for a, b, c in zip(messages, shared, bulk, strict=True):
        assert same(a, b) and same(a, c)


def _by_sample(batches: list[Any]) -> dict[int, Any]:
    """multicrop's views of each sample, by its id."""
    return {
        int(i): [view[n] for view in views]
        for views, _, ids in batches
        for n, i in enumerate(ids.tolist())
    }


def test_a_pass_of_one_seed_and_epoch_draws_the_same_and_another_epoch_anew(
    servers: list[BatchwireServer],
) -> None:
    """multicrop's ten views: the same from two passes of epoch 0 and from a pass whose
    batches two servers share; each sample's views differ from one another, and from its
    views in epoch 1."""
    target = servers[0].target
    first = epoch(target, "multicrop")
    again = epoch(target, "multicrop")
    shared = epoch([s.target for s in servers], "multicrop")
    assert same(first, again) and same(first, shared)
    with loader(target, "multicrop") as twice:
        list(twice)  # epoch 0
        second = list(twice)  # epoch 1
    views, later = _by_sample(first), _by_sample(second)
    assert sorted(views) == sorted(later) == list(range(IMAGES))
    for sample, drawn in views.items():
        assert not torch.equal(drawn[0], drawn[1])  # two global views of one image
        assert not any(torch.equal(x, y) for x, y in zip(drawn, later[sample], strict=True))


@pytest.mark.parametrize("preset", ["multicrop", "detection"])
def test_a_resumed_pass_draws_what_the_whole_pass_drew(
    servers: list[BatchwireServer], preset: str
) -> None:
    target = servers[0].target
    whole = epoch(target, preset)
    head = loader(target, preset)
    taken = [batch for _, batch in zip(range(2), head, strict=False)]
    state = head.state_dict()
    head.close()
    resumed = loader(target, preset)
    resumed.load_state_dict(state)
    rest = list(resumed)
    resumed.close()
    assert same(whole, taken + rest)


def test_batches_whose_outputs_vary_in_size_all_travel_in_shared_memory(
    servers: list[BatchwireServer],
) -> None:
    """detection's boxes make each batch's payload a little larger or smaller than its
    pass's first, which sized the stream's shared memory: every batch still goes there,
    its message only the header (a batch in its message would hold 55 KB), in every
    epoch."""
    server = servers[0]
    labels = {"dataset": "boxes", "pipeline": "detection"}

    def sent() -> tuple[float, float, float]:
        value = server.metrics.registry.get_sample_value
        return tuple(  # type: ignore[return-value]
            value(f"batchwire_{name}_total", labels) or 0.0
            for name in ("batches_sent", "bytes_sent", "shared_memory_bytes")
        )

    before, boxes = sent(), set()
    with loader(server.target, "detection") as passes:
        for _ in range(4):  # epochs 0 to 3: a call, and a ring, each
            for _, targets, _ in passes:
                boxes.add(sum(len(target["boxes"]) for target in targets))
        received = passes.transfer.received
    batches, in_messages, shared = (after - was for after, was in zip(sent(), before, strict=True))
    assert len(boxes) > 1  # batches of several sizes
    assert batches >= 4 * IMAGES // BATCH
    assert in_messages < 4096 * batches  # headers only
    assert shared >= received > 0  # (and what a pass looking ahead sent before the close)
