"""What a pass is, what a state holds, and the loader's life cycle, against a real server.

The rule (README: Training frameworks): each iter() is a pass. After load_state_dict
it resumes the saved epoch at the saved position; after set_epoch(e) it starts epoch
e; otherwise it starts the epoch after the previous pass's, complete or not.
"""

from __future__ import annotations

import gc
import io
import os
import pathlib
import pickle
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
import torch.utils.data
from processes import Target, in_trainer_process

from batchwire.client import BatchwireError, InvalidArgumentError, RemoteLoader
from batchwire.client._transport import GrpcTransport, Server
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer

BATCH = 40  # 520 samples: 13 batches on one rank, 6 on each of two


def make(server: BatchwireServer | Target, **kwargs: object) -> RemoteLoader:
    options: dict[str, object] = {
        "dataset": "shapes",
        "pipeline": "val",
        "batch_size": BATCH,
        "return_ids": True,
        "params": {"size": 32},
        "seed": 7,
    }
    options.update(kwargs)
    return RemoteLoader(server.target, **options)  # type: ignore[arg-type]


def expected(epoch: int, rank: int = 0, world_size: int = 1) -> list[int]:
    plan = Plan(
        num_samples=520,
        batch_size=BATCH,
        seed=7,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        drop_last=False,  # the loader's default, as torch's
    )
    return plan.share().tolist()


def ids_of(iterable: object) -> list[int]:
    return [int(i) for _, _, batch in iterable for i in batch]  # type: ignore[attr-defined]


def take(iterator: object, batches: int) -> list[int]:
    return [int(i) for _ in range(batches) for i in next(iterator)[2]]  # type: ignore[call-overload]


def test_each_iter_is_a_pass_and_a_pass_left_early_counts(server: BatchwireServer) -> None:
    loader = make(server)
    for _ in range(3):
        iter(loader)  # never advanced: no pass
    first = iter(loader)
    assert take(first, 2) == expected(0)[: 2 * BATCH]
    assert ids_of(loader) == expected(1)  # a new pass: the next epoch, complete
    with pytest.raises(BatchwireError, match="newer iter") as caught:
        next(first)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ids_of(loader) == expected(2)
    loader.close()


def test_set_epoch_chooses_the_next_pass(server: BatchwireServer) -> None:
    loader = make(server)
    loader.set_epoch(5)
    assert loader.epoch == 5
    head = take(iter(loader), 1)
    loader.set_epoch(5)  # no state was loaded: epoch 5 again, from its start
    assert ids_of(loader) == expected(5)
    assert head == expected(5)[:BATCH]
    assert loader.epoch == 6
    loader.close()


def _metric(server: BatchwireServer, name: str) -> float:
    """The server's ``name`` metric, summed over its labels."""
    return sum(
        sample.value
        for family in server.metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    )


def _settled(server: BatchwireServer, name: str, value: float) -> float:
    """``name`` once it is ``value`` (the server counts a stream as it opens or ends it,
    after the client's call returns), or as it is after 60 s."""
    deadline = time.monotonic() + 60
    while _metric(server, name) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return _metric(server, name)


STARTED = "batchwire_streams_started_total"
ACTIVE = "batchwire_active_streams"


def test_the_next_epoch_is_asked_for_before_this_one_ends(server: BatchwireServer) -> None:
    """A loader iterated again has the next epoch's first batches on their way as a pass
    ends, and the next iter() takes that pass rather than opening another."""
    started, active = _metric(server, STARTED), _metric(server, ACTIVE)
    loader = make(server)
    assert ids_of(loader) == expected(0)
    # A loader's first pass looks nowhere ahead: it may be its only one.
    assert _settled(server, STARTED, started + 1) == started + 1
    assert ids_of(loader) == expected(1)
    # Epoch 1's stream, and epoch 2's, opened as epoch 1's last batches were asked for.
    assert _settled(server, STARTED, started + 3) == started + 3
    assert loader.state_dict()["epoch"] == 2  # nothing of epoch 2 counted yet
    assert ids_of(loader) == expected(2)
    # Epoch 2 was the stream already open; epoch 3's opened the same way.
    assert _settled(server, STARTED, started + 4) == started + 4
    loader.close()
    assert _settled(server, ACTIVE, active) == active  # the one ahead ended too


