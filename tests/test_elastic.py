"""Elastic resume against a real server: a state saved by a job of one world size resumes
the epoch at the same global position on another (the client guide: Elastic resume).

Ranks are loaders with an explicit rank and world size, iterated in lockstep as DDP
iterates them: global step k is the k-th batch of every rank.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from batchwire.client import BatchwireError, InvalidArgumentError, RemoteLoader
from batchwire.common.sampler import epoch_order
from batchwire.server import BatchwireServer
from batchwire.v1 import batchwire_pb2 as pb

SAMPLES, SEED, EPOCH = 520, 5, 1


OPTIONS: dict[str, object] = {
    "dataset": "shapes",
    "pipeline": "val",
    "return_ids": True,
    "params": {"size": 32},
    "seed": SEED,
    # Full global steps, whose resume on another world the rest of the file checks; the
    # tests of drop_last=False say so.
    "drop_last": True,
}


def make(server: BatchwireServer, **kwargs: object) -> RemoteLoader:
    return RemoteLoader(server.target, **{**OPTIONS, **kwargs})  # type: ignore[arg-type]


def job(server: BatchwireServer, world: int, **kwargs: object) -> list[RemoteLoader]:
    return [make(server, rank=rank, world_size=world, **kwargs) for rank in range(world)]


def steps(loaders: list[RemoteLoader], count: int | None = None) -> list[list[int]]:
    """``count`` global steps (all that are left if None): each the ids of every rank's
    batch of that step. Every rank must have as many batches as the others."""
    iterators = [iter(loader) for loader in loaders]
    taken: list[list[int]] = []
    while count is None or len(taken) < count:
        batches = [next(iterator, None) for iterator in iterators]
        if all(batch is None for batch in batches):
            break
        assert None not in batches, f"ranks ran out of batches at different steps {batches}"
        taken.append([int(i) for batch in batches for i in batch[2]])  # type: ignore[index]
    return taken


def interrupted(
    server: BatchwireServer, world: int, count: int, **kwargs: object
) -> tuple[list[list[int]], dict[str, Any]]:
    """``count`` steps of ``world`` ranks in epoch EPOCH, and rank 0's state after them
    (every rank's state has the same global position)."""
    loaders = job(server, world, **kwargs)
    for loader in loaders:
        loader.set_epoch(EPOCH)
    head = steps(loaders, count)
    states = [loader.state_dict() for loader in loaders]
    assert {state["position"] for state in states} == {sum(map(len, head))}
    for loader in loaders:
        loader.close()
    return head, states[0]


def resumed(
    server: BatchwireServer, world: int, state: dict[str, Any], **kwargs: object
) -> list[list[int]]:
    loaders = job(server, world, **kwargs)
    for loader in loaders:
        loader.load_state_dict(state)
        loader.set_epoch(EPOCH)  # the usual loop after a resume keeps the loaded position
    tail = steps(loaders)
    for loader in loaders:
        loader.close()
    return tail


@pytest.mark.parametrize("new_world", [1, 3, 4])
def test_two_ranks_resumed_on_another_world_size_deliver_the_epoch_once(
    server: BatchwireServer, new_world: int
) -> None:
    """drop_last=False: every sample once, but the wrap-around padding (fewer repeats
    than the new world size); each new rank gets the same number of batches."""
    head, state = interrupted(server, 2, 3, batch_size=40, drop_last=False)
    assert (state["world_size"], state["cursor"], state["position"]) == (2, 120, 240)
    tail = resumed(server, new_world, state, batch_size=40, drop_last=False)
    counts = collections.Counter(i for step in head + tail for i in step)
    assert set(counts) == set(range(SAMPLES))
    repeats = sum(counts.values()) - SAMPLES
    assert repeats == -(280 // -new_world) * new_world - 280 < new_world
    order = epoch_order(SEED, EPOCH, SAMPLES).tolist()
    assert sorted(i for step in head for i in step) == sorted(order[:240])


def test_views_resume_on_another_world_size_as_images_do(server: BatchwireServer) -> None:
    """multicrop (ten views a sample) saved on two ranks resumes on three: every sample of
    the epoch once but the padding, as for one output."""
    views = {"pipeline": "multicrop", "params": {"global_size": 24, "local_size": 16}}
    head, state = interrupted(server, 2, 3, batch_size=40, drop_last=False, **views)
    tail = resumed(server, 3, state, batch_size=40, drop_last=False, **views)
    counts = collections.Counter(i for step in head + tail for i in step)
    assert set(counts) == set(range(SAMPLES))
    assert sum(counts.values()) - SAMPLES < 3


@pytest.mark.parametrize("new_world", [1, 3, 4])
def test_with_drop_last_the_rest_drops_only_its_tail_smaller_than_a_global_batch(
    server: BatchwireServer, new_world: int
) -> None:
    head, state = interrupted(server, 2, 2, batch_size=40)
    tail = resumed(server, new_world, state, batch_size=40)
    order = epoch_order(SEED, EPOCH, SAMPLES).tolist()
    kept = (SAMPLES - 160) // (new_world * 40) * new_world * 40  # full global steps of the rest
    delivered = [i for step in head + tail for i in step]
    assert len(delivered) == len(set(delivered))
    assert sorted(delivered) == sorted(order[: 160 + kept])


def test_a_rest_without_a_full_global_batch_or_an_epoch_over_resume_the_next_epoch(
    server: BatchwireServer,
) -> None:
    """drop_last: 120 samples left are no global batch of 4 ranks of 40; a state at the end
    of a 2-rank epoch (which dropped its last 40) is the next epoch on 1 rank too."""
    _, state = interrupted(server, 2, 5, batch_size=40)
    next_epoch = epoch_order(SEED, EPOCH + 1, SAMPLES).tolist()
    tail = resumed(server, 4, {**state, "epoch": EPOCH}, batch_size=40)
    assert sorted(i for step in tail for i in step) == sorted(next_epoch[: 3 * 160])
    at_end = {**state, "cursor": 240, "position": 480}
    loader = make(server, batch_size=40)
    loader.load_state_dict(at_end)
    assert [i for step in steps([loader]) for i in step] == next_epoch[: 13 * 40]
    loader.close()


@pytest.mark.parametrize(("new_world", "new_batch"), [(1, 40), (4, 10), (2, 20)])
def test_with_world_times_batch_held_the_global_batches_are_the_undisturbed_ones(
    server: BatchwireServer, new_world: int, new_batch: int
) -> None:
    undisturbed = job(server, 2, batch_size=20)
    for loader in undisturbed:
        loader.set_epoch(EPOCH)
    whole = steps(undisturbed)
    _, state = interrupted(server, 2, 5, batch_size=20)
    tail = resumed(server, new_world, state, batch_size=new_batch, elastic_batch_size=True)
    assert [sorted(step) for step in tail] == [sorted(step) for step in whole[5:]]


def test_another_batch_size_is_refused_unless_the_loader_opts_in(
    server: BatchwireServer,
) -> None:
    _, state = interrupted(server, 2, 1, batch_size=20)
    with pytest.raises(InvalidArgumentError, match="elastic_batch_size=True"):
        make(server, batch_size=40).load_state_dict(state)


def test_a_state_of_the_previous_release_still_loads(server: BatchwireServer) -> None:
    """The format batchwire wrote before elastic resume: no origin, no position."""
    loader = make(server, batch_size=40, rank=1, world_size=2)
    state = {
        "version": 2,
        "dataset": "shapes",
        "batch_size": 40,
        "seed": SEED,
        "shuffle": True,
        "drop_last": True,
        "world_size": 2,
        "pipeline": "val",
        "rank": 0,
        "epoch": EPOCH,
        "cursor": 80,
    }
    loader.load_state_dict(state)
    ids = [i for step in steps([loader]) for i in step]
    assert ids == epoch_order(SEED, EPOCH, SAMPLES)[1::2][80:240].tolist()
    # ... and on a job of another world size, at its global position 2 · 80.
    tail = resumed(server, 4, state, batch_size=40)
    assert sorted(i for step in tail for i in step) == sorted(
        epoch_order(SEED, EPOCH, SAMPLES)[160:480].tolist()
    )


def test_a_state_resumed_on_another_world_saves_its_own_position(
    server: BatchwireServer,
) -> None:
    """A job resumed on 3 ranks, interrupted again and resumed on 2: still every sample
    of the epoch once (drop_last=False: padding only at the very end)."""
    head, state = interrupted(server, 2, 2, batch_size=40, drop_last=False)
    loaders = job(server, 3, batch_size=40, drop_last=False)
    for loader in loaders:
        loader.load_state_dict(state)
    middle = steps(loaders, 1)
    again = loaders[0].state_dict()
    for loader in loaders:
        loader.close()
    assert (again["origin"], again["cursor"], again["position"]) == (160, 40, 280)
    tail = resumed(server, 2, again, batch_size=40, drop_last=False)
    counts = collections.Counter(i for step in head + middle + tail for i in step)
    assert set(counts) == set(range(SAMPLES)) and sum(counts.values()) == SAMPLES


@contextlib.contextmanager
def origin_blind(server: BatchwireServer) -> Iterator[str]:
    """A server of the release before origins, as its clients see it: the real server
    behind a proxy that drops ``origin`` from every stream request, as a parser that does
    not know the field does. Yields the proxy's target."""
    channel = grpc.insecure_channel(server.target)
    describe = channel.unary_unary("/batchwire.v1.Batchwire/DescribeDataset")
    pull = channel.stream_stream("/batchwire.v1.Batchwire/PullBatches")

    def blind(raw: bytes) -> bytes:
        request = pb.PullRequest.FromString(raw)
        if not request.HasField("stream"):
            return raw
        request.stream.ClearField("origin")
        return request.SerializeToString()

    def forward(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        call = pull(blind(raw) for raw in requests)
        context.send_initial_metadata(call.initial_metadata())  # the client waits for it
        return call

    handlers = {
        "DescribeDataset": grpc.unary_unary_rpc_method_handler(
            lambda request, context: describe(request)
        ),
        "PullBatches": grpc.stream_stream_rpc_method_handler(forward),
    }
    proxy = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="proxy"))
    proxy.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("batchwire.v1.Batchwire", handlers)]
    )
    port = proxy.add_insecure_port("localhost:0")
    proxy.start()
    try:
        yield f"localhost:{port}"
    finally:
        proxy.stop(grace=None)
        channel.close()


def test_a_server_of_the_release_before_origins_is_caught_not_trusted(
    server: BatchwireServer,
) -> None:
    """Resuming on another world size needs servers that split the rest of the epoch; one
    that splits the whole epoch instead is refused at the first batch, not streamed."""
    _, state = interrupted(server, 2, 2, batch_size=40)
    with origin_blind(server) as target:
        loader = RemoteLoader(target, **{**OPTIONS, "batch_size": 40, "rank": 0, "world_size": 3})
        loader.load_state_dict(state)
        with pytest.raises(BatchwireError, match="Upgrade the servers") as caught:
            next(iter(loader))
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        loader.close()
        same_shape = RemoteLoader(
            target, **{**OPTIONS, "batch_size": 40, "rank": 0, "world_size": 2}
        )
        same_shape.load_state_dict(state)  # no origin: what such a server always served
        assert len(steps([same_shape])) == 6 - 2
        same_shape.close()
