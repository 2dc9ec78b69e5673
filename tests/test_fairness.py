"""The server's pipelines are shared fairly: by streams, by measured cost, without starving.

The policy (``FairQueue``) is tested on its own, driven step by step as a pipeline slot
drives it, with each key's cost per batch given: no timing is involved. The whole path is
tested on a real engine with DALI on the CPU, with several pipelines at once.
"""

from __future__ import annotations

import collections
import pathlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from batchwire.common.stream import StreamSpec
from batchwire.server import ServerConfig
from batchwire.server.engine import BatchStream, Engine
from batchwire.server.runners import Batch, Job, RunnerKey
from batchwire.server.scheduling import Ticket
from batchwire.server.scheduling._fair import FairQueue


def key(pipeline: str = "train", size: float = 32) -> RunnerKey:
    return RunnerKey(pipeline, (("size", size),), "uint8", "NCHW", 8, "cpu", None)


class Stream:
    """A ticket's stream of one-sample batches (the slot here only takes them, in turn)."""

    def read(self, seq: int) -> Job:
        return Job(seq=seq, ids=np.arange(1), images=[np.zeros(1, np.uint8)], labels=np.zeros(1))

    def finish(self, batch: Batch) -> Batch:
        return batch


class Requests:
    """The scheduler's request side over a FairQueue, without its pipeline threads."""

    def __init__(self, fair: FairQueue) -> None:
        self.fair = fair

    def request(self, ticket: Ticket, room: int, *, more: int = 0) -> None:
        if not ticket.closed:
            self.fair.ask(ticket, room, more)

    def forget(self, ticket: Ticket) -> None:
        self.fair.close(ticket)


class Slot:
    """Drives a FairQueue as one pipeline slot does; every stream's client takes each batch
    at once (asks for the next), unless it is paused."""

    def __init__(self, costs: dict[RunnerKey, float]) -> None:
        self.fair = FairQueue()
        self.requests = Requests(self.fair)
        self.costs = costs
        self.served: collections.Counter[Ticket] = collections.Counter()
        self.paused: set[Ticket] = set()
        self.current: RunnerKey | None = None

    def open(self, k: RunnerKey, window: int = 4) -> Ticket:
        ticket = Ticket(k, 10**9, Stream(), window, self.requests)
        self.fair.open(ticket)
        ticket.start(0)
        return ticket

    def run(self, batches: int) -> list[Ticket]:
        order = []
        for _ in range(batches):
            chosen = self.fair.choose(None, (), self.current)
            assert chosen is not None, "a stream asks and no key is chosen"
            self.current = chosen
            taken = self.fair.take(chosen)
            assert taken is not None
            ticket = taken[0]
            self.fair.measured(chosen, self.costs[chosen])
            self.served[ticket] += 1
            order.append(ticket)
            if ticket not in self.paused:
                ticket.more()
        return order


def test_streams_of_one_key_take_turns_one_batch_each() -> None:
    slot = Slot({key(): 0.02})
    tickets = [slot.open(key()) for _ in range(5)]
    order = slot.run(50)
    for turn in range(10):
        assert set(order[turn * 5 : turn * 5 + 5]) == set(tickets), turn


def test_time_is_shared_by_streams_so_a_lone_stream_of_another_key_gets_its_share() -> None:
    job, val = key("train", 64), key("val", 224)
    slot = Slot({job: 0.02, val: 0.02})
    ranks = [slot.open(job) for _ in range(8)]
    alone = slot.open(val)
    slot.run(900)
    assert all(abs(slot.served[rank] - 100) <= 3 for rank in ranks), slot.served
    assert abs(slot.served[alone] - 100) <= 3


def test_a_key_that_costs_twice_as_much_gets_half_the_batches_for_the_same_time() -> None:
    cheap, dear = key("train", 64), key("val", 224)
    slot = Slot({cheap: 0.02, dear: 0.04})
    ranks = [slot.open(cheap) for _ in range(4)]
    alone = slot.open(dear)
    slot.run(1000)  # 4 shares of cheap batches, one of dear ones: 4 * 2x + x = 1000
    assert all(abs(slot.served[rank] - 222) <= 4 for rank in ranks), slot.served
    assert abs(slot.served[alone] - 111) <= 4


