"""A pass over a transport with no network (``fake_transport``): what ``StreamPass`` asks
of its transport, and what it makes of the answers: batches in order, a server's failure
handed over to the other server, a refusal that ends the pass, a stop that cancels."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import numpy as np
import pytest
import torch

from batchwire.client import BatchwireError, InvalidArgumentError
from batchwire.client._delivery import LoaderOptions, Tensors
from batchwire.client._pass import StreamPass
from batchwire.client._servers import ServerSet
from batchwire.client._transport import Server, StatusCode, UnavailableError
from batchwire.client.testing import MockCall, MockTransport, batch_message
from batchwire.common.sampler import Plan
from batchwire.v1 import batchwire_pb2 as pb

BATCH = 4
A, B = "fake-a:1", "fake-b:1"


def message(index: int) -> bytes:
    """Batch ``index`` of the pass's plan (no shuffling): samples ``BATCH * index + j``,
    the share's cursor after it."""
    return batch_message(index, [BATCH * index + j for j in range(BATCH)], (index + 1) * BATCH)


def serve(call: MockCall) -> Iterator[bytes]:
    """A server that sends every batch it is asked for, in the order asked, and ends the
    call when the request stream ends."""
    for request in call.requests:
        for index in request.batches:
            yield message(index)


def new_pass(
    transport: MockTransport,
    addresses: list[str],
    num_batches: int,
    *,
    shared_memory: bool = False,
) -> StreamPass:
    options = LoaderOptions(
        device=torch.device("cpu"),
        normalize=False,
        prefetch=1,  # each server is asked for 3 batches at a time
        timeout=60,  # a hang guard
        retry_timeout=60,  # a hang guard
        shared_memory=shared_memory,
    )
    return StreamPass(
        plan=Plan(num_samples=num_batches * BATCH, batch_size=BATCH, shuffle=False),
        spec=pb.StreamBatchesRequest(dataset="fake", pipeline="val", batch_size=BATCH),
        transport=transport,
        tensors=Tensors(options, pb.PipelineInfo(name="val"), "NCHW"),
        servers=ServerSet(addresses),
        window=6,
    )


def take_all(stream_pass: StreamPass) -> list[tuple[int, list[int], int]]:
    """(index, ids, cursor) of each batch, taken in order; each sample's image holds its
    id (mod 256), as the mock server sent it."""
    taken = []
    for index in range(stream_pass.plan.num_batches):
        delivery = stream_pass.take(index)
        for image, sample in zip(delivery.images.numpy(), delivery.ids.tolist(), strict=True):
            assert (image == sample % 256).all(), (sample, np.unique(image))
        taken.append((delivery.index, delivery.ids.tolist(), delivery.cursor))
    return taken


def expected(num_batches: int) -> list[tuple[int, list[int], int]]:
    return [(k, [BATCH * k + j for j in range(BATCH)], (k + 1) * BATCH) for k in range(num_batches)]


def test_batches_arrive_in_order_with_their_ids_and_cursors() -> None:
    transport = MockTransport(serve)
    stream_pass = new_pass(transport, [A], 12, shared_memory=True)
    stream_pass.start_readers()
    try:
        assert take_all(stream_pass) == expected(12)
    finally:
        stream_pass.stop()
    (call,) = transport.calls
    first = call.read[0]
    assert first.stream.dataset == "fake" and first.stream.batch_size == BATCH
    # The pass offered shared memory; the mock takes none: the batches came in their
    # messages.
    assert call.options.shared_memory
    assert call.asked() == list(range(12))
    # A finished pass's call ends with its request stream, not with a cancel.
    assert call.ended.is_set() and not call.cancelled_while_open


def test_a_server_that_fails_mid_pass_hands_its_batches_to_the_other() -> None:
    a_failed = threading.Event()

    def serve_a_while(call: MockCall) -> Iterable[bytes]:
        """A sends 3 batches, then fails (holding the batches it was asked for next) and
        stays down; B serves once A failed, so that the pass cannot end without A's."""
        if call.server.address == B:
            a_failed.wait(60)  # a hang guard
            yield from serve(call)
            return
        if call is not transport.calls_to(A)[0]:
            raise UnavailableError(f"server {A} is unavailable")
        sent = 0
        for request in call.requests:
            for index in request.batches:
                if sent == 3:
                    a_failed.set()
                    raise UnavailableError(f"server {A} is draining")
                yield message(index)
                sent += 1

    transport = MockTransport(serve_a_while)
    stream_pass = new_pass(transport, [A, B], 16)
    stream_pass.start_readers()
    try:
        assert take_all(stream_pass) == expected(16)
    finally:
        stream_pass.stop()
    a = stream_pass.pullers[Server(A)]
    assert a.delivered == 3
    first_to_a = transport.calls_to(A)[0]
    # What A was asked for and did not deliver went to B.
    left_by_a = set(first_to_a.asked()[3:])
    assert left_by_a, "A held no batch when it failed"
    assert left_by_a <= {i for call in transport.calls_to(B) for i in call.asked()}


def test_a_refusal_no_server_can_fix_ends_the_pass_with_its_error() -> None:
    refusal = InvalidArgumentError("the dataset has no sample 7", code=StatusCode.OUT_OF_RANGE)

    def serve_then_refuse(call: MockCall) -> Iterable[bytes]:
        for request in call.requests:
            for index in request.batches:
                if index == 2:
                    raise refusal
                yield message(index)

    transport = MockTransport(serve_then_refuse)
    stream_pass = new_pass(transport, [A], 8)
    stream_pass.start_readers()
    try:
        assert [stream_pass.take(k).index for k in (0, 1)] == [0, 1]
        with pytest.raises(InvalidArgumentError) as raised:
            stream_pass.take(2)
    finally:
        stream_pass.stop()
    assert raised.value is refusal
    assert len(transport.calls) == 1, "a refusal was retried"


def test_a_stopped_pass_cancels_its_open_calls() -> None:
    sent = threading.Semaphore(0)

    def stall(call: MockCall) -> Iterable[bytes]:
        """Send the first batch asked for, then nothing more until cancelled."""
        yield message(next(call.requests).batches[0])
        sent.release()
        call.cancelled.wait(60)  # a hang guard

    transport = MockTransport(stall)
    stream_pass = new_pass(transport, [A, B], 8)
    stream_pass.start_readers()
    assert sent.acquire(timeout=60) and sent.acquire(timeout=60)  # both calls are open
    assert stream_pass.take(0).index == 0
    stream_pass.stop()
    assert {call.server.address for call in transport.calls} == {A, B}
    assert all(call.cancelled_while_open for call in transport.calls)
    assert not any(puller.is_alive() for puller in stream_pass.pullers.values())
    for call in transport.calls:
        call.join()
        assert call.ended.is_set()
    with pytest.raises(BatchwireError) as raised:
        stream_pass.take(1)
    assert raised.value.code == StatusCode.CANCELLED
