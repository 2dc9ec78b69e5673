"""A trainer on another host gets its images on a bulk connection beside the call: the same
batches as in the call's messages, every image byte there but those of batches made before
the connection was claimed; the messages where the port cannot be reached or the server
keeps it off; a claim only with the call's key, once; and an epoch that loses and repeats
nothing when the connection breaks mid-batch, when either side is killed, and across a
fork.

The servers here have shared memory off, so that a trainer on their host takes the path a
trainer on another host does."""

from __future__ import annotations

import logging
import pathlib
import queue
import signal
import socket
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from conftest import start_server
from processes import serve_process
from test_failover import resumed
from test_shared_memory import assert_same, epoch, eventually
from test_shared_memory_faults import assert_saved_same, run_trainer, stalled_trainer

from batchwire.client import RemoteLoader
from batchwire.client._transport import _bulk as client_bulk
from batchwire.client._transport import read_bulk_grant
from batchwire.common.batch_codec import decode_batch
from batchwire.common.bulk import ACK, KEY_BYTES
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer
from batchwire.server.serving import _bulk as server_bulk
from batchwire.server.serving._bulk import BulkBroker, BulkLink
from batchwire.v1 import batchwire_pb2 as pb

BULK_BYTES = "batchwire_bulk_bytes_total"
MESSAGE_BYTES = "batchwire_bytes_sent_total"
SAMPLE_BYTES = 3 * 32 * 32  # one image of `val` at 32 px, uint8


def bulk_bytes(server: BatchwireServer, pipeline: str = "val") -> float:
    labels = {"dataset": "shapes", "pipeline": pipeline}
    return server.metrics.registry.get_sample_value(BULK_BYTES, labels) or 0.0


def moved(server: BatchwireServer, pipeline: str = "val") -> tuple[float, float]:
    """The pipeline's image bytes sent on bulk connections, and its messages' bytes, so far."""
    labels = {"dataset": "shapes", "pipeline": pipeline}
    registry = server.metrics.registry
    return bulk_bytes(server, pipeline), registry.get_sample_value(MESSAGE_BYTES, labels) or 0.0


def assert_on_the_connections(
    bulk: float, messages: float, samples: int, sample_bytes: int, batches: int
) -> None:
    """The images of ``samples`` went on bulk connections (``bulk`` bytes) but for those of
    batches made before their call's connection was claimed: those come in their
    messages (``messages`` bytes in all, which hold little else), and are few.

    A trainer asks for its first batches with the call's first message (a server on
    another host is a round trip away), and claims the connection once the call opened:
    a batch the server finishes before the claim does not wait for it."""
    carried = samples * sample_bytes - bulk  # images in the messages
    assert 0 <= carried < samples * sample_bytes / 2, (bulk, samples)
    assert carried % sample_bytes == 0, (bulk, sample_bytes)  # whole samples
    besides = messages - carried  # ids, labels, headers
    assert 0 < besides < batches * 1024 + samples * 32, (bulk, messages, samples)


