"""A trainer on the server's host gets its batches through shared memory: the same
batches as over the socket, a ring that only the server and that trainer hold, nothing
left behind once a stream ends, and the socket path whenever memory cannot be shared
(another host, no budget left, the setting off)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import mmap
import multiprocessing
import os
import pathlib
import signal
import threading
import types
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch
from conftest import start_server
from processes import serve_process
from test_resources import within

from batchwire.client import RemoteLoader
from batchwire.client._transport import read_grant
from batchwire.client._transport._shared_memory import RingReader
from batchwire.common import shared_memory as common_shared_memory
from batchwire.common.batch_codec import decode_batch
from batchwire.common.outputs import Output, pack
from batchwire.common.sampler import Plan
from batchwire.common.shared_memory import GRANT_METADATA
from batchwire.server import BatchwireServer
from batchwire.server.engine import Batch
from batchwire.server.errors import InvalidRequest
from batchwire.server.serving import _shared_memory as server_shared_memory
from batchwire.server.serving._ring_broker import RingBroker
from batchwire.server.serving._ring_budget import RingBudget
from batchwire.server.serving._shared_memory import SharedRing, buffer_bytes
from batchwire.server.serving._streaming import EncodedBatch, encode_parts
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

SMALL = {"size": 32}
SHARED_BYTES = "batchwire_shared_memory_bytes_total"
RING = "/memfd:batchwire-ring"  # how /proc shows a ring (memfds have no path)


def shared_bytes(server: BatchwireServer, pipeline: str) -> float:
    labels = {"dataset": "shapes", "pipeline": pipeline}
    return server.metrics.registry.get_sample_value(SHARED_BYTES, labels) or 0.0


def ring_mappings(pid: int | str = "self") -> int:
    """Rings process ``pid`` maps (the tests' in-process servers and loaders: this one)."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum(1 for line in maps if RING in line)


def ring_descriptors(pid: int | str = "self") -> int:
    """Rings process ``pid`` holds a descriptor of."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(RING)
        except OSError:
            continue  # closed meanwhile
    return held


def named_here() -> set[str]:
    """The names in /dev/shm but those of other processes' loaders (their ledgers, which
    a test run beside this one on the host makes and removes)."""
    mine = f"batchwire-loader-{os.getpid()}-"
    return {
        name
        for name in os.listdir("/dev/shm")
        if not name.startswith("batchwire-loader-") or name.startswith(mine)
    }


def nothing_held(pid: int | str = "self") -> bool:
    if ring_mappings(pid) == 0 and ring_descriptors(pid) == 0:
        return True
    # A batch lent where it lies keeps its ring mapped until nothing refers to it; one in
    # garbage not yet collected (a cycle through another test's traceback) refers to
    # nothing any more.
    gc.collect()
    return ring_mappings(pid) == 0 and ring_descriptors(pid) == 0


def eventually(condition: Callable[[], bool], seconds: float = 30.0) -> bool:
    return within(seconds, condition)


def loader(target: str, **kwargs: object) -> RemoteLoader:
    """The loader every epoch here is read with: data epoch 3 of ``val``, ids returned."""
    made = RemoteLoader(
        target,
        dataset="shapes",
        pipeline="val",
        batch_size=32,
        return_ids=True,
        normalize=False,
        params=SMALL,
        shuffle=True,
        seed=7,
        **kwargs,  # type: ignore[arg-type]
    )
    made.set_epoch(3)
    return made


def epoch(target: str, **kwargs: object) -> list[tuple[torch.Tensor, ...]]:
    with loader(target, **kwargs) as reading:
        return list(reading)


def assert_same(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> None:
    assert len(a) == len(b) > 1
    for (images_a, labels_a, ids_a), (images_b, labels_b, ids_b) in zip(a, b, strict=True):
        assert torch.equal(ids_a, ids_b)
        assert torch.equal(labels_a, labels_b)
        assert torch.equal(images_a, images_b)


def test_a_loader_on_the_servers_host_gets_the_same_batches_through_shared_memory(
    server: BatchwireServer,
) -> None:
    before = shared_bytes(server, "val")
    in_dev_shm = named_here()
    shared = epoch(server.target)
    through_shm = shared_bytes(server, "val") - before
    socket = epoch(server.target, shared_memory=False)
    assert shared_bytes(server, "val") - before == through_shm  # the socket path took none
    assert through_shm == sum(batch[0].numel() for batch in shared)  # every image byte
    assert_same(shared, socket)
    assert named_here() <= in_dev_shm  # shared memory has no name there
    # Batches lent to the loop keep the ring mapped here while they are held; once they
    # go, it is unmapped and closed, on both sides.
    del shared
    assert eventually(nothing_held)


def two_epochs_in_messages(
    server: BatchwireServer, caplog: pytest.LogCaptureFixture, words: str
) -> str:
    """Two epochs from ``server``, every batch in its messages; what the loader said with
    ``words`` in it, which it says once a process, not once a call. The server is stopped."""
    try:
        with caplog.at_level(logging.INFO, logger="batchwire.client"):
            batches = epoch(server.target)
            assert len(epoch(server.target)) == len(batches)
        assert sum(len(ids) for _, _, ids in batches) == 520
        assert shared_bytes(server, "val") == 0
    finally:
        server.stop(grace=1.0)
    said = [r.getMessage() for r in caplog.records if words in r.getMessage()]
    assert said == [said[0]], caplog.text
    return said[0]


def test_a_server_with_shared_memory_off_sends_every_batch_in_its_messages(
    data_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(data_dir, shared_memory=False)
    assert server.target in two_epochs_in_messages(server, caplog, "offers no shared memory")


def test_a_trainer_that_cannot_reach_the_servers_socket_is_told_once(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As a trainer in a container of its own: the server's socket is not there for it."""
    server = start_server(data_dir, shared_memory_socket_dir=tmp_path)
    for path in tmp_path.iterdir():
        path.unlink()  # what the trainer's own file system shows of the directory
    said = two_epochs_in_messages(server, caplog, "cannot be reached")
    assert "--shared-memory-socket-dir" in said