def test_a_pass_other_than_the_one_started_ahead_stops_that_one(
    server: BatchwireServer,
) -> None:
    started, active = _metric(server, STARTED), _metric(server, ACTIVE)
    loader = make(server)
    assert ids_of(loader) + ids_of(loader) == expected(0) + expected(1)
    loader.set_epoch(5)
    assert ids_of(loader) == expected(5)  # not epoch 2's stream, which was opened ahead
    # Epochs 0, 1, 2 (ahead, then stopped), 5 and 6 (ahead).
    assert _settled(server, STARTED, started + 5) == started + 5
    # A pass left mid-way stops the pass it started ahead; the state loaded resumes.
    state = loader.state_dict()
    iterator = iter(loader)
    assert take(iterator, 5) == expected(6)[: 5 * BATCH]  # the rest is asked for
    del iterator  # left before its end: epoch 7, started ahead, is not the next pass
    assert _settled(server, ACTIVE, active) == active
    loader.load_state_dict(state)
    assert ids_of(loader) == expected(6)
    loader.close()
    assert _settled(server, ACTIVE, active) == active


def test_a_pass_left_in_a_process_that_imported_accelerate_stops(
    server: BatchwireServer,
) -> None:
    """The check for accelerate's wrappers (made once accelerate.data_loader is imported)
    looks into accelerate's frames only: a snapshot of the caller's variables would keep
    the iterator it dropped, and its streams, alive."""
    pytest.importorskip("accelerate.data_loader")
    active = _metric(server, ACTIVE)
    loader = make(server)
    loader.set_epoch(3)
    iterator = iter(loader)
    assert take(iterator, 2) == expected(3)[: 2 * BATCH]
    del iterator  # left before its end: its stream and the one ahead end
    assert _settled(server, ACTIVE, active) == active
    loader.close()


def test_a_state_saved_on_one_rank_loads_on_every_rank(server: BatchwireServer) -> None:
    saver = make(server, rank=0, world_size=2)
    saver.set_epoch(1)
    iterator = iter(saver)
    take(iterator, 2)
    # Through a checkpoint file: plain data, loadable with torch.load's weights_only default.
    buffer = io.BytesIO()
    torch.save(saver.state_dict(), buffer)
    saver.close()
    buffer.seek(0)
    state = torch.load(buffer)
    assert (state["epoch"], state["cursor"], state["world_size"]) == (1, 2 * BATCH, 2)
    for rank in range(2):
        resumed = make(server, rank=rank, world_size=2)
        resumed.load_state_dict(state)
        assert ids_of(resumed) == expected(1, rank, 2)[2 * BATCH :]
        assert ids_of(resumed) == expected(2, rank, 2)
        resumed.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dataset": "other"}, "dataset='other'"),
        ({"seed": 8}, "seed=8"),
        ({"batch_size": 20}, "batch_size=20.*elastic_batch_size=True"),
        ({"drop_last": True}, "drop_last=True"),
        ({"shuffle": False}, "shuffle=False"),
        ({"version": 99}, "state version 99"),
    ],
)
def test_a_state_of_another_job_is_refused(
    server: BatchwireServer, change: dict[str, object], message: str
) -> None:
    state = {**make(server).state_dict(), **change}
    with pytest.raises(InvalidArgumentError, match=message):
        make(server).load_state_dict(state)


def test_a_cursor_outside_the_share_is_refused_when_the_pass_starts(
    server: BatchwireServer,
) -> None:
    loader = make(server)
    loader.load_state_dict({**loader.state_dict(), "cursor": 10_000})
    with pytest.raises(InvalidArgumentError, match="start must be a cursor"):
        next(iter(loader))


def test_a_state_after_the_last_batch_is_the_start_of_the_next_epoch(
    server: BatchwireServer,
) -> None:
    # Lightning counts batches by len() and never asks past the last one: its checkpoint
    # at an epoch's end is taken here, and the pass it starts next must be a whole epoch.
    loader = make(server)
    iterator = iter(loader)
    whole = take(iterator, len(loader))  # the last batch, not yet StopIteration
    during = loader.state_dict()
    assert list(iterator) == []
    after = loader.state_dict()
    assert whole == expected(0)
    assert (during["epoch"], during["cursor"]) == (after["epoch"], after["cursor"]) == (1, 0)
    resumed = make(server)
    resumed.load_state_dict({**during, "epoch": 0, "cursor": 13 * BATCH})  # the same place
    assert resumed.epoch == 0
    assert ids_of(resumed) == expected(1)
    resumed.load_state_dict(after)
    assert ids_of(resumed) == expected(1)


class StepFailed(Exception):
    """A training step that raised."""


def _raise_in_with(loader: RemoteLoader) -> None:
    # As a script writes it: the handler outside the with block saves the state.
    with pytest.raises(StepFailed), loader:
        for step, _ in enumerate(loader):
            if step == 4:
                raise StepFailed


def _break(loader: RemoteLoader) -> None:
    for step, _ in enumerate(loader):
        if step == 4:
            break


def _close(loader: RemoteLoader) -> None:
    iterator = iter(loader)
    take(iterator, 5)
    loader.close()  # the iterator is still referenced: close() stops its pass