def connections(port: int) -> int:
    """Established TCP connections on this host with ``port`` at one end."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, remote, state = line.split()[1:4]
                ends = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
                count += state == "01" and port in ends  # 01: ESTABLISHED
    return count


@pytest.fixture(scope="module")
def server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    """A server whose trainers here get the path of a trainer on another host."""
    server = start_server(data_dir, shared_memory=False)
    yield server
    server.stop(grace=1.0)


@pytest.fixture(scope="module")
def in_messages(server: BatchwireServer) -> list[tuple[torch.Tensor, ...]]:
    """The epoch every test here streams, every image in its message."""
    return epoch(server.target, bulk=False)


def test_a_trainer_on_another_host_gets_the_same_batches_on_a_bulk_connection(
    server: BatchwireServer, in_messages: list[tuple[torch.Tensor, ...]]
) -> None:
    before = moved(server)
    batches = epoch(server.target)
    bulk, messages = np.subtract(moved(server), before)
    assert_on_the_connections(bulk, messages, 520, SAMPLE_BYTES, len(batches))
    assert_same(batches, in_messages)
    assert all(images.is_contiguous() for images, _, _ in batches)
    messages_again = bulk_bytes(server)
    assert_same(epoch(server.target, bulk=False), in_messages)
    assert bulk_bytes(server) == messages_again  # bulk=False: none


def test_batches_larger_than_the_connections_buffers_come_whole(server: BatchwireServer) -> None:
    # 512 x 64 x 64 x 3 float32: 25 MB a batch, more than the connection's buffers hold:
    # each send waits for the trainer to read.
    def read(bulk: bool) -> list[tuple[torch.Tensor, ...]]:
        with RemoteLoader(
            server.target,
            dataset="shapes",
            pipeline="val",
            batch_size=512,
            dtype="float32",
            params={"size": 64},
            return_ids=True,
            seed=7,
            bulk=bulk,
        ) as loader:
            return list(loader)

    before = moved(server)
    large = read(True)
    bulk, messages = np.subtract(moved(server), before)
    assert_on_the_connections(bulk, messages, 520, 3 * 64 * 64 * 4, len(large))
    assert_same(large, read(False))


def test_two_pipelines_with_other_dtypes_and_layouts_come_whole_on_their_connections(
    server: BatchwireServer,
) -> None:
    def read(pipeline: str, bulk: bool) -> list[tuple[torch.Tensor, ...]]:
        with RemoteLoader(
            server.target,
            dataset="shapes",
            pipeline=pipeline,
            batch_size=24,
            return_ids=True,
            params={"size": 40},
            dtype="float16" if pipeline == "val" else "float32",
            layout="NHWC",
            seed=5,
            bulk=bulk,
        ) as loader:
            loader.set_epoch(1)
            return list(loader)

    # Two streams at once, of two pipelines, each on its own connection.
    with RemoteLoader(
        server.target, dataset="shapes", pipeline="train", batch_size=16, params={"size": 48}
    ) as train:
        running = iter(train)
        first = next(running)
        val = read("val", True)
        rest = list(running)
    assert sum(len(labels) for _, labels in [first, *rest]) == 520
    assert val[0][0].dtype == torch.float16 and val[0][0].shape[1:] == (40, 40, 3)
    assert_same(val, read("val", False))


def two_epochs_in_messages(
    server: BatchwireServer,
    in_messages: list[tuple[torch.Tensor, ...]],
    caplog: pytest.LogCaptureFixture,
    words: str,
) -> list[str]:
    """Two epochs from ``server``, each as ``in_messages`` and none of it on a bulk
    connection; what the loaders said with ``words`` in it. The server is stopped."""
    try:
        with caplog.at_level(logging.INFO, logger="batchwire.client"):
            assert_same(epoch(server.target), in_messages)
            assert_same(epoch(server.target), in_messages)
        assert bulk_bytes(server) == 0
    finally:
        server.stop(grace=1.0)
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


def test_a_server_with_bulk_off_keeps_images_in_the_messages_and_the_loader_says_so_once(
    data_dir: pathlib.Path,
    in_messages: list[tuple[torch.Tensor, ...]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    off = start_server(data_dir, shared_memory=False, bulk=False)
    said = two_epochs_in_messages(off, in_messages, caplog, "offers no bulk connection")
    assert len(said) == 1, caplog.text


def test_a_bulk_port_the_trainer_cannot_reach_costs_one_try_and_the_images_come_in_messages(
    data_dir: pathlib.Path,
    in_messages: list[tuple[torch.Tensor, ...]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A server behind a proxy or a firewall that lets only its gRPC port through: the port
    # it announces refuses this host.
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        closed = probe.getsockname()[1]
    grant = BulkBroker.grant

    def unreachable(self: BulkBroker) -> tuple[BulkLink, pb.BulkGrant] | None:
        granted = grant(self)
        if granted is not None:
            granted[1].port = closed
        return granted

    monkeypatch.setattr(BulkBroker, "grant", unreachable)
    tries: list[tuple[str, int]] = []
    connect = socket.create_connection

    def counted(address: tuple[str, int], *args: object, **kwargs: object) -> socket.socket:
        tries.append(address)
        return connect(address, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client_bulk.socket, "create_connection", counted)
    monkeypatch.setattr(client_bulk, "_unreachable", set())  # this test's, forgotten after
    behind = start_server(data_dir, shared_memory=False)
    said = two_epochs_in_messages(behind, in_messages, caplog, "could not connect")
    assert [port for _, port in tries] == [closed]  # the second loader did not try again
    assert len(said) == 1 and f"port {closed} of" in said[0] and "--bulk-port" in said[0]


def open_call(
    channel: grpc.Channel, asks: queue.Queue[pb.PullRequest | None]
) -> tuple[grpc.Call, Iterator[bytes], pb.BulkGrant]:
    """A PullBatches call offering a bulk connection, asking for nothing yet, then for
    what ``asks`` holds until None; its grant."""
    stub = channel.stream_stream(
        "/batchwire.v1.Batchwire/PullBatches",
        request_serializer=pb.PullRequest.SerializeToString,
        response_deserializer=None,
    )
    stream = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="val", batch_size=32, seed=7, epoch=3, params={"size": 32}
    )
    asks.put(pb.PullRequest(stream=stream, bulk=True))
    call = stub(iter(lambda: asks.get(timeout=60), None))
    grant = read_bulk_grant(call.initial_metadata())
    assert grant is not None and grant.port and len(grant.key) == KEY_BYTES
    return call, call, grant


def claim(port: int, key: bytes) -> tuple[socket.socket, bytes]:
    """A connection to the bulk port that sent ``key``, and what the server answered."""
    connection = socket.create_connection(("localhost", port), timeout=10)
    connection.sendall(key)
    return connection, connection.recv(1)


def test_a_bulk_connection_is_claimed_only_with_its_calls_key_and_only_once(
    server: BatchwireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_bulk, "CLAIM_TIMEOUT_S", 0.5)
    asks: queue.Queue[pb.PullRequest | None] = queue.Queue()
    with grpc.insecure_channel(server.target) as channel:
        call, messages, grant = open_call(channel, asks)
        guessed, answer = claim(grant.port, bytes(KEY_BYTES))
        assert answer == b""  # closed without a word: no such key
        guessed.close()
        silent = socket.create_connection(("localhost", grant.port), timeout=10)
        assert silent.recv(1) == b""  # a connection that sends no key is closed
        silent.close()
        mine, answer = claim(grant.port, grant.key)
        assert answer == ACK
        again, answer = claim(grant.port, grant.key)
        assert answer == b""  # good once
        again.close()
        asks.put(pb.PullRequest(batches=[0, 1]))
        asks.put(None)  # half-closed: the call ends once both are sent
        got = []
        for raw in messages:
            header = pb.Batch.FromString(raw)
            assert header.HasField("bulk_images")  # asked for after the claim: all there
            data = bytearray(header.bulk_images.length)
            view = memoryview(data)
            while view:
                count = mine.recv_into(view)
                assert count
                view = view[count:]
            images = decode_batch(raw).images
            got.append(np.frombuffer(data, images.dtype).reshape(images.shape))
        assert call.code() == grpc.StatusCode.OK
        mine.close()
    expected = epoch(server.target, bulk=False)[:2]
    for images, (want, _, _) in zip(got, expected, strict=True):
        assert np.array_equal(images, want.numpy())


def test_a_bulk_connection_that_breaks_mid_batch_loses_and_repeats_nothing(
    server: BatchwireServer,
    in_messages: list[tuple[torch.Tensor, ...]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sends = 0
    send = BulkLink._send

    def breaking(self: BulkLink, data: np.ndarray) -> None:
        nonlocal sends
        sends += 1
        if sends == 4:  # half a batch, then the connection is reset
            assert self._socket is not None
            self._socket.sendall(memoryview(data)[: len(data) // 2])
            self._socket.shutdown(socket.SHUT_RDWR)
        send(self, data)

    monkeypatch.setattr(BulkLink, "_send", breaking)
    caplog.set_level(logging.WARNING, logger="batchwire.client")
    assert_same(epoch(server.target, retry_timeout=30), in_messages)
    assert sends > 4
    assert "bulk connection broke" in caplog.text


def test_a_trainer_killed_mid_epoch_leaves_the_server_serving_with_no_connection_held(
    server: BatchwireServer, tmp_path: pathlib.Path, in_messages: list[tuple[torch.Tensor, ...]]
) -> None:
    port = server._bulk.port  # type: ignore[union-attr]
    with stalled_trainer(server.target, tmp_path / "never.npz") as trainer:
        assert connections(port) == 2  # both ends, the trainer's and the server's
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
    assert eventually(lambda: connections(port) == 0, 30)  # the server closed its end
    active = "batchwire_active_streams"
    labels = {"dataset": "shapes", "pipeline": "val"}
    assert eventually(lambda: server.metrics.registry.get_sample_value(active, labels) == 0, 30)
    assert_same(epoch(server.target), in_messages)  # and it serves the next one whole


def test_a_fork_during_a_pass_leaves_the_parents_connection_alone(
    server: BatchwireServer, tmp_path: pathlib.Path, in_messages: list[tuple[torch.Tensor, ...]]
) -> None:
    # The child closes every bulk connection it inherited, as a child that tears down the
    # parent's objects would: the parent's must go on.
    fork = """