def test_an_abandoned_loader_leaves_nothing_behind(server: BatchwireServer) -> None:
    loader = RemoteLoader(
        server.target, dataset="shapes", pipeline="train", batch_size=8, params=SMALL
    )
    batches = iter(loader)
    next(batches)
    assert ring_mappings() >= 2  # the stream's ring, mapped by the server and the loader
    loader.close()  # mid-epoch: the stream is cancelled
    assert eventually(nothing_held)


def test_a_trainer_in_another_container_claims_through_a_socket_in_a_shared_directory(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    server = start_server(data_dir, shared_memory_socket_dir=tmp_path)
    try:
        sockets = [path.name for path in tmp_path.iterdir()]
        assert sockets == [f"batchwire-{server.port}-0.sock"]
        batches = epoch(server.target)
        assert shared_bytes(server, "val") == sum(batch[0].numel() for batch in batches)
    finally:
        server.stop(grace=1.0)
    assert not list(tmp_path.iterdir())  # the socket goes with the server


def test_a_grant_claimed_by_another_process_than_the_offers_is_refused(
    server: BatchwireServer, caplog: pytest.LogCaptureFixture
) -> None:
    ring = RingReader.offer(2)
    offer = ring.message()
    offer.pid = 1  # as if another process of this host had made the offer, and the key leaked
    spec = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="val", batch_size=8, params=SMALL, world_size=1
    )
    requests = [pb.PullRequest(stream=spec, shared_memory=offer, batches=[0, 1])]
    with grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.BatchwireStub(channel).PullBatches(iter(requests), timeout=30)
        metadata = call.initial_metadata()
        assert any(key == GRANT_METADATA for key, _ in metadata)
        with caplog.at_level(logging.WARNING):
            ring.claim(read_grant(metadata), server.target)
        assert not ring.claimed
        batches = list(call)
    assert f"pid {os.getpid()} claimed the shared memory offered to pid 1" in caplog.text
    assert [b.index for b in batches] == [0, 1]
    # In their messages: the server never puts a batch in a ring nobody claimed.
    assert all(not b.HasField("shared_images") and b.images.data for b in batches)
    ring.close()


