"""A trainer on the server's host gets its batches through shared memory: the same
batches as over the socket, nothing left in /dev/shm, and the socket path whenever
memory cannot be shared (another host, a full /dev/shm, the setting off)."""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import threading
import time
import types
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch
from conftest import start_server
from processes import serve_process

from batchwire.client import RemoteLoader
from batchwire.client._shared_memory import SharedMemory
from batchwire.common.sampler import Plan
from batchwire.common.shared_memory import SHM_DIR
from batchwire.server import BatchwireServer
from batchwire.server.core import Batch
from batchwire.server.errors import InvalidRequest
from batchwire.server.serving import _shared_memory
from batchwire.server.serving._shared_memory import (
    SharedRing,
    accept_offer,
    remove_stale,
)
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

SMALL = {"size": 32}
SHARED_BYTES = "batchwire_shared_memory_bytes_total"


def shared_bytes(server: BatchwireServer, pipeline: str) -> float:
    labels = {"dataset": "shapes", "pipeline": pipeline}
    return server.metrics.registry.get_sample_value(SHARED_BYTES, labels) or 0.0


def rings(pid: int | None = None) -> list[str]:
    """The rings in /dev/shm of process ``pid`` (default: this one, whose servers the
    tests start in-process); other tests' killed servers may have left theirs."""
    prefix = f"batchwire-{os.getpid() if pid is None else pid}-"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def probes_now() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("batchwire-probe-")}