if n == 2:
    import gc
    from batchwire.client._transport._bulk import BulkReader
    child = os.fork()
    if child == 0:
        readers = [o for o in gc.get_objects() if isinstance(o, BulkReader)]
        for reader in readers:
            reader.close()
        os._exit(10 + len(readers))
    report["child"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
"""
    before = moved(server)
    report = run_trainer(server.target, tmp_path / "epoch.npz", fork)
    assert report["child"] == 11  # it held the one reader of the pass, and closed it
    bulk, messages = np.subtract(moved(server), before)
    assert_on_the_connections(bulk, messages, 520, SAMPLE_BYTES, len(in_messages))
    assert_saved_same(tmp_path / "epoch.npz", in_messages)


def test_sigkill_of_a_server_mid_epoch_loses_and_repeats_nothing_on_bulk_connections(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.client")
    options = ("--no-shared-memory", "--grace", "5")
    with (
        serve_process(data_dir, tmp_path / "a.log", *options) as a,
        serve_process(data_dir, tmp_path / "b.log", *options) as b,
    ):
        ids: list[int] = []
        loader = RemoteLoader(
            [a.address, b.address],
            dataset="shapes",
            pipeline="val",
            batch_size=8,
            return_ids=True,
            params={"size": 32},
            seed=3,
            retry_timeout=30,
        )
        with loader:
            for n, (_, _, batch_ids) in enumerate(loader):
                ids += batch_ids.tolist()
                if n == 9:
                    a.process.send_signal(signal.SIGKILL)
        assert a.process.wait(10) == -signal.SIGKILL
    assert ids == Plan(num_samples=520, batch_size=8, seed=3, drop_last=False).share().tolist()
    assert resumed(caplog), "the killed server's batches moved to the other server"
    assert "pull bulk" in (tmp_path / "b.log").read_text()  # the survivor's streams had one