def test_a_release_of_a_buffer_the_stream_does_not_hold_ends_it_invalid_argument(
    server: BatchwireServer,
) -> None:
    ring = RingReader.offer(2)
    spec = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="val", batch_size=8, params=SMALL, world_size=1
    )
    requests = [
        pb.PullRequest(stream=spec, shared_memory=ring.message(), batches=[0]),
        pb.PullRequest(batches=[1], released_buffers=[9]),
    ]
    with grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.BatchwireStub(channel).PullBatches(iter(requests), timeout=30)
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
    ring.close()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds no batch of this stream" in raised.value.details()


def batch(index: int, samples: int = 4) -> Batch:
    rng = np.random.default_rng(index)
    return Batch(
        index=index,
        ids=np.arange(samples) + 10 * index,
        images=rng.integers(0, 255, (samples, 3, 8, 8), dtype=np.uint8),
        labels=np.arange(samples),
        cursor=(index + 1) * samples,
        skipped_ids=(),
        normalized=False,
        num_batches=9,
        layout="NCHW",
    )


def claimed_ring(buffers: int, budget: RingBudget) -> tuple[SharedRing, int]:
    """A ring and the read-only descriptor its client would have received."""
    ring = SharedRing(buffers, budget)
    assert ring.encode(batch(0)) is None  # nobody claimed it yet: nothing goes there
    fd = ring.descriptor()
    ring.claimed()
    return ring, fd


def images_at(fd: int, encoded_message: bytes) -> np.ndarray:
    header = decode_batch(
        encoded_message,
        lambda where, dtype, count: np.frombuffer(
            mmap.mmap(fd, 0, prot=mmap.PROT_READ), dtype, count, where.offset
        ),
    )
    return header.images


def test_a_stopping_server_closes_the_rings_whose_streams_never_closed_them() -> None:
    """A stream whose handler a stopping server cut short never closes its ring itself:
    the broker that granted it closes it as the server stops, memory, descriptor and
    budget, so that nothing of it outlives the server."""
    budget = RingBudget(2**30)

    async def grant_and_stop() -> None:
        broker = RingBroker(budget)
        assert broker.start(0)
        offer = pb.SharedMemoryOffer(buffers=2, pid=os.getpid(), uid=os.geteuid())
        granted = broker.grant(offer)
        assert granted is not None
        ring, _ = granted
        os.close(ring.descriptor())  # as the claim makes it and sends it
        ring.claimed()
        assert ring.encode(batch(0)) is not None  # in the ring: mapped and reserved
        assert ring_mappings() == 1 and ring_descriptors() > 0 and budget.used > 0
        await broker.close()  # the stream's own close never runs
        broker.close_rings()

    asyncio.run(grant_and_stop())
    assert nothing_held() and budget.used == 0


def test_a_full_ring_sends_batches_in_their_messages_until_the_client_releases_one() -> None:
    budget = RingBudget(2**30)
    ring, fd = claimed_ring(2, budget)
    first, second, third = (ring.encode(batch(i)) for i in range(3))
    assert first is not None and second is not None
    assert third is None  # both buffers hold batches the client has not copied out
    for k, encoded in enumerate((first, second)):
        assert np.array_equal(images_at(fd, encoded.messages[0]), batch(k).images)
    assert budget.used == 2 * buffer_bytes(batch(0).images)  # whole pages each
    buffer = pb.Batch.FromString(first.messages[0]).shared_images.buffer
    ring.release([buffer])
    again = ring.encode(batch(3))
    assert again is not None
    assert np.array_equal(images_at(fd, again.messages[0]), batch(3).images)
    with pytest.raises(InvalidRequest, match="holds no batch"):
        ring.release([7])
    with pytest.raises(OSError):  # the client's descriptor cannot write, nor can a new one
        os.pwrite(fd, b"x", 0)
    os.close(fd)
    ring.close()
    assert ring.encode(batch(4)) is None  # a closed stream's ring takes nothing more
    assert budget.used == 0
    assert nothing_held()


