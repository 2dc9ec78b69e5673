"""Elastic resume through the jobs users run: a job killed mid-epoch on 2 gloo ranks and
restarted from its last checkpoint on 3 (torchrun ``--nproc-per-node 3``) finishes the
epoch with no sample lost or repeated: a plain loop, Lightning DDP (``fit(ckpt_path=...)``),
accelerate (``save_state``/``load_state``), and torchdata's StatefulDataLoader in this
process. The launching and checking helpers are test_frameworks.py's.
"""

from __future__ import annotations

import collections
import pathlib
from typing import Any

import pytest
import torch
from processes import Target, in_trainer_process
from test_frameworks import (
    NUM_SAMPLES,
    SEED,
    Checks,
    check_finished,
    check_killed,
    flat,
    latest_checkpoint,
    plan_batches,
    records,
    roundtrip,
    torchrun,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from batchwire.client import RemoteLoader
from batchwire.common.sampler import epoch_order
from batchwire.server import BatchwireServer

pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.timeout(600)]


def check_once(checks: Checks, what: str, ids: list[int], expected: list[int]) -> None:
    counts = collections.Counter(ids)
    repeated = sorted(i for i, n in counts.items() if n > 1)
    lost = sorted(set(expected) - set(counts))
    checks.true(not repeated, f"{what}: {len(repeated)} ids repeated, e.g. {repeated[:5]}")
    checks.true(not lost, f"{what}: {len(lost)} ids lost, e.g. {lost[:5]}")
    extra = sorted(set(counts) - set(expected))
    checks.true(not extra, f"{what}: {len(extra)} ids not expected, e.g. {extra[:5]}")


