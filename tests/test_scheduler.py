"""Streams share the server's pipelines: a fixed number per device, taken in turn.

The policy is tested on the scheduler itself with a runner that returns each job as it
comes (so the order in which records are read is the order the scheduler chose), and the
whole path on a real engine with DALI on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from batchwire.common.stream import StreamSpec
from batchwire.server import BatchwireServer, ServerConfig
from batchwire.server.engine import Engine
from batchwire.server.runners import Batch, Job, RunnerKey, keep
from batchwire.server.scheduling import Scheduler, Ticket
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc


def key(batch_size: int = 4, pipeline: str = "train") -> RunnerKey:
    return RunnerKey(pipeline, (), "uint8", "NCHW", batch_size, "cpu", None)


class EchoRunner:
    """Returns every job as its result, in order: only the scheduler decides anything."""

    healthy = True

    def run(self, jobs: Iterator[Job], first: int = 0) -> Iterator[Batch]:
        for job in jobs:
            yield Batch(
                seq=job.seq, ids=job.ids, images=np.zeros((len(job.ids), 1)), labels=job.labels
            )


class Reads:
    """The streams of the tickets, recording the order in which batches were read."""

    def __init__(self) -> None:
        self.order: list[tuple[str, int]] = []
        self.fail: set[tuple[str, int]] = set()

    def of(self, name: str) -> Stream:
        return Stream(name, self)


@dataclasses.dataclass
class Stream:
    """A ticket's stream ``name``: its reads recorded in ``reads``, its batches handed out
    as they come (with images of their own)."""

    name: str
    reads: Reads

    def read(self, seq: int) -> Job:
        self.reads.order.append((self.name, seq))
        if (self.name, seq) in self.reads.fail:
            raise OSError(f"record of {self.name} batch {seq} unreadable")
        ids = np.arange(seq * 10, seq * 10 + 3)
        return Job(seq=seq, ids=ids, images=[np.zeros(1, np.uint8)] * 3, labels=ids)

    def finish(self, batch: Batch) -> Batch:
        return keep(batch)


@pytest.fixture
def held() -> Iterator[tuple[threading.Event, Scheduler]]:
    """A scheduler with one slot whose first pipeline build waits for the event."""
    release = threading.Event()

    def build(_: RunnerKey) -> EchoRunner:
        assert release.wait(30)
        return EchoRunner()

    scheduler = Scheduler(build, (None,), slots_per_device=1)  # type: ignore[arg-type]
    yield release, scheduler
    release.set()
    scheduler.close()


def take(ticket: Ticket, seq: int) -> Batch | None:
    """Batch ``seq`` of the ticket, once run; asks for one more, as a stream does."""
    result = ticket.future(seq).result(timeout=30)
    ticket.more()
    return result


def take_all(ticket: Ticket, count: int) -> list[int]:
    out = []
    for seq in range(count):
        result = take(ticket, seq)
        assert result is not None
        out += result.ids.tolist()
    return out


def test_streams_take_turns_one_batch_each_and_get_their_own_batches_in_order(
    held: tuple[threading.Event, Scheduler],
) -> None:
    release, scheduler = held
    reads = Reads()
    tickets = {name: scheduler.ticket(key(), 5, reads.of(name), window=3) for name in "abc"}
    for ticket in tickets.values():
        ticket.start(0)
    release.set()  # all three asked before the slot could take anything
    for ticket in tickets.values():
        assert take_all(ticket, 5) == [i for seq in range(5) for i in range(seq * 10, seq * 10 + 3)]
    first_round = reads.order[:9]
    assert first_round == [(name, seq) for seq in range(3) for name in "abc"], reads.order


def test_a_closed_stream_is_never_read_again(held: tuple[threading.Event, Scheduler]) -> None:
    release, scheduler = held
    reads = Reads()
    gone = scheduler.ticket(key(), 50, reads.of("gone"), window=8)
    kept = scheduler.ticket(key(), 4, reads.of("kept"), window=2)
    gone.start(0)
    kept.start(0)
    gone.close()
    release.set()
    assert len(take_all(kept, 4)) == 12
    assert [seq for name, seq in reads.order if name == "gone"] == []


def test_a_batch_that_cannot_be_read_fails_its_stream_only(
    held: tuple[threading.Event, Scheduler],
) -> None:
    release, scheduler = held
    reads = Reads()
    reads.fail.add(("bad", 1))
    bad = scheduler.ticket(key(), 3, reads.of("bad"), window=3)
    good = scheduler.ticket(key(), 3, reads.of("good"), window=3)
    bad.start(0)
    good.start(0)
    release.set()
    assert take(bad, 0) is not None
    with pytest.raises(OSError, match="bad batch 1 unreadable"):
        take(bad, 1)
    assert len(take_all(good, 3)) == 9


def test_a_pipeline_that_cannot_be_built_fails_its_streams_and_not_others() -> None:
    def build(k: RunnerKey) -> EchoRunner:
        if k.pipeline == "broken":
            raise RuntimeError("DALI cannot build this graph")
        return EchoRunner()

    scheduler = Scheduler(build, (None,), slots_per_device=1)  # type: ignore[arg-type]
    try:
        reads = Reads()
        broken = scheduler.ticket(key(pipeline="broken"), 2, reads.of("broken"), window=2)
        broken.start(0)
        with pytest.raises(RuntimeError, match="cannot build"):
            take(broken, 0)
        fine = scheduler.ticket(key(), 2, reads.of("fine"), window=2)
        fine.start(0)
        assert len(take_all(fine, 2)) == 6
    finally:
        scheduler.close()


def test_many_streams_share_one_pipeline_and_each_gets_its_exact_share(
    data_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(data_dir=data_dir, device="cpu", num_threads=1, pipelines_per_device=1)
    engine = Engine(config)
    engine.open_datasets()
    caplog.set_level(logging.INFO, logger="batchwire.server.scheduling._scheduler")
    try:
        requests = [
            StreamSpec(
                dataset="shapes", pipeline="val", batch_size=20, seed=5, rank=r, world_size=6
            )
            for r in range(6)
        ]
        streams = [engine.open_stream(request) for request in requests]
        got: dict[int, list[int]] = {}

        def consume(rank: int) -> None:
            got[rank] = [i for batch in streams[rank] for i in batch.ids.tolist()]

        threads = [threading.Thread(target=consume, args=(r,)) for r in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for rank, stream in enumerate(streams):
            expected = [i for b in stream.plan.batches() for i in b.ids.tolist()]
            assert got[rank] == expected, rank
            stream.close()
        shares = [set(ids) for ids in got.values()]
        assert sum(map(len, shares)) == len(set().union(*shares)), "the shares are disjoint"
        builds = [r for r in caplog.records if "building pipeline val" in r.getMessage()]
        assert len(builds) == 1, [r.getMessage() for r in builds]
    finally:
        engine.close()


def test_open_streams_hold_no_server_thread_each(server: BatchwireServer) -> None:
    """Streams waiting on the shared pipelines are awaited on the server's event loop: 24
    streams held open (each has had a batch) add no thread per stream."""
    request = pb.StreamBatchesRequest(
        dataset="shapes", pipeline="train", batch_size=8, epoch=31, params={"size": 32}
    )
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.BatchwireStub(channel)
        first = stub.StreamBatches(request, timeout=60)
        next(first)  # the server, the channel and gRPC's own threads are up
        before = threading.active_count()
        calls = [stub.StreamBatches(request, timeout=60) for _ in range(24)]
        for call in calls:
            assert len(next(call).ids) > 0  # every stream is open and has had a batch
        held = threading.active_count()
        for call in [first, *calls]:
            call.cancel()
    assert held - before < 8, f"{held - before} more threads for 24 open streams"
