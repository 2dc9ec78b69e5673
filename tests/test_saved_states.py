"""Checkpoints written out literally, as loaders of earlier releases saved them, resume at
the place they name; and a loader saves its state in that layout still, key for key.

The dicts below are the layout of ``RemoteLoader.state_dict()`` (version 3: the place's
epoch, origin and cursor, the settings they count in, and the derived global position;
version 1, batchwire 0.1's, had no origin), over the package's ``MockTransport``."""

from __future__ import annotations

import hashlib

import pytest

from batchwire.client import InvalidArgumentError, RemoteLoader
from batchwire.client.testing import MockTransport
from batchwire.common.sampler import Plan

SAMPLES, BATCH = 52, 8  # 7 batches an epoch, the last one short
VERSION = hashlib.sha256(f"pets:{SAMPLES}".encode()).hexdigest()[:12]  # the mock's

# Rank 0 of 1, after 3 batches of epoch 1.
SAVED = {
    "version": 3,
    "dataset": "pets",
    "seed": 5,
    "shuffle": True,
    "drop_last": False,
    "batch_size": BATCH,
    "world_size": 1,
    "pipeline": "train",
    "rank": 0,
    "epoch": 1,
    "origin": 0,
    "cursor": 24,
    "position": 24,
    "dataset_version": VERSION,
}
# The same place as batchwire 0.1 saved it: no origin, no dataset version.
SAVED_BY_0_1 = {
    "version": 1,
    "dataset": "pets",
    "seed": 5,
    "shuffle": True,
    "drop_last": False,
    "batch_size": BATCH,
    "world_size": 1,
    "pipeline": "train",
    "rank": 0,
    "epoch": 1,
    "cursor": 24,
    "position": 24,
}


def loader(**kwargs: object) -> RemoteLoader:
    transport = MockTransport.serving("pets", SAMPLES, image_shape=(3, 4, 4))
    options: dict[str, object] = {
        "dataset": "pets",
        "batch_size": BATCH,
        "return_ids": True,
        "seed": 5,
        "transport": transport,
    }
    return RemoteLoader(["mock-a:1"], **{**options, **kwargs})  # type: ignore[arg-type]


def order(epoch: int, **share: int) -> list[int]:
    plan = Plan(
        num_samples=SAMPLES, batch_size=BATCH, seed=5, epoch=epoch, drop_last=False, **share
    )
    return plan.share().tolist()


def test_a_loader_saves_its_place_in_the_layout_checkpoints_have() -> None:
    with loader() as saving:
        saving.set_epoch(1)
        for _, _ in zip(range(3), saving, strict=False):
            pass
        assert saving.state_dict() == SAVED


@pytest.mark.parametrize("saved", [SAVED, SAVED_BY_0_1], ids=["version-3", "version-1"])
def test_a_checkpoint_written_out_literally_resumes_the_rest_of_its_epoch(
    saved: dict[str, object],
) -> None:
    with loader() as resumed:
        resumed.load_state_dict(dict(saved))
        assert resumed.epoch == 1
        assert {k: resumed.state_dict()[k] for k in ("epoch", "origin", "cursor")} == {
            "epoch": 1,
            "origin": 0,
            "cursor": 24,
        }
        rest = [i for _, _, ids in resumed for i in ids.tolist()]
        assert rest == order(1)[24:]
        assert resumed.state_dict()["epoch"] == 2  # the epoch ran to its end


def test_a_checkpoint_on_two_ranks_resumes_at_its_global_position_on_one() -> None:
    # Rank 1 of 2 after 2 steps of 8: 32 samples of epoch 0 consumed, all ranks together.
    saved = {**SAVED, "world_size": 2, "rank": 1, "epoch": 0, "cursor": 16, "position": 32}
    with loader() as resumed:
        resumed.load_state_dict(saved)
        rest = [i for _, _, ids in resumed for i in ids.tolist()]
    assert rest == order(0)[32:]


def test_a_checkpoint_of_another_dataset_version_is_refused() -> None:
    with loader() as resumed, pytest.raises(InvalidArgumentError, match="version"):
        resumed.load_state_dict({**SAVED, "dataset_version": "0" * 12})