LEAVE = {"a step raised inside with": _raise_in_with, "break": _break, "close()": _close}


@pytest.mark.parametrize("leave", sorted(LEAVE))
def test_a_state_saved_after_a_pass_is_left_resumes_the_rest_of_its_epoch(
    server: BatchwireServer, leave: str
) -> None:
    """Five batches of epoch 2 handed out, then the pass left: by an exception inside the
    loader's with block (a preemption or error handler saves the checkpoint after it), by
    break, or by close(). The state is of the last batch handed out, as torchdata's
    StatefulDataLoader gives after its iterator is left, and a fresh loader delivers
    exactly the rest of epoch 2, in order, then epoch 3."""
    loader = make(server)
    loader.set_epoch(2)
    LEAVE[leave](loader)
    state = loader.state_dict()
    assert (state["epoch"], state["cursor"]) == (2, 5 * BATCH)
    assert loader.epoch == 2
    loader.close()
    assert loader.state_dict() == state  # closing again changes nothing
    resumed = make(server)
    resumed.load_state_dict(state)
    assert ids_of(resumed) == expected(2)[5 * BATCH :]
    assert ids_of(resumed) == expected(3)
    resumed.close()


def test_a_state_saved_after_the_next_pass_began_is_that_passs_place(
    server: BatchwireServer,
) -> None:
    """A pass left mid-epoch stays the state until the next iter() is first advanced: then
    the state is that pass's, the next epoch (each iter() is a pass)."""
    loader = make(server)
    take(iter(loader), 3)
    assert (loader.state_dict()["epoch"], loader.state_dict()["cursor"]) == (0, 3 * BATCH)
    iterator = iter(loader)  # not advanced: no pass began
    assert loader.state_dict()["cursor"] == 3 * BATCH
    take(iterator, 2)
    state = loader.state_dict()
    assert (state["epoch"], state["cursor"]) == (1, 2 * BATCH)
    loader.close()
    resumed = make(server)
    resumed.load_state_dict(state)
    assert ids_of(resumed) == expected(1)[2 * BATCH :]
    resumed.close()


def test_a_loader_pickles_and_its_copy_streams_the_same(server: BatchwireServer) -> None:
    loader = make(server)
    copy = pickle.loads(pickle.dumps(loader))
    assert ids_of(copy) == expected(0)
    assert ids_of(loader) == expected(0)  # a copy has a position of its own
    assert ids_of(copy) == expected(1)


def test_a_copy_keeps_its_dataloader_workers_to_itself(server: BatchwireServer) -> None:
    in_trainer_process(a_copy_keeps_its_dataloader_workers_to_itself, Target(server.target))


def a_copy_keeps_its_dataloader_workers_to_itself(server: Target) -> None:
    # As in a spawned DDP rank: a copy of the loader, then forked DataLoader workers.
    loader = make(server)
    copy = pickle.loads(pickle.dumps(loader))
    data = torch.utils.data.DataLoader(copy, batch_size=None, num_workers=2)
    assert ids_of(data) == expected(0)
    assert ids_of(data) == expected(1)
    assert loader.state_dict()["epoch"] == 0  # the original's position is its own


FORKS = 60


def test_the_first_calls_of_forked_processes_are_answered(server: BatchwireServer) -> None:
    in_trainer_process(first_calls_of_forked_processes_are_answered, Target(server.target))


