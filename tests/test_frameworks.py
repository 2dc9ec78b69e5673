"""RemoteLoader driven by the frameworks trainers use: Lightning and accelerate jobs on two
gloo ranks launched by a real torchrun (tests/frameworks/), and torch and torchdata
DataLoaders in this process.

The contract checked everywhere:

* The ids a rank gets in data epoch ``e`` are ``Plan(epoch=e, rank=r, world_size=W).share()``
  cut into batches in that order; rank and world size come from torch.distributed when
  iteration starts, even for a loader made before it was initialized.
* Every pass that is actually iterated starts a new data epoch: the epoch after the previous
  pass's (finished or abandoned), unless ``set_epoch(e)`` chose ``e`` or a loaded state
  resumes its epoch at its position. So Lightning's sanity check takes 2 batches of val data
  epoch 0 and every real validation run gets a whole share.
* A state saved on rank 0 (as Lightning and accelerate save it) resumes every rank exactly;
  one from another dataset, seed or batch size is refused; one from a job of another world
  size resumes the epoch at the same global position (the client guide: Elastic resume).

Each job rank appends what it saw to JSON lines (frameworks/recording.py); the checks here
collect every mismatch of a launch before failing, and describe what was received instead
(``share[32:256] of epoch 0, rank 0 of 2``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.data
from conftest import start_server
from processes import Target, in_trainer_process
from torchdata.stateful_dataloader import StatefulDataLoader

from batchwire.client import RemoteLoader
from batchwire.common.stream import Source, StreamSpec
from batchwire.server import BatchwireServer

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.timeout(600)]

JOBS = pathlib.Path(__file__).parent / "frameworks"
NUM_SAMPLES = 520  # conftest's "shapes"
WORLD = 2
BATCH = 16  # a rank's share of an epoch: 260 ids, 16 batches of 16 (drop_last, as trained)
SEED = 7
SMALL = {"size": 32}
SANITY_BATCHES = 2  # Lightning's num_sanity_val_steps default
LAUNCH_TIMEOUT = 240.0  # one torchrun; a healthy one takes well under a minute

Batches = list[list[int]]


# -- the expected order --------------------------------------------------------------------


def plan_batches(
    epoch: int,
    rank: int = 0,
    *,
    world: int = WORLD,
    batch: int = BATCH,
    shuffle: bool = True,
    sources: tuple[Source, ...] = (),
    sizes: tuple[int, ...] = (NUM_SAMPLES,),
    drop_last: bool = True,
) -> Batches:
    """Rank ``rank``'s share of data epoch ``epoch`` of ``shapes`` (or of the mixture of
    ``sources`` of ``sizes``), in batches (full ones, as the jobs train, unless
    ``drop_last=False``, as they validate)."""
    spec = StreamSpec(
        **({"sources": sources} if sources else {"dataset": "shapes"}),
        batch_size=batch,
        seed=SEED,
        epoch=epoch,
        shuffle=shuffle,
        drop_last=drop_last,
        rank=rank,
        world_size=world,
    )
    plan = spec.plan(list(sizes) if sources else sizes[0])
    return [plan.batch(k).ids.tolist() for k in range(plan.num_batches)]


def flat(batches: Iterable[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def describe(batches: Batches, *, world: int = WORLD, batch: int = BATCH) -> str:
    """What ``batches`` holds, as pieces of shares: of data epochs 0-4 (or in id order), for
    rank r of ``world`` or of 1. ``share[32:256] of epoch 0, rank 0 of 2``."""
    ids = flat(batches)
    if not ids:
        return "nothing"
    candidates = []
    for size in sorted({world, 1}, reverse=True):
        for shuffle in (True, False):
            for epoch in range(5 if shuffle else 1):
                for rank in range(size):
                    share = flat(
                        plan_batches(epoch, rank, world=size, batch=batch, shuffle=shuffle)
                    )
                    what = f"epoch {epoch}" if shuffle else "id order"
                    label = f"{what}, rank {rank} of {size}"
                    candidates.append((label, share, {i: n for n, i in enumerate(share)}))
    pieces: list[str] = []
    unknown = 0
    at = 0
    while at < len(ids):
        best = (0, "", 0)
        for label, share, positions in candidates:
            start = positions.get(ids[at])
            if start is None:
                continue
            n = 0
            while at + n < len(ids) and start + n < len(share) and share[start + n] == ids[at + n]:
                n += 1
            if n > best[0]:
                best = (n, label, start)
        n, label, start = best
        if n == 0:
            unknown += 1
            at += 1
            continue
        if unknown:
            pieces.append(f"{unknown} ids of no share")
            unknown = 0
        pieces.append(f"share[{start}:{start + n}] of {label}")
        at += n
    if unknown:
        pieces.append(f"{unknown} ids of no share")
    if len(pieces) > 4:
        pieces = [*pieces[:4], f"{len(pieces) - 4} more pieces"]
    sizes = sorted({len(b) for b in batches})
    return f"{len(batches)} batches of {sizes} ids: " + " + ".join(pieces)


class Checks:
    """Collects every mismatch, so that one launch reports all of them at once."""

    def __init__(self, world: int = WORLD, batch: int = BATCH) -> None:
        self.problems: list[str] = []
        self.misbehaved: list[Launch] = []  # whose output tails go with the report
        self.world = world
        self.batch = batch

    def batches(self, what: str, got: Batches, expected: Batches) -> None:
        if got != expected:
            self.problems.append(
                f"{what}: got {describe(got, world=self.world, batch=self.batch)}; expected "
                f"{describe(expected, world=self.world, batch=self.batch)}"
            )

    def true(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def launch(self, launch: Launch, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)
            self.misbehaved.append(launch)

    def disjoint(self, what: str, shares: list[Batches]) -> None:
        ids = [flat(share) for share in shares]
        self.true(
            len({len(i) for i in ids}) == 1,
            f"{what}: ranks got {[len(i) for i in ids]} ids, not the same number",
        )
        for a in range(len(ids)):
            for b in range(a + 1, len(ids)):
                common = set(ids[a]) & set(ids[b])
                self.true(not common, f"{what}: ranks {a} and {b} share {len(common)} ids")

    def verify(self) -> None:
        tails = "".join(launch.tail() for launch in self.misbehaved)
        assert not self.problems, "\n".join(self.problems) + tails


# -- launching and reading jobs ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str
    returncode: int
    output: str

    def tail(self, chars: int = 6000, rank_lines: int = 30) -> str:
        """The output's end, and before it each rank's last lines: the rank that failed
        first is often not the one whose traceback ends the output."""
        ranks: dict[str, list[str]] = {}
        for line in self.output.splitlines():
            match = re.match(r"\[(rank\d+)\]:", line)
            if match:
                ranks.setdefault(match.group(1), []).append(line)
        per_rank = "".join(
            f"\n--- {self.name}, {rank}'s last lines:\n" + "\n".join(lines[-rank_lines:])
            for rank, lines in sorted(ranks.items())
        )
        return (
            f"{per_rank}\n--- {self.name} exited {self.returncode}; output tail:\n"
            f"{self.output[-chars:]}"
        )


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants, parents before children (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            after_name = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(after_name[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def torchrun(
    script: str,
    out: pathlib.Path,
    *args: str,
    timeout: float = LAUNCH_TIMEOUT,
    world: int = WORLD,
) -> Launch:
    """Run ``frameworks/script`` on ``world`` gloo ranks with torchrun (--standalone: a free
    port); kill torchrun, its ranks and their DataLoader workers if it runs past
    ``timeout`` seconds.

    The script's options must not abbreviate one of torchrun's (argparse reads ``--run`` as
    ``--run-path`` even after the script's name): hence ``--records``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={world}",
        str(JOBS / script),
        "--out",
        str(out),
        *args,
    ]
    name = " ".join([script, *args])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out.mkdir(parents=True, exist_ok=True)
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun starts every rank in a session of its own, so no process group holds
            # them all: kill the tree by id, children first (a killed rank's workers would
            # otherwise be handed to init, out of reach), torchrun last.
            for pid in reversed(descendants(process.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.kill()
            output, _ = process.communicate()
            launch = Launch(name, process.returncode, output)
            pytest.fail(f"{name} did not finish within {timeout:.0f}s{launch.tail()}")
    return Launch(name, process.returncode, output)


@dataclasses.dataclass(frozen=True)
class Record:
    kind: str  # "train", "val" or "sanity"
    epoch: int  # the trainer's epoch
    step: int  # Lightning: global step before the batch; accelerate: batches before it
    ids: list[int]


@dataclasses.dataclass(frozen=True)
class Pass:
    kind: str
    epoch: int
    batches: Batches


def records(out: pathlib.Path, run: str, rank: int) -> list[Record]:
    path = out / f"{run}-rank{rank}.jsonl"
    if not path.exists():
        return []
    return [Record(**json.loads(line)) for line in path.read_text().splitlines()]


def passes(rows: list[Record]) -> list[Pass]:
    """Consecutive records of one kind and trainer epoch, as passes."""
    result: list[Pass] = []
    for row in rows:
        if result and (result[-1].kind, result[-1].epoch) == (row.kind, row.epoch):
            result[-1].batches.append(row.ids)
        else:
            result.append(Pass(row.kind, row.epoch, [row.ids]))
    return result


def event(out: pathlib.Path, run: str, rank: int, name: str) -> dict[str, Any] | None:
    path = out / f"{run}-rank{rank}-{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def check_finished(
    checks: Checks, out: pathlib.Path, run: str, launch: Launch, world: int = WORLD
) -> None:
    missing = [r for r in range(world) if event(out, run, r, "finished") is None]
    checks.launch(
        launch,
        launch.returncode == 0 and not missing,
        f"{run}: exited {launch.returncode}, ranks {missing} did not finish",
    )


def check_killed(
    checks: Checks, out: pathlib.Path, run: str, launch: Launch, world: int = WORLD
) -> None:
    missing = [r for r in range(world) if event(out, run, r, "killed") is None]
    checks.launch(
        launch,
        launch.returncode != 0 and not missing,
        f"{run}: exited {launch.returncode}, ranks {missing} did not reach the kill",
    )


def common_args(server: BatchwireServer) -> list[str]:
    return ["--target", server.target, "--batch-size", str(BATCH), "--seed", str(SEED)]


# -- Lightning ------------------------------------------------------------------------------

LIGHTNING_VARIANTS = {
    "loader": [],
    "dataloader-0": ["--wrap", "dataloader", "--workers", "0"],
    "dataloader-2": ["--wrap", "dataloader", "--workers", "2"],
    "stateful-0": ["--wrap", "stateful", "--workers", "0"],
    "stateful-2": ["--wrap", "stateful", "--workers", "2"],
    # Ranks that take a trainer on another host's path: images on bulk connections.
    "stateful-2-bulk": ["--wrap", "stateful", "--workers", "2"],
    # Not a classifier: training steps on DINO's views, through StatefulDataLoader workers.
    "multicrop-stateful-2": [
        "--train-pipeline",
        "multicrop",
        "--wrap",
        "stateful",
        "--workers",
        "2",
    ],
}
# The same every epoch; every sample, the last batch short (the loader's default).
VAL = [plan_batches(0, rank, shuffle=False, drop_last=False) for rank in range(WORLD)]


def check_validation(checks: Checks, run: str, rank: int, seen: list[Pass]) -> None:
    """The sanity check takes the first batches of a val share; every validation run after
    it gets the whole share (shuffle=False: every epoch's share is in id order)."""
    for p in seen:
        if p.kind == "sanity":
            expected = VAL[rank][:SANITY_BATCHES]
            checks.batches(f"{run} rank {rank} sanity check", p.batches, expected)
        elif p.kind == "val":
            checks.batches(f"{run} rank {rank} validation in epoch {p.epoch}", p.batches, VAL[rank])


@pytest.fixture(scope="module")
def remote_server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    """A server whose trainers here take a trainer on another host's path (no shared
    memory): their images come on bulk connections."""
    server = start_server(data_dir, shared_memory=False)
    yield server
    server.stop(grace=1.0)


@pytest.mark.parametrize("variant", list(LIGHTNING_VARIANTS))
def test_lightning_epochs_follow_the_plan(
    server: BatchwireServer, tmp_path: pathlib.Path, variant: str, request: pytest.FixtureRequest
) -> None:
    """Two epochs of DDP with the loader made before torch.distributed: train epoch t is
    data epoch t of the rank's share, the sanity check takes 2 val batches and every
    validation after it the whole val share."""
    bulk = variant.endswith("-bulk")
    if bulk:
        server = request.getfixturevalue("remote_server")
    launch = torchrun(
        "lightning_job.py", tmp_path, *common_args(server), *LIGHTNING_VARIANTS[variant]
    )
    checks = Checks()
    check_finished(checks, tmp_path, "first", launch)
    trained: dict[int, list[Batches]] = {0: [], 1: []}
    for rank in range(WORLD):
        seen = passes(records(tmp_path, "first", rank))
        layout = [(p.kind, p.epoch) for p in seen]
        expected_layout = [("sanity", 0), ("train", 0), ("val", 0), ("train", 1), ("val", 1)]
        checks.true(layout == expected_layout, f"rank {rank} passes were {layout}")
        check_validation(checks, "first", rank, seen)
        for epoch in (0, 1):
            train = [p.batches for p in seen if (p.kind, p.epoch) == ("train", epoch)]
            got = train[0] if train else []
            checks.batches(f"rank {rank} train epoch {epoch}", got, plan_batches(epoch, rank))
            trained[epoch].append(got)
        checks.true(
            trained[0][rank] != trained[1][rank], f"rank {rank}: epoch 1 repeats epoch 0's order"
        )
    for epoch in (0, 1):
        checks.disjoint(f"train epoch {epoch}", trained[epoch])
    if bulk:
        labels = {"dataset": "shapes", "pipeline": "train"}
        moved = server.metrics.registry.get_sample_value("batchwire_bulk_bytes_total", labels)
        checks.true(bool(moved), "the ranks' images did not come on bulk connections")
    checks.verify()


# (checkpoint every N train steps, kill at step, the last checkpoint's step, its epoch). An
# epoch is 16 steps. Mid-epoch: checkpoints at 5..20, killed at 23, 3 steps after the one
# at 20, 4 batches into epoch 1. At an epoch's end: the checkpoint at step 16 is taken
# after epoch 0's last batch, which Lightning (counting by len) never asks beyond.
CUTS = {"mid-epoch": (5, 23, 20, 1), "epoch-end": (16, 19, 16, 0)}


def latest_checkpoint(directory: pathlib.Path) -> tuple[pathlib.Path, int] | None:
    found = []
    for path in directory.glob("*.ckpt"):
        match = re.search(r"step=(\d+)", path.name)
        if match:
            found.append((int(match.group(1)), path))
    if not found:
        return None
    step, path = max(found)
    return path, step


@pytest.mark.parametrize(
    ("variant", "cut"),
    [
        ("loader", "mid-epoch"),
        ("stateful-0", "mid-epoch"),
        ("stateful-2", "mid-epoch"),
        ("loader", "epoch-end"),
        ("stateful-2", "epoch-end"),
    ],
)
def test_lightning_resumes_exactly(
    server: BatchwireServer, tmp_path: pathlib.Path, variant: str, cut: str
) -> None:
    """A job killed a few steps after a checkpoint, fitted again from it: what was trained
    up to the checkpoint and after the resume is epochs 0 and 1, once, on each rank.
    (A plain DataLoader is not checkpointed by Lightning, so it is not resumed here.)"""
    every, kill_at, expected_step, expected_epoch = CUTS[cut]
    args = [*common_args(server), *LIGHTNING_VARIANTS[variant]]
    first = torchrun(
        "lightning_job.py",
        tmp_path,
        *args,
        "--checkpoint-every",
        str(every),
        "--kill-at-step",
        str(kill_at),
    )
    checks = Checks()
    check_killed(checks, tmp_path, "first", first)
    found = latest_checkpoint(tmp_path / "checkpoints")
    assert found is not None, f"no checkpoint in {tmp_path / 'checkpoints'}{first.tail()}"
    checkpoint, checkpoint_step = found
    assert checkpoint_step == expected_step, f"latest checkpoint {checkpoint.name}{first.tail()}"
    checks.true(
        f"epoch={expected_epoch}" in checkpoint.name,
        f"the checkpoint at step {expected_step} is {checkpoint.name}",
    )

    second = torchrun(
        "lightning_job.py", tmp_path, *args, "--records", "resumed", "--resume", str(checkpoint)
    )
    check_finished(checks, tmp_path, "resumed", second)
    whole = {rank: plan_batches(0, rank) + plan_batches(1, rank) for rank in range(WORLD)}
    trained: dict[int, list[Batches]] = {0: [], 1: []}
    for rank in range(WORLD):
        before = records(tmp_path, "first", rank)
        after = records(tmp_path, "resumed", rank)
        head = [r.ids for r in before if r.kind == "train" and r.step < checkpoint_step]
        tail = [r.ids for r in after if r.kind == "train"]
        checks.true(
            len(head) == checkpoint_step,
            f"rank {rank} trained {len(head)} batches before step {checkpoint_step}",
        )
        checks.batches(f"rank {rank} trained after the resume", tail, whole[rank][len(head) :])
        checks.batches(
            f"rank {rank} trained up to the checkpoint + after", head + tail, whole[rank]
        )
        check_validation(checks, "first", rank, passes(before))
        check_validation(checks, "resumed", rank, passes(after))
        checks.true(
            any(p.kind == "val" for p in passes(after)),
            f"rank {rank}: no validation after the resume",
        )
        epochs = head + tail
        per_epoch = len(plan_batches(0, rank))
        trained[0].append(epochs[:per_epoch])
        trained[1].append(epochs[per_epoch:])
    for epoch in (0, 1):
        checks.disjoint(f"train epoch {epoch}", trained[epoch])
    checks.verify()


# -- accelerate -----------------------------------------------------------------------------

SAVE_AFTER = 5  # batches of epoch 1
KILL_AFTER = 7


def test_accelerate_recipe_resumes_exactly(server: BatchwireServer, tmp_path: pathlib.Path) -> None:
    """The recipe (loader on accelerator.device, register_for_checkpointing, iterated
    directly): epochs follow the plan on both ranks, and save_state mid-epoch, a crash and
    load_state in a new run continue exactly where the state was saved."""
    args = common_args(server)
    first = torchrun(
        "accelerate_job.py",
        tmp_path,
        *args,
        "--save-epoch",
        "1",
        "--save-after",
        str(SAVE_AFTER),
        "--kill-after",
        str(KILL_AFTER),
    )
    checks = Checks()
    check_killed(checks, tmp_path, "first", first)
    assert (tmp_path / "state").is_dir(), f"no saved state{first.tail()}"
    second = torchrun("accelerate_job.py", tmp_path, *args, "--records", "resumed", "--resume")
    check_finished(checks, tmp_path, "resumed", second)
    trained: dict[int, list[Batches]] = {0: [], 1: []}
    for rank in range(WORLD):
        before = records(tmp_path, "first", rank)
        after = records(tmp_path, "resumed", rank)
        epoch0 = [r.ids for r in before if r.epoch == 0]
        checks.batches(f"rank {rank} epoch 0", epoch0, plan_batches(0, rank))
        killed = [r.ids for r in before if r.epoch == 1]
        checks.true(len(killed) == KILL_AFTER, f"rank {rank} trained {len(killed)} of epoch 1")
        checks.batches(
            f"rank {rank} epoch 1 up to the kill", killed, plan_batches(1, rank)[:KILL_AFTER]
        )
        checks.true(
            all(r.epoch == 1 for r in after), f"rank {rank} resumed into {[r.epoch for r in after]}"
        )
        tail = [r.ids for r in after]
        checks.batches(f"rank {rank} after load_state", tail, plan_batches(1, rank)[SAVE_AFTER:])
        epoch1 = killed[:SAVE_AFTER] + tail
        checks.batches(f"rank {rank} epoch 1 saved + resumed", epoch1, plan_batches(1, rank))
        checks.true(epoch0 != epoch1, f"rank {rank}: epoch 1 repeats epoch 0's order")
        trained[0].append(epoch0)
        trained[1].append(epoch1)
    for epoch in (0, 1):
        checks.disjoint(f"epoch {epoch}", trained[epoch])
    checks.verify()


def test_accelerate_prepare_is_refused_on_every_rank(
    server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    """The supported recipe is not to prepare() the loader: with accelerate's defaults, every
    rank raises InvalidArgumentError naming register_for_checkpointing (and none hangs)."""
    launch = torchrun(
        "accelerate_job.py", tmp_path, *common_args(server), "--mode", "prepare", timeout=180
    )
    checks = Checks()
    checks.true(launch.returncode != 0, "accelerator.prepare(DataLoader(loader)) ran to the end")
    for rank in range(WORLD):
        error = event(tmp_path, "first", rank, "error")
        finished = event(tmp_path, "first", rank, "finished")
        got = f"finished after {finished['batches']} batches" if finished else "no outcome"
        checks.true(error is not None, f"rank {rank} raised nothing ({got})")
        if error is None:
            continue
        checks.true(
            error["type"] == "InvalidArgumentError",
            f"rank {rank} raised {error['type']}: {error['message']}",
        )
        checks.true(
            "register_for_checkpointing" in error["message"],
            f"rank {rank}'s error does not mention register_for_checkpointing: {error['message']}",
        )
    checks.true(
        "register_for_checkpointing" in launch.output,
        "register_for_checkpointing is not in the job's output",
    )
    assert not checks.problems, "\n".join(checks.problems) + launch.tail()


# -- torch DataLoader and torchdata StatefulDataLoader in this process -------------------

LOCAL_BATCH = 32  # one process: 16 batches of 32 per epoch


def local_loader(server: BatchwireServer | Target, **kwargs: Any) -> RemoteLoader:
    options: dict[str, Any] = {
        "dataset": "shapes",
        "pipeline": "val",
        "batch_size": LOCAL_BATCH,
        "seed": SEED,
        "params": SMALL,
        "return_ids": True,
        "drop_last": True,  # full batches, as training in workers takes them
    }
    options.update(kwargs)
    return RemoteLoader(server.target, **options)


def local_plan(epoch: int) -> Batches:
    return plan_batches(epoch, 0, world=1, batch=LOCAL_BATCH)


def one_pass(data: Iterable[Any], limit: int | None = None) -> Batches:
    """The ids of one pass (of its first ``limit`` batches)."""
    got: Batches = []
    for _, _, ids in data:
        got.append(ids.tolist())
        if len(got) == limit:
            break
    return got


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh-workers"])
def test_dataloader_workers_advance_an_epoch_per_pass(
    server: BatchwireServer, persistent: bool
) -> None:
    """Workers stream in order, every pass a whole epoch, and without set_epoch each pass is
    the next data epoch, whether the workers persist or are started again."""
    in_trainer_process(
        dataloader_workers_advance_an_epoch_per_pass, Target(server.target), persistent
    )


def dataloader_workers_advance_an_epoch_per_pass(server: Target, persistent: bool) -> None:
    remote = local_loader(server)
    data = torch.utils.data.DataLoader(
        remote, batch_size=None, num_workers=2, persistent_workers=persistent
    )
    checks = Checks(world=1, batch=LOCAL_BATCH)
    seen = [one_pass(data) for _ in range(3)]
    for epoch, got in enumerate(seen):
        checks.batches(f"pass {epoch}", got, local_plan(epoch))
    checks.true(len({str(s) for s in seen}) == 3, "passes repeat an order")
    del data
    remote.close()
    checks.verify()


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """Through torch.save and torch.load (weights_only, torch's default), as a checkpoint."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer)
    return loaded


def stateful_resume(
    make: Callable[[], StatefulDataLoader],
    cut: int,  # type: ignore[type-arg]
) -> tuple[Batches, Batches, Batches]:
    """The first ``cut`` batches of a StatefulDataLoader ``make`` gives, then, in a new one
    loaded with its state (through a checkpoint), the rest of that pass and the next."""
    first = make()
    head = one_pass(first, limit=cut)
    state = roundtrip(first.state_dict())
    del first  # its workers end with it
    second = make()
    second.load_state_dict(state)
    rest = one_pass(second)
    return head, rest, one_pass(second)


STATEFUL_CUTS: list[int | str] = [1, 7, 16, "finished"]  # batches of 16, or to StopIteration


@pytest.mark.parametrize("cut", STATEFUL_CUTS, ids=lambda cut: f"cut-{cut}")
@pytest.mark.parametrize("workers", [0, 2], ids=lambda n: f"workers-{n}")
def test_stateful_dataloader_resumes_from_its_own_state(
    server: BatchwireServer, workers: int, cut: int | str
) -> None:
    """A StatefulDataLoader's state after ``cut`` batches (or after the pass ended) resumes a
    new one exactly: the rest of epoch 0, then epoch 1. After the last batch, with or
    without StopIteration, the state is the start of epoch 1 (see test_passes)."""
    if workers:  # forked
        in_trainer_process(stateful_dataloader_resumes, Target(server.target), workers, cut)
    else:
        stateful_dataloader_resumes(server, workers, cut)


def stateful_dataloader_resumes(
    server: BatchwireServer | Target, workers: int, cut: int | str
) -> None:
    whole = local_plan(0)
    first_remote = local_loader(server)
    first = StatefulDataLoader(first_remote, batch_size=None, num_workers=workers)
    if cut == "finished":
        head = one_pass(first)
    else:
        assert isinstance(cut, int)
        head = one_pass(first, limit=cut)
    state = roundtrip(first.state_dict())
    del first  # its workers end with it
    first_remote.close()

    second_remote = local_loader(server)
    second = StatefulDataLoader(second_remote, batch_size=None, num_workers=workers)
    second.load_state_dict(state)
    resumed = one_pass(second)
    after = one_pass(second)
    checks = Checks(world=1, batch=LOCAL_BATCH)
    if cut in ("finished", len(whole)):
        checks.batches("the pass before the state", head, whole)
        checks.batches("the pass after loading a state at the epoch's end", resumed, local_plan(1))
        checks.batches("the pass after that", after, local_plan(2))
    else:
        checks.batches(f"the first {cut} batches", head, whole[:cut])
        checks.batches(f"the pass after loading the state after {cut}", resumed, whole[cut:])
        checks.batches("the pass after that", after, local_plan(1))
    del second
    second_remote.close()
    checks.verify()


def test_stateful_dataloader_workers_carry_views_and_resume_them(server: BatchwireServer) -> None:
    """multicrop through a StatefulDataLoader's two workers: each batch its ten views (a
    list of tensors, as DINO's loop takes them), and a state after 5 batches resumes the
    rest of the epoch exactly, then the next."""
    in_trainer_process(stateful_views_resume, Target(server.target))


def stateful_views_resume(server: Target) -> None:
    sizes = {"global_size": 32, "local_size": 16}

    def make() -> StatefulDataLoader:  # type: ignore[type-arg]
        remote = local_loader(server, pipeline="multicrop", params=sizes)
        return StatefulDataLoader(remote, batch_size=None, num_workers=2)

    shapes = [(LOCAL_BATCH, 3, 32, 32)] * 2 + [(LOCAL_BATCH, 3, 16, 16)] * 8
    views, _, _ = next(iter(make()))
    checks = Checks(world=1, batch=LOCAL_BATCH)
    checks.true([tuple(v.shape) for v in views] == shapes, "the views' shapes")
    head, rest, after = stateful_resume(make, 5)
    checks.batches("the first 5 batches", head, local_plan(0)[:5])
    checks.batches("the pass after loading the state after 5", rest, local_plan(0)[5:])
    checks.batches("the pass after that", after, local_plan(1))
    checks.verify()


def test_lightning_epochs_cut_short_each_start_the_next_data_epoch(
    server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    """limit_train_batches leaves every pass early: the next trainer epoch still gets the
    next data epoch from its start, not the rest of the one that was cut."""
    import lightning.pytorch as pl

    seen: list[list[int]] = []

    class Recorded(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            images, labels, ids = batch
            seen.append(ids.tolist())
            features = images.flatten(1).float().mean(1, keepdim=True)
            return torch.nn.functional.mse_loss(self.head(features).squeeze(1), labels.float())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        limit_train_batches=5,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
    )
    remote = local_loader(server, pipeline="train")
    trainer.fit(Recorded(), train_dataloaders=remote)
    remote.close()
    checks = Checks(world=1, batch=LOCAL_BATCH)
    for epoch in range(3):
        checks.batches(
            f"trainer epoch {epoch}", seen[5 * epoch : 5 * epoch + 5], local_plan(epoch)[:5]
        )
    checks.true(len(seen) == 15, f"{len(seen)} batches trained, not 15")
    checks.verify()