def test_a_ring_past_the_budget_sends_batches_in_their_messages_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(common_shared_memory, "_warned", set())
    budget = RingBudget(3 * buffer_bytes(batch(0).images))  # one ring of 2 buffers, not two
    first, fd = claimed_ring(2, budget)
    assert first.encode(batch(0)) is not None
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            second, second_fd = claimed_ring(2, budget)
            assert second.encode(batch(1)) is None
            os.close(second_fd)
            second.close()
    assert caplog.text.count("shared_memory_mib") == 1  # once a process
    first.close()
    os.close(fd)
    assert budget.used == 0  # every reservation given back
    assert nothing_held()


def test_a_ring_whose_memfd_other_code_closed_leaves_the_file_there_now_alone(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Code of the server's process closes a ring's memfd by mistake (a double close) and
    a file opened meanwhile takes its number: the ring neither resizes nor writes that
    file, nor closes it; its batches go in their messages, and the log says what happened."""
    monkeypatch.setattr(common_shared_memory, "_warned", set())
    budget = RingBudget(2**30)
    ring = SharedRing(2, budget)
    os.close(ring.descriptor())
    ring.claimed()
    victim = tmp_path / "checkpoint.pt"
    victim.write_bytes(b"weights")
    opened = os.open(victim, os.O_RDWR)
    number = ring._fd
    os.dup2(opened, number)  # the memfd closed, the file at its number
    os.close(opened)
    fell_back: list[Batch] = []

    def in_messages(sent: Batch) -> EncodedBatch:
        fell_back.append(sent)
        return encode_parts(sent, 2**22)

    with caplog.at_level(logging.WARNING):
        encoded = ring.encoder(in_messages)(batch(0))
        ring.close()
    assert len(fell_back) == 1
    assert not pb.Batch.FromString(encoded.messages[0]).HasField("shared_images")
    assert victim.read_bytes() == b"weights"  # neither resized nor written
    assert os.readlink(f"/proc/self/fd/{number}") == str(victim)  # nor closed
    os.close(number)
    assert "is no longer the ring's memfd" in caplog.text
    assert budget.used == 0
    assert nothing_held()


def test_a_ring_that_fails_in_an_unforeseen_way_sends_the_epoch_in_its_messages(
    data_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever fails in the server's shared memory (here its mapping, with an error no
    code expects) the stream goes on with its batches in their messages: the epoch is
    whole and the same, no INTERNAL reaches the trainer, no pipeline is rebuilt, and the
    log says it once."""
    monkeypatch.setattr(common_shared_memory, "_warned", set())
    served = start_server(data_dir)
    try:
        expected = epoch(served.target, shared_memory=False)

        def broken(*args: object, **kwargs: object) -> mmap.mmap:
            raise RuntimeError("an unforeseen fault")

        monkeypatch.setattr(
            server_shared_memory,
            "mmap",
            types.SimpleNamespace(mmap=broken, MADV_DONTFORK=mmap.MADV_DONTFORK),
        )
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                assert_same(epoch(served.target), expected)
        assert shared_bytes(served, "val") == 0
    finally:
        served.stop(grace=1.0)
    assert caplog.text.count("could not go in a stream's shared memory") == 1  # once
    assert "an unforeseen fault" in caplog.text  # with what happened
    assert "INTERNAL" not in caplog.text and "rebuil" not in caplog.text
    assert eventually(nothing_held)


def _reserve_in_child(budget: RingBudget, size: int, results: multiprocessing.Queue) -> None:
    results.put((budget.reserve(size), budget.used))


def test_a_units_workers_share_one_budget() -> None:
    context = multiprocessing.get_context("spawn")
    budget = RingBudget.for_unit(context, 1000)
    assert budget.reserve(600)
    results: multiprocessing.Queue = context.Queue()
    for _ in range(2):
        child = context.Process(target=_reserve_in_child, args=(budget, 300, results))
        child.start()
        child.join(60)
    assert [results.get(timeout=10) for _ in range(2)] == [(True, 900), (False, 900)]
    budget.release(900)
    assert budget.used == 0


def test_two_pipelines_through_shared_memory_lose_and_repeat_nothing_when_a_server_is_killed(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    expected = Plan(num_samples=520, batch_size=8, seed=5, drop_last=False).share().tolist()
    got: dict[str, list[int]] = {"train": [], "val": []}
    errors: list[BaseException] = []
    with (
        serve_process(data_dir, tmp_path / "a.log", "--grace", "5") as a,
        serve_process(data_dir, tmp_path / "b.log", "--grace", "5") as b,
    ):
        ten_batches = threading.Event()

        def stream(pipeline: str) -> None:
            try:
                with RemoteLoader(
                    [a.address, b.address],
                    dataset="shapes",
                    pipeline=pipeline,
                    batch_size=8,
                    params=SMALL,
                    seed=5,
                    drop_last=False,
                    return_ids=True,
                    retry_timeout=30,
                ) as loader:
                    for n, (_, _, ids) in enumerate(loader):
                        got[pipeline] += ids.tolist()
                        if n == 9:
                            ten_batches.set()
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=stream, args=(p,)) for p in got]
        for thread in threads:
            thread.start()
        assert ten_batches.wait(60)
        assert ring_mappings() >= 1  # the loaders read rings of both servers
        a.process.send_signal(signal.SIGKILL)  # mid-epoch, both pipelines streaming from it
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert got["train"] == expected and got["val"] == expected
        assert "pull shared-memory" in b.log.read_text()  # the survivor served through it
        # The survivor let go of each ring as its streams ended; the killed one's went
        # with it, and the loaders unmapped theirs as their calls ended.
        assert eventually(lambda: nothing_held(b.process.pid))
        assert eventually(nothing_held)