def mapped() -> int:
    """Rings this process maps (the test's server and its loaders share the process)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if f"{SHM_DIR}/batchwire-" in line and "loader" not in line)


def eventually(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    waiting = threading.Event()
    for _ in range(int(seconds / 0.05)):
        if condition():
            return True
        waiting.wait(0.05)
    return condition()


def epoch(server: BatchwireServer, **kwargs: object) -> list[tuple[torch.Tensor, ...]]:
    loader = RemoteLoader(
        server.target,
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
    loader.set_epoch(3)
    try:
        return list(loader)
    finally:
        loader.close()


def test_a_loader_on_the_servers_host_gets_the_same_batches_through_shared_memory(
    server: BatchwireServer,
) -> None:
    before = shared_bytes(server, "val")
    probes = probes_now()
    shared = epoch(server)
    through_shm = shared_bytes(server, "val") - before
    socket = epoch(server, shared_memory=False)
    assert shared_bytes(server, "val") - before == through_shm  # the socket path took none
    images = sum(batch[0].numel() for batch in shared)
    assert through_shm == images  # every image byte went through shared memory
    assert len(shared) == len(socket) > 1
    for (images_a, labels_a, ids_a), (images_b, labels_b, ids_b) in zip(
        shared, socket, strict=True
    ):
        assert torch.equal(ids_a, ids_b)
        assert torch.equal(labels_a, labels_b)
        assert torch.equal(images_a, images_b)
    assert rings() == []  # every ring removed once the streams ended
    assert probes_now() <= probes  # and every probe the loaders made
    assert eventually(lambda: mapped() == 0)  # and unmapped, on both sides


def test_a_server_with_shared_memory_off_sends_every_batch_in_its_messages(
    data_dir: pathlib.Path,
) -> None:
    server = start_server(data_dir, shared_memory=False)
    try:
        batches = epoch(server)
        assert sum(len(ids) for _, _, ids in batches) == 512
        assert shared_bytes(server, "val") == 0
    finally:
        server.stop(grace=1.0)


def test_an_abandoned_loader_leaves_nothing_in_dev_shm(server: BatchwireServer) -> None:
    loader = RemoteLoader(
        server.target, dataset="shapes", pipeline="train", batch_size=8, params=SMALL
    )
    batches = iter(loader)
    next(batches)
    assert mapped() >= 1  # the stream's ring, mapped by the server and the loader
    loader.close()  # mid-epoch: the stream is cancelled
    assert eventually(lambda: mapped() == 0 and not rings())


def offer_in(directory: pathlib.Path, token: bytes = b"t" * 16) -> pb.SharedMemoryOffer:
    name = "batchwire-probe-" + "ab" * 16
    (directory / name).write_bytes(token)
    return pb.SharedMemoryOffer(probe=name, token=token, buffers=2)


def test_a_server_takes_an_offer_only_with_the_clients_token_in_its_own_dev_shm(
    tmp_path: pathlib.Path,
) -> None:
    good = offer_in(tmp_path)
    assert accept_offer(good, tmp_path) is not None
    wrong = pb.SharedMemoryOffer(probe=good.probe, token=b"x" * 16, buffers=2)
    assert accept_offer(wrong, tmp_path) is None  # another host's /dev/shm: a file, not ours
    elsewhere = pb.SharedMemoryOffer(probe="batchwire-probe-" + "cd" * 16, token=good.token)
    assert accept_offer(elsewhere, tmp_path) is None  # no such file here
    outside = pb.SharedMemoryOffer(probe="../etc/passwd", token=good.token, buffers=2)
    assert accept_offer(outside, tmp_path) is None  # only probe names, never paths


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


def test_a_full_ring_sends_batches_in_their_messages_until_the_client_releases_one(
    tmp_path: pathlib.Path,
) -> None:
    from batchwire.common.batch_codec import decode_batch

    ring = SharedRing(2, tmp_path)
    client = SharedMemory(tmp_path / "batchwire-probe-00", b"t" * 16, 2)
    first, second, third = (ring.encode(batch(i)) for i in range(3))
    assert first is not None and second is not None
    assert third is None  # both buffers hold batches the client has not copied out
    for k, encoded in enumerate((first, second)):
        decoded = decode_batch(encoded.messages[0], client.view)
        assert np.array_equal(decoded.images, batch(k).images)
        assert list(decoded.header.ids) == list(batch(k).ids)
    assert not list(tmp_path.iterdir())  # the client removed the file once it mapped it
    buffer = decode_batch(first.messages[0], client.view).header.shared_images.buffer
    ring.release([buffer])
    again = ring.encode(batch(3))
    assert again is not None
    assert np.array_equal(decode_batch(again.messages[0], client.view).images, batch(3).images)
    with pytest.raises(InvalidRequest, match="holds no batch"):
        ring.release([7])
    ring.close()
    assert ring.encode(batch(4)) is None  # a closed stream's ring takes nothing more


def test_a_dev_shm_without_room_sends_batches_in_their_messages(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reserve = os.posix_fallocate
    room = [1]  # buffers /dev/shm has room for

    def filling(fd: int, offset: int, length: int) -> None:
        if not room:
            raise OSError(28, "No space left on device")
        room.pop()
        reserve(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", filling)
    ring = SharedRing(3, tmp_path)
    first = ring.encode(batch(0))
    assert first is not None and first.shared  # the one buffer there was room for
    with caplog.at_level(logging.WARNING):
        assert ring.encode(batch(1)) is None  # in its messages: no room for a second
    assert "shm_size" in caplog.text
    ring.release([0])  # the batch in buffer 0, the first handed out, was copied out
    assert ring.encode(batch(2)) is not None  # the first buffer again
    ring.close()
    assert not list(tmp_path.iterdir())


def test_a_release_of_a_buffer_the_stream_does_not_hold_ends_it_invalid_argument(
    server: BatchwireServer,
) -> None:
    shared = SharedMemory.offer(2)
    assert shared is not None
    spec = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="val", batch_size=8, params=SMALL, world_size=1
    )
    requests = [
        pb.PullRequest(stream=spec, shared_memory=shared.message(), batches=[0]),
        pb.PullRequest(batches=[1], released_buffers=[9]),
    ]
    with grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.BatchwireStub(channel).PullBatches(iter(requests), timeout=30)
        with pytest.raises(grpc.RpcError) as raised:
            list(call)
    shared.close()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds no batch of this stream" in raised.value.details()


def test_a_dev_shm_with_little_room_is_left_to_others(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # 2 buffers of 768 bytes need 1.5 KiB: more than half of 2 KiB free.
    little = types.SimpleNamespace(f_bavail=2, f_blocks=1024, f_frsize=1024)
    monkeypatch.setattr(os, "statvfs", lambda path: little)
    monkeypatch.setattr(_shared_memory, "_room_warned", False)
    with caplog.at_level(logging.WARNING):
        assert SharedRing(2, tmp_path).encode(batch(0)) is None
        assert SharedRing(2, tmp_path).encode(batch(1)) is None
    assert caplog.text.count("too little for a stream's") == 1  # once a process
    # Free space enough, but this process's rings would take more than half of it all.
    monkeypatch.setattr(
        os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=1024, f_blocks=2, f_frsize=1024)
    )
    assert SharedRing(2, tmp_path).encode(batch(2)) is None
    assert not list(tmp_path.iterdir())


def test_a_server_removes_the_rings_and_probes_that_dead_processes_left(
    tmp_path: pathlib.Path,
) -> None:
    old = time.time() - 3600
    names = {
        "ring": "batchwire-123-0123456789abcdef",
        "probe": "batchwire-probe-" + "ef" * 16,
        "fresh ring": "batchwire-124-0123456789abcdef",
        "ledger": "batchwire-loader-1-abcdefgh",
        "other": "something-else",
    }
    for label, name in names.items():
        (tmp_path / name).write_bytes(b"x")
        if label != "fresh ring":
            os.utime(tmp_path / name, (old, old))
    assert remove_stale(tmp_path) == 2
    left = {names["fresh ring"], names["ledger"], names["other"]}
    assert {path.name for path in tmp_path.iterdir()} == left


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
        a.process.send_signal(signal.SIGKILL)  # mid-epoch, both pipelines streaming from it
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert got["train"] == expected and got["val"] == expected
        assert "pull shared-memory" in b.log.read_text()  # the survivor served through it
        # Whatever the killed server left (a ring its loader had not mapped yet) is its own;
        # the survivor removed each of its rings as its streams ended.
        assert eventually(lambda: not rings(b.process.pid))
