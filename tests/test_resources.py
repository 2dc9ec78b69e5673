"""Bounded resources: limits, cancelled streams freed promptly, no threads left behind."""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from conftest import start_server

from batchwire.client import RemoteLoader, ResourceExhaustedError
from batchwire.server import BatchwireServer
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc


def within(seconds: float, condition: Callable[[], bool]) -> bool:
    """Whether ``condition`` holds at some point in the next ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture()
def limited(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    server = start_server(data_dir, max_streams=2)
    yield server
    server.stop(grace=1.0)


def open_stream(channel: grpc.Channel) -> grpc.Call:
    request = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="val", batch_size=4, params={"size": 32}
    )
    return pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=60)


def test_streams_beyond_the_limit_are_refused_naming_it(limited: BatchwireServer) -> None:
    with grpc.insecure_channel(limited.target) as channel:
        calls = [open_stream(channel) for _ in range(2)]
        for call in calls:
            next(call)
        with pytest.raises(ResourceExhaustedError, match="--max-streams 2"):
            list(RemoteLoader(limited.target, dataset="shapes", batch_size=4, retry_timeout=0))
        for call in calls:
            call.cancel()
        # Cancelled streams give their slots back (a hang guard: no speed is checked).
        assert within(60.0, lambda: limited.engine.active_streams == 0)
        with RemoteLoader(limited.target, dataset="shapes", batch_size=4) as loader:
            assert len(next(iter(loader))[1]) == 4


def test_a_client_that_goes_away_stops_its_pipeline_within_a_second(
    server: BatchwireServer,
) -> None:
    with grpc.insecure_channel(server.target) as channel:
        call = open_stream(channel)
        next(call)
        assert server.engine.active_streams >= 1
    # The channel is closed: the server sees the client gone and frees the stream.
    # The server sees the cancellations a moment after the client sends them.
    assert within(60.0, lambda: server.engine.active_streams == 0)


def test_a_client_that_goes_away_while_its_pipeline_builds_gives_the_slot_back(
    server: BatchwireServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    entered, release = threading.Event(), threading.Event()
    open_stream_now = server.engine.open_stream

    def slow_open(request, **options):  # type: ignore[no-untyped-def]  # a slow pipeline build
        entered.set()
        assert release.wait(30)
        return open_stream_now(request, **options)

    monkeypatch.setattr(server.engine, "open_stream", slow_open)
    caplog.set_level("INFO", logger="batchwire.server.serving._servicer")
    with grpc.insecure_channel(server.target) as channel:
        call = open_stream(channel)
        assert entered.wait(30)
        call.cancel()
        # The server has seen the cancellation before the stream finishes opening.
        assert within(60.0, lambda: "went away while its stream was opening" in caplog.text)
        release.set()
    assert within(60.0, lambda: server.engine.active_streams == 0)


def lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("batchwire-pull")]


def test_close_and_break_leave_no_reader_thread(server: BatchwireServer) -> None:
    assert lane_threads() == []
    loader = RemoteLoader(server.target, dataset="shapes", batch_size=4, prefetch=4)
    for n, _ in enumerate(loader):
        if n == 5:
            break
    assert within(60.0, lambda: lane_threads() == [])
    iterator = iter(loader)
    next(iterator)
    assert lane_threads()
    loader.close()
    iterator.close()
    assert within(60.0, lambda: lane_threads() == [])
    # The server sees the cancellations a moment after the client sends them.
    assert within(60.0, lambda: server.engine.active_streams == 0)


def test_a_slow_consumer_makes_the_server_wait_instead_of_buffering(
    server: BatchwireServer,
) -> None:
    request = pb.StreamBatchesRequest(dataset="shapes", pipeline="val", batch_size=16)
    earlier = set(server.engine.streams())  # an earlier test's, still closing
    # gRPC grows a call's flow-control window with its estimate of the link's bandwidth-delay
    # product (BDP probing), by how fast earlier data was read: from 5 to 16 batches of this
    # size measured on loopback, depending on the machine's load. Without it the window stays
    # at HTTP/2's 64 KiB, so what the server may run ahead of its client is fixed.
    options = [("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        call = pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=60)
        next(call)  # one batch of 16 x 3 x 224 x 224 (2.4 MB), then the client dawdles
        (stream,) = [s for s in server.engine.streams() if s not in earlier]
        # A server that buffered for slow clients would race through all 32 batches; this
        # one stops when the flow-control window and the socket buffers are full (2 batches
        # made on loopback: the one taken and the one gRPC holds), and stays stopped.
        time.sleep(1.5)
        made = stream.produced
        assert made <= 4, f"{made} batches made for 1 consumed"
        time.sleep(1.5)
        assert stream.produced == made, f"{stream.produced} batches made for 1 consumed"
        call.cancel()


def test_closing_the_engine_closes_streams_nobody_closed(data_dir: pathlib.Path) -> None:
    # What a stream handler cancelled during shutdown leaves behind.
    from batchwire.common.stream import StreamSpec
    from batchwire.server import ServerConfig
    from batchwire.server.engine import Engine

    engine = Engine(ServerConfig(data_dir=data_dir, device="cpu", num_threads=1))
    engine.open_datasets()
    stream = engine.open_stream(StreamSpec(dataset="shapes", pipeline="val", batch_size=8))
    next(stream)
    engine.close()
    assert stream.closed and engine.active_streams == 0 and engine.streams() == []