def first_calls_of_forked_processes_are_answered(server: Target) -> None:
    # As a rank that described its dataset, then forks DataLoader workers which describe it
    # at once on connections of their own (the loader's transport; a RemoteLoader makes the
    # same call a little later, after resolving its address). gRPC's handling of the fork
    # ended about one in seven such first calls before the server answered ("Stream
    # removed"), until the client's channels let gRPC make them again.
    target = Server(server.target)
    rank = GrpcTransport()
    failed = []
    for _ in range(FORKS):
        rank.describe(target, "shapes", timeout=30).result()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                GrpcTransport().describe(target, "shapes", timeout=30).result()
                answer = "answered"
            except BaseException as exc:
                answer = f"{type(exc).__name__}: {exc}"
            os.write(write, answer.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as child:
            answer = child.read().decode()
        os.waitpid(pid, 0)
        if answer != "answered":
            failed.append(answer)
    assert not failed, f"{len(failed)} of {FORKS} forked processes: {failed[:3]}"


@pytest.mark.slow
def test_a_copy_whose_workers_are_spawned_keeps_a_position_of_its_own(
    server: BatchwireServer,
) -> None:
    # As in a rank of torch.multiprocessing.spawn, where DataLoader workers are spawned
    # too (a spawned process's default): the rank's copy of the loader, its original gone.
    loader = make(server)
    copy = pickle.loads(pickle.dumps(loader))
    del loader
    gc.collect()  # the original's ledger file goes with it
    data = torch.utils.data.DataLoader(
        copy, batch_size=None, num_workers=2, multiprocessing_context="spawn"
    )
    assert ids_of(data) == expected(0)
    assert ids_of(data) == expected(1)


@pytest.mark.slow
def test_spawned_dataloader_workers_deliver_advancing_epochs(server: BatchwireServer) -> None:
    loader = make(server)
    data = torch.utils.data.DataLoader(
        loader,
        batch_size=None,
        num_workers=2,
        multiprocessing_context="spawn",
        persistent_workers=True,  # spawned once: each spawn imports torch anew
    )
    assert ids_of(data) == expected(0)
    assert ids_of(data) == expected(1)
    with pytest.raises(InvalidArgumentError, match="StatefulDataLoader"):
        loader.state_dict()  # the position is in the workers: refused, not guessed
    loader.set_epoch(4)
    assert loader.state_dict()["epoch"] == 4


def test_close_stops_and_joins_the_readers(server: BatchwireServer) -> None:
    loader = make(server, prefetch=4)
    iterator = iter(loader)
    take(iterator, 1)
    assert any(t.name.startswith("batchwire-pull") for t in threading.enumerate())
    loader.close()
    assert not any(t.name.startswith("batchwire-pull") for t in threading.enumerate())
    with pytest.raises(BatchwireError, match="close") as caught:
        next(iterator)
    assert caught.value.code == grpc.StatusCode.CANCELLED
    assert len(ids_of(loader)) == 13 * BATCH  # a closed loader iterates again


SCRIPTS = {
    "iterator left running": "iterator = iter(loader); next(iterator)",
    "closed under a live iterator": "iterator = iter(loader); next(iterator); loader.close()",
    "DataLoader workers left running": (
        "import torch.utils.data as d\n"
        "iterator = iter(d.DataLoader(loader, batch_size=None, num_workers=2))\n"
        "next(iterator)"
    ),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "name",
    [
        # One script in plain pytest; the others (each a process importing torch, one with
        # DataLoader workers of its own) in the full suite.
        name if name == "iterator left running" else pytest.param(name, marks=pytest.mark.slow)
        for name in sorted(SCRIPTS)
    ],
)
def test_a_process_exits_cleanly_whatever_it_leaves_running(
    server: BatchwireServer, tmp_path: pathlib.Path, name: str
) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import sys\n"
        "from batchwire.client import RemoteLoader\n"
        "loader = RemoteLoader(sys.argv[1], dataset='shapes', pipeline='train', batch_size=64,\n"
        "                      params={'size': 32}, prefetch=4)\n" + SCRIPTS[name] + "\n"
    )
    # CI runs each twice; BATCHWIRE_EXIT_RUNS=20 makes it a soak.
    for _ in range(int(os.environ.get("BATCHWIRE_EXIT_RUNS", "2"))):
        done = subprocess.run(
            [sys.executable, str(script), server.target],
            capture_output=True,
            text=True,
            timeout=300,  # a hang guard: importing torch alone took 50 s on a loaded slow host
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Traceback" not in done.stderr, done.stderr[-2000:]


_LEDGER_OF_A_LOADER = """
import glob, os, sys, tempfile
from batchwire.client import RemoteLoader
loader = RemoteLoader(sys.argv[1], dataset="shapes", batch_size=8)
for batch in loader:
    break  # a pass began: the loader's ledger file is in use
shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
print(*glob.glob(f"{shm}/batchwire-loader-{os.getpid()}-*"), flush=True)
sys.stdin.read()  # until killed
"""


def _loader_process(target: str) -> tuple[subprocess.Popen[str], str]:
    """A process whose loader began a pass and waits on its stdin; its ledger file's path."""
    process = subprocess.Popen(
        [sys.executable, "-c", _LEDGER_OF_A_LOADER, target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    (path,) = process.stdout.readline().split()
    return process, path


@pytest.mark.slow
def test_a_killed_loaders_file_does_not_outlive_the_next_loader(server: BatchwireServer) -> None:
    """A loader killed with SIGKILL leaves its ledger file behind (no finalizer runs); the
    next process that makes a loader removes it."""
    trainer, path = _loader_process(server.target)
    assert os.path.exists(path)
    trainer.kill()
    trainer.wait(60)
    assert os.path.exists(path)  # SIGKILL: nothing removed it
    survivor, own = _loader_process(server.target)
    try:
        assert not os.path.exists(path) and os.path.exists(own)
    finally:
        survivor.stdin.close()  # type: ignore[union-attr]
        survivor.wait(60)
    assert not os.path.exists(own)  # a clean exit removes its own
