"""A user's training code tested without a server: ``RemoteLoader`` over the package's
``MockTransport``, as a user's own tests would use it. The loop trains a small model on
two epochs, each sample once an epoch in its seed's order; a checkpoint taken mid-epoch
resumes exactly the rest in a new loader; two ranks split an epoch; a mock server that
fails hands its batches to the other; a dataset it lacks is NOT_FOUND."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest
import torch

from batchwire.client import (
    BatchwireError,
    NotFoundError,
    RemoteLoader,
    StatusCode,
    UnavailableError,
)
from batchwire.client.testing import MockCall, MockTransport, batch_message
from batchwire.common.sampler import Plan
from batchwire.v1 import batchwire_pb2 as pb

SAMPLES, BATCH = 52, 8  # 7 batches an epoch, the last one short
CLASSES = ("cat", "dog", "fish")


def train(loader: RemoteLoader, epochs: int) -> list[list[int]]:
    """A user's loop: a linear classifier over the images, one optimizer step a batch;
    the ids each epoch saw."""
    model = torch.nn.Linear(3 * 4 * 4, len(CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        ids: list[int] = []
        for images, labels, batch_ids in loader:
            loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            assert torch.isfinite(loss)
            ids += batch_ids.tolist()
        seen.append(ids)
    return seen


def mock() -> MockTransport:
    return MockTransport.serving("pets", SAMPLES, classes=CLASSES, image_shape=(3, 4, 4))


def loader(transport: MockTransport, **kwargs: object) -> RemoteLoader:
    options: dict[str, object] = {
        "dataset": "pets",
        "batch_size": BATCH,
        "return_ids": True,
        "seed": 5,
        "transport": transport,
    }
    return RemoteLoader(["mock-a:1", "mock-b:1"], **{**options, **kwargs})  # type: ignore[arg-type]


def order(epoch: int, **share: int) -> list[int]:
    plan = Plan(
        num_samples=SAMPLES, batch_size=BATCH, seed=5, epoch=epoch, drop_last=False, **share
    )
    return plan.share().tolist()


def test_a_training_loop_gets_every_sample_once_an_epoch_in_its_seeds_order() -> None:
    transport = mock()
    with loader(transport) as batches:
        assert len(batches) == 7 and list(batches.classes) == list(CLASSES)
        assert train(batches, 2) == [order(0), order(1)]
    assert {call.server.address for call in transport.calls} == {"mock-a:1", "mock-b:1"}


def test_the_mocks_images_and_labels_are_the_samples() -> None:
    with loader(mock(), normalize=False) as batches:
        images, labels, ids = next(iter(batches))
    assert images.dtype == torch.uint8 and images.shape == (BATCH, 3, 4, 4)
    assert torch.equal(images[:, 0, 0, 0], (ids % 256).to(torch.uint8))
    assert torch.equal(labels, ids % len(CLASSES))


def test_a_checkpoint_taken_mid_epoch_resumes_the_rest_in_a_new_loader() -> None:
    with loader(mock()) as first:
        taken = [ids for _, (_, _, ids) in zip(range(3), first, strict=False)]
        state = first.state_dict()
    with loader(mock()) as resumed:
        resumed.load_state_dict(state)
        rest = [ids for _, _, ids in resumed]
    assert [i for ids in taken + rest for i in ids.tolist()] == order(0)


def test_two_ranks_split_an_epoch() -> None:
    shares = []
    for rank in range(2):
        with loader(mock(), rank=rank, world_size=2) as batches:
            shares.append([i for _, _, ids in batches for i in ids.tolist()])
            assert shares[-1] == order(0, rank=rank, world_size=2)
    assert not set(shares[0]) & set(shares[1])
    assert set(shares[0]) | set(shares[1]) == set(range(SAMPLES))


def test_a_failing_mock_server_hands_its_batches_to_the_other() -> None:
    served = mock().handler

    def one_fails(call: MockCall) -> Iterable[bytes]:
        if call.server.address == "mock-a:1":
            raise UnavailableError("mock-a:1 is down")
        yield from served(call)

    transport = MockTransport(one_fails, mock().datasets)
    with loader(transport, retry_timeout=30) as batches:
        assert [i for _, _, ids in batches for i in ids.tolist()] == order(0)
    assert transport.calls_to("mock-b:1")


def test_a_dataset_the_mock_lacks_is_not_found() -> None:
    with pytest.raises(NotFoundError) as raised:
        len(loader(mock(), dataset="birds"))
    assert raised.value.code == StatusCode.NOT_FOUND and "birds" in str(raised.value)


def test_batch_message_is_a_batch_as_a_server_sends_it() -> None:
    """A handler of one's own can answer with ``batch_message``: a request for a batch
    the share lacks is the user's to refuse."""

    def fixed(call: MockCall) -> Iterable[bytes]:
        for request in call.requests:
            for index in request.batches:
                end = min(SAMPLES, BATCH * (index + 1))
                ids = list(range(BATCH * index, end))
                yield batch_message(index, ids, end, classes=len(CLASSES))

    transport = MockTransport(fixed, mock().datasets)
    with loader(transport, shuffle=False) as batches:
        assert [i for _, _, ids in batches for i in ids.tolist()] == list(range(SAMPLES))


def test_a_server_that_sends_samples_not_of_the_batch_ends_the_pass() -> None:
    """A server that serves another stream (here: every batch's ids shifted by one from
    the third batch on) is not trained on: the pass ends INTERNAL, naming a bad batch, and
    the state is still the place after the last batch that was the plan's."""
    served = mock().handler

    def shifted(call: MockCall) -> Iterable[bytes]:
        for raw in served(call):
            batch = pb.Batch.FromString(raw)  # images and all: a small batch
            if batch.index >= 2:
                batch.ids[:] = [i + 1 for i in batch.ids]
            yield batch.SerializeToString()

    transport = MockTransport(shifted, mock().datasets)
    # One server: its batches arrive in order, the good ones before the first bad one.
    with RemoteLoader(
        "mock-a:1", dataset="pets", batch_size=BATCH, return_ids=True, seed=5, transport=transport
    ) as batches:
        taken = []
        with pytest.raises(BatchwireError) as raised:
            for _, _, ids in batches:
                taken += ids.tolist()
        state = batches.state_dict()
    named = re.search(r"sent batch (\d+) with samples", str(raised.value))
    assert raised.value.code == StatusCode.INTERNAL and named and int(named[1]) >= 2
    assert taken == order(0)[: 2 * BATCH] and state["cursor"] == 2 * BATCH