def test_a_plain_torchrun_loop_killed_on_2_ranks_finishes_its_epoch_on_3(
    server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    """drop_last=False, 16 a batch: the checkpoint after step 5 holds 160 samples; the 360
    left split evenly over 3 ranks, so the epoch is every sample exactly once."""
    args = ["--target", server.target, "--batch-size", "16", "--seed", str(SEED)]
    first = torchrun(
        "elastic_job.py", tmp_path, *args, "--checkpoint-every", "5", "--kill-at-step", "7"
    )
    checks = Checks()
    check_killed(checks, tmp_path, "first", first)
    checks.verify()
    checkpoint = torch.load(tmp_path / "checkpoint.pt")
    assert checkpoint["step"] == 5
    assert (checkpoint["loader"]["position"], checkpoint["loader"]["world_size"]) == (160, 2)
    second = torchrun(
        "elastic_job.py",
        tmp_path,
        *args,
        "--records",
        "resumed",
        "--resume",
        str(tmp_path / "checkpoint.pt"),
        world=3,
    )
    check_finished(checks, tmp_path, "resumed", second, world=3)
    head = [r.ids for rank in range(2) for r in records(tmp_path, "first", rank) if r.step < 5]
    tails = [[r.ids for r in records(tmp_path, "resumed", rank)] for rank in range(3)]
    checks.true(
        len({len(tail) for tail in tails}) == 1,
        f"the 3 ranks got {[len(t) for t in tails]} batches, not the same number",
    )
    after = [batch for tail in tails for batch in tail]
    check_once(checks, "epoch 0 over both runs", flat(head + after), list(range(NUM_SAMPLES)))
    checks.verify()


def test_lightning_fitted_on_3_devices_from_a_checkpoint_of_2_continues_the_epoch(
    server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    """2 devices of 24 and 3 of 16 (the global batch held, so Lightning's count of the
    epoch's batches holds too): after the resume every global step is the undisturbed
    job's, epoch 0 is trained once over both runs, and epoch 1 is 3 ranks' plan."""
    common = ["--target", server.target, "--seed", str(SEED), "--elastic-batch-size"]
    first = torchrun(
        "lightning_job.py",
        tmp_path,
        *common,
        "--batch-size",
        "24",
        "--checkpoint-every",
        "3",
        "--kill-at-step",
        "4",
    )
    checks = Checks()
    check_killed(checks, tmp_path, "first", first)
    found = latest_checkpoint(tmp_path / "checkpoints")
    assert found is not None, f"no checkpoint{first.tail()}"
    checkpoint, step = found
    assert step == 3, checkpoint.name
    second = torchrun(
        "lightning_job.py",
        tmp_path,
        *common,
        "--batch-size",
        "16",
        "--records",
        "resumed",
        "--resume",
        str(checkpoint),
        world=3,
    )
    check_finished(checks, tmp_path, "resumed", second, world=3)
    before = [r for rank in range(2) for r in records(tmp_path, "first", rank)]
    after = [r for rank in range(3) for r in records(tmp_path, "resumed", rank)]
    head = [r.ids for r in before if r.kind == "train" and r.step < step]
    resumed = [r for r in after if r.kind == "train" and r.epoch == 0]
    undisturbed = [plan_batches(0, rank, world=2, batch=24) for rank in range(2)]
    steps = sorted({r.step for r in resumed})
    checks.true(steps == list(range(step, 10)), f"epoch 0 resumed at steps {steps}")
    for s in steps:
        got = sorted(flat(r.ids for r in resumed if r.step == s))
        checks.true(
            got == sorted(undisturbed[0][s] + undisturbed[1][s]),
            f"global step {s} after the resume is not the undisturbed job's",
        )
    kept = epoch_order(SEED, 0, NUM_SAMPLES)[:480].tolist()  # 10 global steps of 48
    check_once(checks, "epoch 0 over both runs", flat(head + [r.ids for r in resumed]), kept)
    for rank in range(3):
        rows = records(tmp_path, "resumed", rank)
        epoch1 = [r.ids for r in rows if r.kind == "train" and r.epoch == 1]
        checks.batches(f"rank {rank} in epoch 1", epoch1, plan_batches(1, rank, world=3, batch=16))
    checks.verify()


@pytest.mark.parametrize("workers", [0, 2], ids=lambda n: f"workers-{n}")
def test_stateful_dataloaders_of_2_ranks_resume_on_3(server: BatchwireServer, workers: int) -> None:
    """torchdata's StatefulDataLoader over each rank's loader: rank 0's state after 3 steps
    resumes 3 ranks, each its own StatefulDataLoader, on the rest of the epoch."""
    if workers:  # forked
        in_trainer_process(stateful_dataloaders_resume, Target(server.target), workers)
    else:
        stateful_dataloaders_resume(server, workers)


def stateful_dataloaders_resume(server: BatchwireServer | Target, workers: int) -> None:
    options: dict[str, Any] = {
        "dataset": "shapes",
        "pipeline": "val",
        "batch_size": 16,
        "seed": SEED,
        "params": {"size": 32},
        "return_ids": True,
        "drop_last": False,
    }

    def ranks(world: int) -> list[tuple[RemoteLoader, StatefulDataLoader]]:
        made = []
        for rank in range(world):
            remote = RemoteLoader(server.target, rank=rank, world_size=world, **options)
            made.append((remote, StatefulDataLoader(remote, batch_size=None, num_workers=workers)))
        return made

    two = ranks(2)
    iterators = [iter(data) for _, data in two]
    head = [next(it)[2].tolist() for _ in range(3) for it in iterators]
    state = roundtrip(two[0][1].state_dict())
    for remote, data in two:
        del data
        remote.close()
    del iterators, two
    three = ranks(3)
    tails = []
    for remote, data in three:
        data.load_state_dict(state)
        tails.append([ids.tolist() for _, _, ids in data])
        remote.close()
    checks = Checks()
    checks.true(len({len(t) for t in tails}) == 1, f"ranks got {[len(t) for t in tails]} batches")
    counts = collections.Counter(flat(head + [b for tail in tails for b in tail]))
    checks.true(set(counts) == set(range(NUM_SAMPLES)), "samples of the epoch lost")
    repeats = sum(counts.values()) - NUM_SAMPLES
    checks.true(repeats == 2, f"{repeats} repeats; the 424 left over 3 ranks pad 2")
    checks.verify()


def test_accelerate_save_state_of_2_processes_loads_on_3(
    server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    """accelerate's recipe (register_for_checkpointing, save_state, load_state) with 16 a
    batch: saved after 5 batches of epoch 1 on 2 processes (160 samples), resumed on 3, the
    epoch is trained once; drop_last drops only the tail of the 360 left smaller than 3·16."""
    args = ["--target", server.target, "--batch-size", "16", "--seed", str(SEED)]
    first = torchrun("accelerate_job.py", tmp_path, *args, "--save-after", "5", "--kill-after", "7")
    checks = Checks()
    check_killed(checks, tmp_path, "first", first)
    assert (tmp_path / "state").is_dir(), f"no saved state{first.tail()}"
    second = torchrun(
        "accelerate_job.py", tmp_path, *args, "--records", "resumed", "--resume", world=3
    )
    check_finished(checks, tmp_path, "resumed", second, world=3)
    head = [
        r.ids
        for rank in range(2)
        for r in records(tmp_path, "first", rank)
        if r.epoch == 1 and r.step < 5
    ]
    tails = [[r.ids for r in records(tmp_path, "resumed", rank)] for rank in range(3)]
    checks.true(
        [len(tail) for tail in tails] == [7, 7, 7],
        f"the 3 processes trained {[len(t) for t in tails]} batches; 120 each is 7 of 16",
    )
    order = epoch_order(SEED, 1, NUM_SAMPLES).tolist()
    after = [batch for tail in tails for batch in tail]
    check_once(checks, "epoch 1 over both runs", flat(head + after), order[: 160 + 336])
    checks.verify()
