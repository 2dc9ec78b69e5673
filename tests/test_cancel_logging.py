"""A client that cancels its stream is normal operation: the server logs it once, at INFO
(``stream end ... status=CANCELLED``), never at WARNING or above nor with a traceback,
however the client goes away (cancel, closed channel, abandoned loader) and wherever
the stream is (opening its pipeline, between batches, in the middle of a batch).

Each stream gets its own epoch, which its ``stream end`` record carries (``extra``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import grpc
import pytest

from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

WAIT_S = 10.0
# Loggers that must stay quiet (below WARNING) when a client goes away.
QUIET = ("batchwire.server", "asyncio", "grpc")
OPENING = "client went away while its stream was opening"
# Default size (224): an epoch is far more than gRPC's flow-control windows hold, so
# the server is still streaming when the client cancels (the status is CANCELLED, not OK).
BIG_BATCH = 256  # ~38 MB: sent in several messages (max_message_bytes 8 MiB)
SMALL_BATCH = 16  # one message a batch
_epochs = itertools.count(7000)


def poll(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {WAIT_S:.0f}s")
        time.sleep(0.01)


def end_records(caplog: pytest.LogCaptureFixture, epoch: int) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "event", None) == "stream_end" and getattr(r, "epoch", None) == epoch
    ]


def opening_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if OPENING in r.getMessage()]


def loud(records: list[logging.LogRecord]) -> list[str]:
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in records
        if any(r.name == q or r.name.startswith(q + ".") for q in QUIET)
        and (r.levelno >= logging.WARNING or r.exc_info)
    ]


def channel(server: BatchwireServer) -> grpc.Channel:
    return grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", -1)])


def stream(
    ch: grpc.Channel, epoch: int, batch_size: int, params: dict[str, float] | None = None
) -> grpc.Call:
    request = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="train", batch_size=batch_size, epoch=epoch, params=params
    )
    return pb_grpc.BatchwireStub(ch).StreamBatches(request, timeout=60)


@pytest.fixture
def quiet_server(server: BatchwireServer, caplog: pytest.LogCaptureFixture) -> BatchwireServer:
    """The session server with no stream open, its log captured from INFO up."""
    caplog.set_level(logging.INFO)
    poll(lambda: server.engine.active_streams == 0, "streams of earlier tests did not close")
    return server


def assert_quiet(
    server: BatchwireServer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Once the cancelled streams are closed: nothing logged at WARNING or above or
    with a traceback, and no traceback printed."""
    poll(lambda: server.engine.active_streams == 0, "the cancelled streams did not close")
    with grpc.insecure_channel(server.target) as ch:  # one more round trip through the server
        pb_grpc.BatchwireStub(ch).ListDatasets(pb.ListDatasetsRequest(), timeout=30)
    assert loud(caplog.records) == []
    assert "Traceback" not in capfd.readouterr().err


def assert_cancelled_once(caplog: pytest.LogCaptureFixture, epoch: int) -> None:
    poll(lambda: bool(end_records(caplog, epoch)), f"no 'stream end' record for epoch {epoch}")
    [record] = end_records(caplog, epoch)
    assert record.levelno == logging.INFO
    assert record.status == "CANCELLED"  # type: ignore[attr-defined]
    assert "status=CANCELLED" in record.getMessage()


@pytest.mark.parametrize(
    ("how", "batch", "messages"),
    [
        # Mid-batch: the server is writing (or about to write) the batch's next part when
        # the client leaves, so its write fails before gRPC reports the client gone.
        ("cancel", BIG_BATCH, 1),
        ("cancel", BIG_BATCH, 2),
        ("cancel", BIG_BATCH, 3),
        ("cancel", SMALL_BATCH, 1),  # after a whole batch
        ("close the channel", BIG_BATCH, 1),
        ("close the channel", BIG_BATCH, 3),
    ],
)
def test_a_client_leaving_mid_stream(
    quiet_server: BatchwireServer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    how: str,
    batch: int,
    messages: int,
) -> None:
    epoch = next(_epochs)
    ch = channel(quiet_server)
    call = stream(ch, epoch, batch)
    for _ in range(messages):
        next(call)
    if how == "cancel":
        call.cancel()
    ch.close()
    assert_cancelled_once(caplog, epoch)
    assert_quiet(quiet_server, caplog, capfd)


def test_abandon_a_loader_mid_epoch(
    quiet_server: BatchwireServer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    epoch = next(_epochs)
    # 32 batches of 16: more than the loader asks for ahead (10), so the server cannot have
    # sent the whole epoch before the loader leaves (which would end the stream OK).
    with RemoteLoader(
        quiet_server.target, dataset="shapes", pipeline="train", batch_size=16
    ) as loader:
        loader.set_epoch(epoch)
        images, _ = next(iter(loader))  # the iterator is dropped mid-epoch, then the loader closed
    assert images.shape[0] == 16
    assert_cancelled_once(caplog, epoch)
    assert_quiet(quiet_server, caplog, capfd)


def test_cancel_while_the_pipeline_is_built(
    quiet_server: BatchwireServer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # A size no other test asks for: the server builds a pipeline for this stream
    # (logging "building pipeline" first), unless an earlier run left one idle.
    epoch = next(_epochs)

    def opening_or_open() -> bool:
        building = any(
            "building pipeline train for batch size 8" in r.getMessage() for r in caplog.records
        )
        return building or any(s.plan.epoch == epoch for s in quiet_server.engine.streams())

    with channel(quiet_server) as ch:
        call = stream(ch, epoch, 8, params={"size": 48})
        poll(opening_or_open, "the server did not open the stream")
        call.cancel()
    assert_quiet(quiet_server, caplog, capfd)
    # Cancelled while opening (one line saying so) or, when the build won the race,
    # before the first batch (the stream ends CANCELLED). Either way, one INFO line.
    opening, ends = opening_records(caplog), end_records(caplog, epoch)
    assert len(opening) + len(ends) == 1
    assert all(r.levelno == logging.INFO for r in opening + ends)
    assert all(r.status == "CANCELLED" for r in ends)  # type: ignore[attr-defined]
