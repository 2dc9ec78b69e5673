"""Batches go to whichever server is ready: the book's assignment policy, and servers
that join a ``dns:///`` name during an epoch."""

from __future__ import annotations

import logging
import pathlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import start_server
from processes import serve_process

from batchwire.client import BatchwireError, RemoteLoader, UnavailableError
from batchwire.client._book import HEDGE_MIN_S, Book, Held
from batchwire.client._delivery import Delivery
from batchwire.client._transport import CHANNEL_OPTIONS
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc


def delivery(index: int) -> Delivery:
    return Delivery(
        index=index,
        ids=np.array([index]),
        images=torch.zeros((1,)),
        labels=torch.zeros((1,), dtype=torch.int64),
        cursor=index + 1,
        skipped_ids=(),
    )


def never() -> bool:
    return False


def take(book: Book, index: int) -> int:
    # A hang guard, not a speed check: a hedge on a loaded slow host takes seconds.
    return book.take(index, timeout=60, retry_timeout=60, check=lambda: None).index


def test_a_server_that_delivers_is_asked_for_more_within_the_window() -> None:
    book = Book(first=0, num_batches=100, window=8)
    fast = Held()
    slow = Held()
    assert book.claim(fast, 2, never) == [0, 1]
    assert book.claim(slow, 2, never) == [2, 3]
    for _ in range(2):  # the fast server delivers what it holds and is asked for more
        for index in list(fast):
            book.deliver(fast, delivery(index))
        assert len(book.claim(fast, 2, never) or []) == 2
    assert list(fast) == [6, 7]  # the window (8 beyond batch 0) is full now
    assert book.claim(slow, 3, lambda: len(slow) >= 2) is None  # no room: nothing more
    assert [take(book, k) for k in (0, 1)] == [0, 1]
    assert book.claim(fast, 4, never) == [8, 9]  # taking batches made room
    with pytest.raises(BatchwireError, match="batch 5 where batch 2 was asked for"):
        book.deliver(slow, delivery(5))


def test_a_failed_server_gives_its_batches_back_lowest_first() -> None:
    book = Book(first=10, num_batches=20, window=6)
    a = Held()
    b = Held()
    assert book.claim(a, 3, never) == [10, 11, 12]
    assert book.claim(b, 3, never) == [13, 14, 15]
    book.deliver(a, delivery(10))
    assert book.give_back(a, (grpc.StatusCode.UNAVAILABLE, "a: gone")) == [11, 12]
    assert not a
    assert take(book, 10) == 10
    assert book.claim(b, 5, never) == [11, 12]  # then 16 if the window allowed it
    for index in [13, 14, 15, 11, 12]:
        book.deliver(b, delivery(index))
    assert [take(book, k) for k in range(11, 16)] == list(range(11, 16))