def payload_batch(index: int, nbytes: int) -> Batch:
    """A batch of named outputs whose payload is ``nbytes`` (ragged outputs make it vary)."""
    data = np.random.default_rng(index).integers(0, 255, nbytes, dtype=np.uint8)
    payload, heads = pack([Output(name="boxes", kind="ragged", data=[data])])
    return dataclasses.replace(batch(index, samples=1), images=payload, outputs=heads)


def test_a_ring_of_named_outputs_takes_batches_larger_than_its_first(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first batch sizes a ring's buffers; a payload of named outputs leaves room for
    later batches a little larger (ragged outputs), and one larger than that goes in its
    message, said once."""
    monkeypatch.setattr(common_shared_memory, "_warned", set())
    budget = RingBudget(2**30)
    ring, fd = claimed_ring(3, budget)
    first = payload_batch(0, 4 << 20)
    larger = payload_batch(1, (4 << 20) + (4 << 20) // 5)  # a fifth larger
    assert ring.encode(first) is not None
    with caplog.at_level(logging.INFO):
        encoded = ring.encode(larger)
        assert encoded is not None
        assert np.array_equal(images_at(fd, encoded.messages[0]), np.asarray(larger.images))
        assert ring.encode(payload_batch(2, 8 << 20)) is None  # twice as large
        assert ring.encode(payload_batch(3, 8 << 20)) is None
    assert caplog.text.count("larger than its stream's shared-memory buffers") == 1
    os.close(fd)
    ring.close()
    assert budget.used == 0
