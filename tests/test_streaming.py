"""RemoteLoader against a real server on loopback: the order, sharding and resume contract."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from conftest import class_of
from processes import Target, in_trainer_process

from batchwire.client import RemoteLoader
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer
from batchwire.server.data import Manifest

SMALL = {"size": 32}  # train/val output 32x32: the contract does not need 224


def loader(server: BatchwireServer | Target, **kwargs: object) -> RemoteLoader:
    options: dict[str, object] = {
        "dataset": "shapes",
        "pipeline": "train",
        "batch_size": 32,
        "return_ids": True,
        "params": SMALL,
    }
    options.update(kwargs)
    return RemoteLoader(server.target, **options)  # type: ignore[arg-type]


def epoch_ids(remote: RemoteLoader) -> list[int]:
    return [int(i) for _, _, ids in remote for i in ids]


def test_two_ranks_deliver_every_id_exactly_once_with_the_right_labels(
    server: BatchwireServer, shapes_manifest: Manifest
) -> None:
    seen: list[int] = []
    for rank in range(2):
        with loader(server, rank=rank, world_size=2, drop_last=False, normalize=False) as remote:
            batches = list(remote)
            assert len(batches) == len(remote)
            for images, labels, ids in batches:
                assert images.dtype == torch.uint8
                assert tuple(images.shape[1:]) == (3, 32, 32)
                assert labels.dtype == ids.dtype == torch.int64
                assert np.array_equal(labels.numpy(), class_of(shapes_manifest, ids.numpy()))
                seen += ids.tolist()
    assert sorted(seen) == list(range(shapes_manifest.num_samples))


def test_every_rank_gets_the_same_number_of_full_batches(server: BatchwireServer) -> None:
    lengths = set()
    for rank in range(3):
        with loader(server, rank=rank, world_size=3, batch_size=50, drop_last=True) as remote:
            sizes = [len(ids) for _, _, ids in remote]
            assert sizes == [50] * len(remote)
            lengths.add(len(sizes))
    assert lengths == {520 // 3 // 50}


def test_order_depends_only_on_seed_and_epoch(server: BatchwireServer) -> None:
    first = epoch_ids(loader(server, seed=5, pipeline="val"))
    again = epoch_ids(loader(server, seed=5, pipeline="val", prefetch=1))
    assert first == again
    expected = Plan(num_samples=520, batch_size=32, seed=5, drop_last=False).share().tolist()
    assert first == expected
    other = loader(server, seed=5, pipeline="val")
    other.set_epoch(1)
    assert epoch_ids(other) != first
    assert epoch_ids(loader(server, seed=6, pipeline="val")) != first


def test_loader_moves_to_the_next_epoch_after_a_full_one(server: BatchwireServer) -> None:
    remote = loader(server, pipeline="val", batch_size=128)
    epoch0 = epoch_ids(remote)
    assert remote.epoch == 1
    epoch1 = epoch_ids(remote)
    assert (
        epoch1 == Plan(num_samples=520, batch_size=128, epoch=1, drop_last=False).share().tolist()
    )
    assert epoch0 != epoch1


@pytest.mark.parametrize("cut", [1, 4, 8])
def test_resume_from_state_dict_delivers_exactly_the_remainder(
    server: BatchwireServer, cut: int
) -> None:
    whole = epoch_ids(loader(server, seed=9, world_size=2, rank=1, drop_last=False))
    first = loader(server, seed=9, world_size=2, rank=1, drop_last=False, prefetch=3)
    head: list[int] = []
    for n, (_, _, ids) in enumerate(first):
        head += ids.tolist()
        if n + 1 == cut:
            break
    state = first.state_dict()
    first.close()
    second = loader(server, seed=9, world_size=2, rank=1, drop_last=False)
    second.load_state_dict(state)
    tail = epoch_ids(second)
    assert head + tail == whole
    assert len(head) == cut * 32


def test_set_epoch_after_load_state_dict_keeps_the_loaded_position(
    server: BatchwireServer,
) -> None:
    remote = loader(server, pipeline="val", seed=2)
    remote.set_epoch(3)
    iterator = iter(remote)
    head = next(iterator)[2].tolist()
    state = remote.state_dict()
    iterator.close()
    resumed = loader(server, pipeline="val", seed=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the usual `for epoch ...: loader.set_epoch(epoch)` after a resume
    rest = epoch_ids(resumed)
    assert (
        head + rest
        == Plan(num_samples=520, batch_size=32, seed=2, epoch=3, drop_last=False).share().tolist()
    )
    remote.set_epoch(3)  # no loaded state: the epoch starts again
    assert epoch_ids(remote)[:32] == head


def test_a_batch_of_512_at_224_streams(server: BatchwireServer) -> None:
    remote = RemoteLoader(
        server.target, dataset="shapes", pipeline="train", batch_size=512, normalize=False
    )
    images, labels = next(iter(remote))
    assert tuple(images.shape) == (512, 3, 224, 224)
    assert images.dtype == torch.uint8
    assert images.numel() > 4 * 1024 * 1024 * 18  # far over gRPC's 4 MB default
    assert len(labels) == 512
    remote.close()


def test_server_side_float_output_equals_client_normalization(server: BatchwireServer) -> None:
    common = {"pipeline": "val", "shuffle": False, "batch_size": 16}
    raw = next(iter(loader(server, normalize=False, **common)))[0]
    client_side = next(iter(loader(server, normalize=True, **common)))[0]
    server_side = next(iter(loader(server, dtype="float32", **common)))[0]
    half = next(iter(loader(server, dtype="float16", **common)))[0]
    nhwc = next(iter(loader(server, layout="NHWC", normalize=False, **common)))[0]
    assert client_side.dtype == server_side.dtype == torch.float32
    assert half.dtype == torch.float16
    assert torch.allclose(client_side, server_side, atol=1e-4)
    assert torch.allclose(half.float(), server_side, atol=2e-2)
    assert torch.equal(nhwc.permute(0, 3, 1, 2), raw)
    assert client_side.mean().abs() < 2.0


def test_dataloader_workers_keep_the_order(server: BatchwireServer) -> None:
    in_trainer_process(dataloader_workers_keep_the_order, Target(server.target))


def dataloader_workers_keep_the_order(server: Target) -> None:
    remote = loader(server, pipeline="val", seed=4)
    expected = Plan(num_samples=520, batch_size=32, seed=4, drop_last=False).share().tolist()
    data = torch.utils.data.DataLoader(remote, batch_size=None, num_workers=2)
    got = [int(i) for _, _, ids in data for i in ids]
    assert got == expected


def test_labels_are_balanced_over_classes(server: BatchwireServer) -> None:
    counts: collections.Counter[int] = collections.Counter()
    for _, labels, _ in loader(server, pipeline="val", batch_size=100, drop_last=False):
        counts.update(labels.tolist())
    assert counts == {0: 130, 1: 130, 2: 130, 3: 130}