def test_servers_failing_without_progress_end_the_pass_after_retry_timeout() -> None:
    book = Book(first=0, num_batches=4, window=4)
    held = Held()
    book.claim(held, 2, never)
    book.give_back(held, (grpc.StatusCode.UNAVAILABLE, "a: connection refused"))
    with pytest.raises(UnavailableError, match=r"retry_timeout=.*a: connection refused") as caught:
        book.take(0, timeout=60, retry_timeout=0, check=lambda: None)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_batch_held_by_a_stalled_server_is_asked_of_another(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The stalled server never delivers: after the hedge wait, the other server is
    offered all it holds, the user gets every batch in order, and a late copy is dropped."""
    book = Book(first=0, num_batches=4, window=8)
    stalled, other = Held(), Held()
    assert book.claim(stalled, 2, never) == [0, 1]
    assert book.claim(other, 2, never) == [2, 3]
    for index in (2, 3):
        book.deliver(other, delivery(index))
    done = threading.Event()

    def serve_the_other() -> None:  # a live server: delivers whatever it is asked for
        while (batches := book.claim(other, 2, done.is_set)) is not None:
            for index in batches:
                book.deliver(other, delivery(index))

    thread = threading.Thread(target=serve_the_other, daemon=True)
    thread.start()
    try:
        assert [take(book, k) for k in range(4)] == [0, 1, 2, 3]
    finally:
        done.set()
        thread.join(5)
    assert "offering the 2 batches it holds to the other servers with room" in caplog.text
    book.deliver(stalled, delivery(0))  # the stalled server wakes up: its copy is dropped
    assert book.duplicates == 1


def test_with_no_other_server_a_slow_batch_is_waited_for_and_nothing_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One server, slow: there is nobody to hedge with, so its batches are not offered
    again (to itself) and nothing is logged; the wait ends at ``timeout``."""
    book = Book(first=0, num_batches=4, window=8)
    only = Held()
    assert book.claim(only, 2, never) == [0, 1]
    with pytest.raises(UnavailableError, match="timeout="):
        book.take(0, timeout=HEDGE_MIN_S + 1, retry_timeout=60, check=lambda: None)
    assert "to the other servers with room" not in caplog.text
    book.deliver(only, delivery(0))
    assert take(book, 0) == 0
    assert book.claim(only, 2, never) == [2]  # batch 1 is still its own, and only its own


def test_a_slow_batch_goes_only_to_a_server_with_room(caplog: pytest.LogCaptureFixture) -> None:
    """The other server holds all it may (its credit): it is offered the slow batches only
    once it has room, and then takes them."""
    book = Book(first=0, num_batches=6, window=8)
    stalled, busy = Held(), Held()
    assert book.claim(stalled, 2, never) == [0, 1]
    assert book.claim(busy, 2, never) == [2, 3]
    with pytest.raises(UnavailableError, match="timeout="):
        book.take(0, timeout=HEDGE_MIN_S + 1, retry_timeout=60, check=lambda: None)
    assert "to the other servers with room" not in caplog.text
    for index in (2, 3):
        book.deliver(busy, delivery(index))  # now it has room
    done = threading.Event()

    def serve_busy() -> None:
        while (batches := book.claim(busy, 2, done.is_set)) is not None:
            for index in batches:
                book.deliver(busy, delivery(index))

    thread = threading.Thread(target=serve_busy, daemon=True)
    thread.start()
    try:
        assert [take(book, k) for k in range(6)] == list(range(6))
    finally:
        done.set()
        thread.join(5)
    assert caplog.text.count("to the other servers with room") == 1


def test_one_stalled_server_is_waited_for_not_asked_twice(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The only server stops for longer than the hedge wait, then goes on: the epoch is
    exact, no batch came twice, and the client logged nothing about hedging."""
    caplog.set_level(logging.INFO, logger="batchwire.client")
    options: dict[str, Any] = {
        "dataset": "shapes",
        "pipeline": "val",
        "batch_size": 8,
        "params": {"size": 32},
        "drop_last": False,
        "return_ids": True,
    }
    with serve_process(data_dir, tmp_path / "a.log") as a:
        ids: list[int] = []
        resume = threading.Timer(HEDGE_MIN_S + 1.5, a.process.send_signal, (signal.SIGCONT,))
        try:
            with RemoteLoader(a.address, **options) as loader:
                for n, (_, _, batch_ids) in enumerate(loader):
                    ids += batch_ids.tolist()
                    if n == 10:
                        a.process.send_signal(signal.SIGSTOP)
                        resume.start()
                assert loader._pass is not None and loader._pass.book.duplicates == 0
        finally:
            resume.cancel()
            a.process.send_signal(signal.SIGCONT)
        assert ids == Plan(num_samples=520, batch_size=8, drop_last=False).share().tolist()
    assert "to the other servers with room" not in caplog.text


def test_a_stalled_server_process_does_not_stall_the_epoch(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGSTOP one of two server processes mid-epoch: the epoch completes exactly, long
    before the loader's timeout, from the other server, which is offered the batches the
    stalled one holds."""
    caplog.set_level(logging.WARNING, logger="batchwire.client")
    options: dict[str, Any] = {
        "dataset": "shapes",
        "pipeline": "val",
        "batch_size": 8,
        "params": {"size": 32},
        "drop_last": False,
        "return_ids": True,
        "timeout": 120,
    }
    with (
        serve_process(data_dir, tmp_path / "a.log") as a,
        serve_process(data_dir, tmp_path / "b.log") as b,
    ):
        ids: list[int] = []
        try:
            with RemoteLoader([a.address, b.address], **options) as loader:
                for n, (_, _, batch_ids) in enumerate(loader):
                    ids += batch_ids.tolist()
                    if n == 10:
                        a.process.send_signal(signal.SIGSTOP)
        finally:
            a.process.send_signal(signal.SIGCONT)
        assert ids == Plan(num_samples=520, batch_size=8, drop_last=False).share().tolist()
    assert "batches it holds to the other servers with room" in caplog.text


def samples_sent(server: BatchwireServer) -> float:
    registry = server.metrics.registry
    return sum(
        sample.value
        for metric in registry.collect()
        if metric.name == "batchwire_samples_sent"
        for sample in metric.samples
        if sample.name == "batchwire_samples_sent_total"
    )


def test_a_server_that_joins_the_name_mid_epoch_takes_batches(
    data_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = start_server(data_dir, host="127.0.0.1")
    port = first.port
    # The name's answer, as a DNS server would change it when a server joins.
    answer = ["127.0.0.1"]
    resolve = socket.getaddrinfo

    def getaddrinfo(host: Any, service: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "fleet.test":
            return resolve(host, service, *args, **kwargs)
        family, kind = socket.AF_INET, socket.SOCK_STREAM
        return [(family, kind, 6, "", (ip, int(service))) for ip in answer]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    joined: BatchwireServer | None = None
    ids: list[int] = []
    try:
        loader = RemoteLoader(
            f"dns:///fleet.test:{port}",
            dataset="shapes",
            pipeline="val",
            batch_size=4,
            shuffle=False,
            drop_last=False,
            return_ids=True,
            params={"size": 32},
            resolve_every=0.1,
        )
        with loader:
            for n, (_, _, batch_ids) in enumerate(loader):
                ids += batch_ids.tolist()
                if n == 5:
                    joined = start_server(data_dir, host="127.0.0.2", port=port)
                    answer.append("127.0.0.2")
                if joined is not None and samples_sent(joined) == 0:
                    time.sleep(0.02)  # a slow trainer, so the epoch outlasts the join
        assert joined is not None and samples_sent(joined) > 0, "the new server took no batch"
        assert ids == list(range(520))  # the same sequence, whoever carried the batches
    finally:
        first.stop(grace=1.0)
        if joined is not None:
            joined.stop(grace=1.0)


def test_pull_requests_are_validated(server: BatchwireServer) -> None:
    share = pb.StreamBatchesRequest(dataset="shapes", pipeline="val", batch_size=8)
    plan = Plan(num_samples=520, batch_size=8)
    cases = [
        ([pb.PullRequest(batches=[0])], grpc.StatusCode.INVALID_ARGUMENT, "first PullRequest"),
        (
            [pb.PullRequest(stream=share, batches=[plan.num_batches])],
            grpc.StatusCode.INVALID_ARGUMENT,
            f"batch {plan.num_batches} is not in this share",
        ),
        (
            [pb.PullRequest(stream=share), pb.PullRequest(stream=share)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "only the first PullRequest",
        ),
        (
            [pb.PullRequest(stream=pb.StreamBatchesRequest(**{**kw, "lanes": 2}))]
            if (kw := {"dataset": "shapes", "pipeline": "val", "batch_size": 8})
            else [],
            grpc.StatusCode.INVALID_ARGUMENT,
            "names batches, not lanes",
        ),
        (
            [pb.PullRequest(stream=share, batches=[0] * 1025)],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "at most 1024",
        ),
    ]
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.BatchwireStub(channel)
        for requests, code, message in cases:
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.PullBatches(iter(requests), timeout=60))
            assert caught.value.code() == code, caught.value.details()
            assert message in (caught.value.details() or "")
        # Batches come back in the order asked, and the stream ends when the client
        # half-closes.
        asked = [7, 3, 64, 0]
        batches = list(stub.PullBatches(iter([pb.PullRequest(stream=share, batches=asked)])))
        assert [b.index for b in batches] == asked
        for b in batches:
            assert list(b.ids) == plan.batch(b.index).ids.tolist()


def test_a_drain_ends_a_pulled_stream_that_asks_for_nothing(data_dir: pathlib.Path) -> None:
    """A client waiting on other servers asks this one for nothing; a drain still ends its
    stream with UNAVAILABLE (which the client resumes elsewhere), not at the grace period."""
    server = start_server(data_dir)
    share = pb.StreamBatchesRequest(dataset="shapes", pipeline="val", batch_size=8)
    stop = threading.Event()

    def requests() -> Iterator[pb.PullRequest]:
        yield pb.PullRequest(stream=share, batches=[0])
        stop.wait(60)  # holds the request stream open, asking for nothing more

    try:
        with grpc.insecure_channel(server.target, options=CHANNEL_OPTIONS) as channel:
            call = pb_grpc.BatchwireStub(channel).PullBatches(requests(), timeout=60)
            assert next(call).index == 0
            server.engine.drain()
            with pytest.raises(grpc.RpcError) as caught:
                next(call)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in (caught.value.details() or "")
    finally:
        stop.set()
        server.stop(grace=1.0)


def test_a_stream_batches_lane_is_not_held_to_the_pull_ahead_limit(
    server: BatchwireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StreamBatches asks for its lane's batches through the pull path, all at open; the
    limit on batches asked for ahead is a pulling client's, not the lane's."""
    from batchwire.server.serving import _servicer

    monkeypatch.setattr(_servicer, "MAX_PULL_AHEAD", 4)
    share = {"dataset": "shapes", "pipeline": "val", "batch_size": 8, "shuffle": True}
    plan = Plan(num_samples=520, batch_size=8, start=20)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.BatchwireStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            asked = pb.PullRequest(stream=pb.StreamBatchesRequest(**share), batches=range(5))
            list(stub.PullBatches(iter([asked]), timeout=60))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        request = pb.StreamBatchesRequest(**share, lanes=2, lane=1, start=20)
        batches = list(stub.StreamBatches(request, timeout=60))
    # The lane's batches from the cursor on, in order, with the ids the plan gives them.
    lane = [b for b in plan.batches() if b.index % 2 == 1]
    assert [b.index for b in batches] == [b.index for b in lane] == list(range(3, 65, 2))
    for got, planned in zip(batches, lane, strict=True):
        assert list(got.ids) == planned.ids.tolist() and got.cursor == planned.end
