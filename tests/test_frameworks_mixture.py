"""A mixture of datasets under the frameworks trainers use: Lightning with StatefulDataLoader
workers and accelerate's recipe on two gloo ranks launched by a real torchrun, and a
StatefulDataLoader with workers in a trainer process. Each rank gets exactly its planned
share of every epoch of the mixture, and a resume continues it exactly.

The mixture: ``shapes`` (520 samples, the session's dataset) and ``extra`` (60) weighted
0.75/0.25 over an epoch of 580: 435 of shapes (a different subset each epoch) and 145 of
extra (each sample twice or three times). A rank's share: 290 positions, 18 batches of 16.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import start_server
from processes import Target, in_trainer_process
from test_frameworks import (
    BATCH,
    CUTS,
    KILL_AFTER,
    LIGHTNING_VARIANTS,
    SANITY_BATCHES,
    SAVE_AFTER,
    SEED,
    SMALL,
    WORLD,
    Batches,
    Checks,
    check_finished,
    check_killed,
    latest_checkpoint,
    passes,
    plan_batches,
    records,
    stateful_resume,
    torchrun,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from batchwire.client import Mixture, RemoteLoader
from batchwire.common.mixture import batch_schedule, mixture_counts, source_seed
from batchwire.common.stream import Source, StreamSpec
from batchwire.server import BatchwireServer
from batchwire.server.data import ingest, write_image_folders

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.timeout(600)]

WEIGHTS = {"shapes": 0.75, "extra": 0.25}
MIXTURE = ",".join(f"{name}={weight}" for name, weight in WEIGHTS.items())
SIZES = (520, 60)
COUNTS = mixture_counts(SIZES, weights=list(WEIGHTS.values()))


@pytest.fixture(scope="module")
def mixed_server(
    data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BatchwireServer]:
    """A server of ``shapes`` (the session's, linked) and ``extra``."""
    root = tmp_path_factory.mktemp("frameworks-mixture")
    (root / "datasets").mkdir()
    (root / "datasets" / "shapes").symlink_to(data_dir / "shapes", target_is_directory=True)
    write_image_folders(root / "extra", per_class=15, size=48, seed=9)
    ingest(root / "extra", root / "datasets", name="extra", shard_size=32)
    server = start_server(root / "datasets")
    yield server
    server.stop(grace=1.0)


def mixed_batches(
    epoch: int,
    rank: int = 0,
    *,
    world: int = WORLD,
    batch: int = BATCH,
    shuffle: bool = True,
    drop_last: bool = True,
) -> Batches:
    """Rank ``rank``'s share of epoch ``epoch`` of the mixture, in batches."""
    sources = tuple(Source(name, count) for name, count in zip(WEIGHTS, COUNTS, strict=True))
    return plan_batches(
        epoch,
        rank,
        world=world,
        batch=batch,
        shuffle=shuffle,
        sources=sources,
        sizes=SIZES,
        drop_last=drop_last,
    )


def per_source_batches(
    epoch: int,
    rank: int = 0,
    *,
    world: int = WORLD,
    batch: int = BATCH,
    shuffle: bool = True,
    drop_last: bool = True,
) -> Batches:
    """The same, batched per source: each source's share as a mixture of itself alone with
    its own seed, its batches in the order of the batch schedule."""
    plans = [
        StreamSpec(
            sources=(Source(name, count),),
            batch_size=batch,
            seed=source_seed(SEED, source),
            epoch=epoch,
            shuffle=shuffle,
            drop_last=drop_last,
            rank=rank,
            world_size=world,
        ).plan([size])
        for source, (name, count, size) in enumerate(zip(WEIGHTS, COUNTS, SIZES, strict=True))
    ]
    parts = [
        iter([(plan.batch(k).ids + sum(SIZES[:s])).tolist() for k in range(plan.num_batches)])
        for s, plan in enumerate(plans)
    ]
    schedule = batch_schedule(SEED, epoch, [plan.num_batches for plan in plans], shuffle)
    return [next(parts[s]) for s in schedule.tolist()]


PLANS = {"random": mixed_batches, "per_source": per_source_batches}


def check_mixed_validation(
    checks: Checks, run: str, rank: int, seen: list[Any], plan: Any = mixed_batches
) -> None:
    val = plan(0, rank, shuffle=False, drop_last=False)  # the same every epoch
    for p in seen:
        if p.kind == "sanity":
            checks.batches(f"{run} rank {rank} sanity check", p.batches, val[:SANITY_BATCHES])
        elif p.kind == "val":
            checks.batches(f"{run} rank {rank} validation in epoch {p.epoch}", p.batches, val)


@pytest.mark.parametrize("batching", list(PLANS))
def test_lightning_resumes_a_mixture_exactly(
    mixed_server: BatchwireServer, tmp_path: pathlib.Path, batching: str
) -> None:
    """Lightning with StatefulDataLoader workers, killed 3 steps after a checkpoint in epoch
    1 and fitted again from it: each rank trained its share of epochs 0 and 1, once, whether
    batches mix the sources or each is of one."""
    every, kill_at, expected_step, expected_epoch = CUTS["mid-epoch"]
    plan = PLANS[batching]
    # The checkpoint at step 20 lies in epoch 1: 18 batches an epoch, 13 + 4 per source.
    assert len(plan(0)) == {"random": 18, "per_source": 17}[batching]
    args = [
        *("--target", mixed_server.target, "--batch-size", str(BATCH), "--seed", str(SEED)),
        *("--dataset", MIXTURE, "--batching", batching),
        *LIGHTNING_VARIANTS["stateful-2"],
    ]
    first = torchrun(
        "lightning_job.py",
        tmp_path,
        *args,
        *("--checkpoint-every", str(every), "--kill-at-step", str(kill_at)),
    )
    checks = Checks()
    check_killed(checks, tmp_path, "first", first)
    found = latest_checkpoint(tmp_path / "checkpoints")
    assert found is not None, f"no checkpoint in {tmp_path / 'checkpoints'}{first.tail()}"
    checkpoint, checkpoint_step = found
    assert checkpoint_step == expected_step, f"latest checkpoint {checkpoint.name}{first.tail()}"
    checks.true(f"epoch={expected_epoch}" in checkpoint.name, f"checkpoint {checkpoint.name}")
    second = torchrun(
        "lightning_job.py", tmp_path, *args, "--records", "resumed", "--resume", str(checkpoint)
    )
    check_finished(checks, tmp_path, "resumed", second)
    for rank in range(WORLD):
        whole = plan(0, rank) + plan(1, rank)
        before = records(tmp_path, "first", rank)
        after = records(tmp_path, "resumed", rank)
        head = [r.ids for r in before if r.kind == "train" and r.step < checkpoint_step]
        tail = [r.ids for r in after if r.kind == "train"]
        checks.true(len(head) == checkpoint_step, f"rank {rank} trained {len(head)} before")
        checks.batches(f"rank {rank} trained up to the checkpoint + after", head + tail, whole)
        check_mixed_validation(checks, "first", rank, passes(before), plan)
        check_mixed_validation(checks, "resumed", rank, passes(after), plan)
    checks.verify()


def test_accelerate_recipe_resumes_a_mixture_exactly(
    mixed_server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    """accelerate's recipe: epoch 0 as planned, a state saved in epoch 1, a crash, and the
    rest of epoch 1 after load_state."""
    args = [
        *("--target", mixed_server.target, "--batch-size", str(BATCH), "--seed", str(SEED)),
        *("--dataset", MIXTURE),
    ]
    first = torchrun(
        "accelerate_job.py",
        tmp_path,
        *args,
        *("--save-epoch", "1", "--save-after", str(SAVE_AFTER), "--kill-after", str(KILL_AFTER)),
    )
    checks = Checks()
    check_killed(checks, tmp_path, "first", first)
    assert (tmp_path / "state").is_dir(), f"no saved state{first.tail()}"
    second = torchrun("accelerate_job.py", tmp_path, *args, "--records", "resumed", "--resume")
    check_finished(checks, tmp_path, "resumed", second)
    for rank in range(WORLD):
        before = records(tmp_path, "first", rank)
        after = records(tmp_path, "resumed", rank)
        epoch0 = [r.ids for r in before if r.epoch == 0]
        checks.batches(f"rank {rank} epoch 0", epoch0, mixed_batches(0, rank))
        killed = [r.ids for r in before if r.epoch == 1]
        checks.batches(
            f"rank {rank} epoch 1 to the kill", killed, mixed_batches(1, rank)[:KILL_AFTER]
        )
        tail = [r.ids for r in after]
        checks.batches(f"rank {rank} after load_state", tail, mixed_batches(1, rank)[SAVE_AFTER:])
    checks.verify()


def test_stateful_dataloader_workers_resume_a_mixture(mixed_server: BatchwireServer) -> None:
    """StatefulDataLoader with 2 workers: its state after 7 batches resumes a new one at
    the rest of the epoch, then the next epoch."""
    in_trainer_process(stateful_workers_resume_a_mixture, Target(mixed_server.target))


def stateful_workers_resume_a_mixture(server: Target) -> None:
    def loader() -> StatefulDataLoader:  # type: ignore[type-arg]
        remote = RemoteLoader(
            server.target,
            dataset=Mixture(WEIGHTS),
            pipeline="val",
            batch_size=32,
            seed=SEED,
            params=SMALL,
            return_ids=True,
            drop_last=True,
        )
        return StatefulDataLoader(remote, batch_size=None, num_workers=2)

    whole = mixed_batches(0, world=1, batch=32)
    head, rest, after = stateful_resume(loader, 7)
    checks = Checks(world=1, batch=32)
    checks.batches("the first 7 batches", head, whole[:7])
    checks.batches("the pass after loading the state", rest, whole[7:])
    checks.batches("the pass after that", after, mixed_batches(1, world=1, batch=32))
    checks.verify()