def test_a_key_that_comes_late_gets_its_share_at_once_and_no_more() -> None:
    first, late = key("train", 64), key("train", 96)
    slot = Slot({first: 0.02, late: 0.02})
    slot.open(first)
    slot.run(500)  # alone: every batch is the early stream's
    joined = slot.open(late)
    order = slot.run(100)
    assert abs(order.count(joined) - 50) <= 1, order.count(joined)


def test_a_stream_that_asked_for_nothing_a_while_earns_no_credit() -> None:
    k = key()
    slot = Slot({k: 0.02})
    slot.open(k)
    idle = slot.open(k)
    slot.paused.add(idle)  # its client takes nothing: it asks for no more after its window
    slot.run(104)
    slot.paused.clear()
    idle.more()  # its client comes back
    order = slot.run(100)
    assert abs(order.count(idle) - 50) <= 1, order.count(idle)


def test_a_slot_keeps_its_key_on_a_tie_and_leaves_it_once_another_is_behind() -> None:
    a, b = key("train", 64), key("train", 96)
    slot = Slot({a: 0.02, b: 0.02})
    slot.open(a)
    slot.open(b)
    fair = slot.fair
    assert fair.choose(None, (), a) == a  # level: the key it runs wins
    assert fair.choose(None, (), b) == b
    assert fair.choose(None, (b,), None) == b  # ... or one it has built
    fair.take(a)
    assert fair.choose(None, (), a) == b
    assert fair.choose(None, (a,), None) == b  # built or not


def test_a_closed_stream_is_never_taken_and_its_key_goes_with_its_last_stream() -> None:
    k = key()
    slot = Slot({k: 0.02})
    gone, kept = slot.open(k), slot.open(k)
    gone.close()
    assert set(slot.run(8)) == {kept}
    kept.close()
    assert slot.fair.keys(None) == []
    assert slot.fair.queued() == {}


# -- a real engine, several pipelines at once ------------------------------------------


@pytest.fixture
def engine(data_dir: pathlib.Path) -> Iterator[Engine]:
    engine = Engine(ServerConfig(data_dir=data_dir, device="cpu", num_threads=1))
    engine.open_datasets()
    yield engine
    engine.close()


def batches_taken_together(streams: list[BatchStream], enough: int, *, timeout: float) -> list[int]:
    """Each stream taken by a thread of its own until they have handed out ``enough``
    batches in all (within ``timeout`` seconds), then closed: the batches each gave."""
    counts = [0] * len(streams)
    reached = threading.Event()
    lock = threading.Lock()

    def consume(index: int) -> None:
        for _ in streams[index]:
            with lock:
                counts[index] += 1
                if sum(counts) >= enough:
                    reached.set()
            if reached.is_set():
                return

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(streams))]
    try:
        for thread in threads:
            thread.start()
        assert reached.wait(timeout), counts
    finally:
        for stream in streams:
            stream.close()
        for thread in threads:
            thread.join(30)
    return counts


def test_several_pipelines_at_once_every_stream_gets_a_fair_part(engine: Engine) -> None:
    """A job's 4 ranks, a val pass, a job at another size and one with other crop
    parameters share the server's 2 pipelines: no stream waits while the others run."""
    groups = [
        *[("train", {"size": 32})] * 4,
        ("val", {"size": 32, "resize": 40}),
        ("train", {"size": 48}),
        ("train", {"size": 32, "area_min": 0.5}),
    ]
    streams = [
        engine.open_stream(
            StreamSpec(dataset="shapes", pipeline=name, batch_size=4, seed=i, params=params)
        )
        for i, (name, params) in enumerate(groups)
    ]
    counts = batches_taken_together(streams, 400, timeout=120)  # an epoch: 130 batches
    assert min(counts) * 4 >= max(counts), counts
    sums, waits = engine.scheduler.stats.snapshot()
    assert {p for (field, p) in sums if field == "builds"} == {"train", "val"}
    assert waits["val"][0] >= counts[4]  # every batch taken was counted with its wait
