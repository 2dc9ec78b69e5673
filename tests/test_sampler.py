"""The order/sharding/resume contract of SPEC.md, as properties of the pure sampler."""

from __future__ import annotations

import collections
import dataclasses
import math
import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchwire.common.sampler import (
    Plan,
    Share,
    ShareFields,
    epoch_order,
    num_batches,
    rank_share,
)

sizes = st.integers(min_value=0, max_value=500)
worlds = st.integers(min_value=1, max_value=9)
batch_sizes = st.integers(min_value=1, max_value=40)


def all_ids(plan: Plan) -> list[int]:
    return [int(i) for batch in plan.batches() for i in batch.ids]


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a = epoch_order(seed=7, epoch=3, num_samples=1000)
    b = epoch_order(seed=7, epoch=3, num_samples=1000)
    assert np.array_equal(a, b)
    assert sorted(a.tolist()) == list(range(1000))
    assert not np.array_equal(a, epoch_order(seed=7, epoch=4, num_samples=1000))
    assert not np.array_equal(a, epoch_order(seed=8, epoch=3, num_samples=1000))
    assert np.array_equal(epoch_order(7, 3, 1000, shuffle=False), np.arange(1000))


def test_order_is_pinned_across_versions() -> None:
    # The contract: any server computes this same order. These values are fixed
    # by SeedSequence + PCG64 raw bits and must never change between releases.
    assert epoch_order(seed=0, epoch=0, num_samples=10).tolist() == [3, 2, 1, 8, 6, 0, 7, 4, 5, 9]
    assert epoch_order(seed=42, epoch=7, num_samples=12).tolist() == [
        5,
        7,
        10,
        1,
        6,
        9,
        2,
        0,
        11,
        4,
        3,
        8,
    ]


def test_global_shuffle_mixes_classes_in_every_batch() -> None:
    # A sorted dataset (10 classes of 1000): a true global shuffle puts ~10
    # classes in every batch of 64, unlike a shuffle buffer.
    order = epoch_order(seed=1, epoch=0, num_samples=10_000)
    classes_per_batch = [
        len(set((order[i : i + 64] // 1000).tolist())) for i in range(0, 10_000 - 64, 64)
    ]
    assert min(classes_per_batch) >= 8


@settings(max_examples=300, deadline=None)
@given(
    n=sizes, world=worlds, batch=batch_sizes, drop_last=st.booleans(), seed=st.integers(0, 2**32)
)
def test_ranks_are_disjoint_and_cover_the_epoch(
    n: int, world: int, batch: int, drop_last: bool, seed: int
) -> None:
    plans = [
        Plan(
            num_samples=n,
            batch_size=batch,
            seed=seed,
            rank=r,
            world_size=world,
            drop_last=drop_last,
        )
        for r in range(world)
    ]
    shares = [all_ids(p) for p in plans]
    counts = {len(list(p.batches())) for p in plans}
    assert counts == {plans[0].num_batches}, "every rank gets the same number of batches"
    assert plans[0].num_batches == num_batches(n, batch, world, drop_last)
    everything = [i for share in shares for i in share]
    if drop_last:
        assert len(everything) == len(set(everything)), "no id twice in an epoch"
        per_rank = (n // world) // batch * batch
        assert all(len(s) == per_rank for s in shares)
        for p in plans:
            assert all(len(b.ids) == batch for b in p.batches()), "only full batches"
    else:
        assert set(everything) == set(range(n)), "every id delivered"
        padded = math.ceil(n / world)
        assert all(len(s) == padded for s in shares)
        duplicates = sum(c - 1 for c in collections.Counter(everything).values())
        assert duplicates == padded * world - n, "padding only wraps around"


@settings(max_examples=200, deadline=None)
@given(n=sizes, world=worlds, batch=batch_sizes, drop_last=st.booleans(), data=st.data())
def test_resume_from_any_cursor_gives_exactly_the_rest(
    n: int, world: int, batch: int, drop_last: bool, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world - 1))
    full = Plan(
        num_samples=n, batch_size=batch, rank=rank, world_size=world, drop_last=drop_last, seed=3
    )
    delivered = all_ids(full)
    cursor = data.draw(st.integers(0, full.share_size))
    rest = all_ids(
        Plan(
            num_samples=n,
            batch_size=batch,
            rank=rank,
            world_size=world,
            drop_last=drop_last,
            seed=3,
            start=cursor,
        )
    )
    assert rest == delivered[cursor:]


@settings(max_examples=200, deadline=None)
@given(
    n=sizes,
    world=worlds,
    batch=batch_sizes,
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_a_batch_planned_alone_is_the_batch_of_the_whole_plan(
    n: int, world: int, batch: int, drop_last: bool, shuffle: bool, data: st.DataObject
) -> None:
    """What a pulling client asks for by index is what the whole plan streams."""
    rank = data.draw(st.integers(0, world - 1))
    whole = Plan(num_samples=n, batch_size=batch, world_size=world, rank=rank, drop_last=drop_last)
    whole = dataclasses.replace(whole, origin=data.draw(st.integers(0, n)))
    start = data.draw(st.integers(0, whole.share_size))
    plan = dataclasses.replace(whole, start=start, shuffle=shuffle, seed=3, epoch=2)
    planned = list(plan.batches())
    for b in planned:
        alone = plan.batch(b.index)
        assert (alone.index, alone.begin, alone.end) == (b.index, b.begin, b.end)
        assert alone.ids.tolist() == b.ids.tolist()
    # Many at once (what a StreamBatches lane asks for), in the order asked.
    together = plan.batches_at([b.index for b in reversed(planned)])
    assert [(t.index, t.ids.tolist()) for t in together] == [
        (b.index, b.ids.tolist()) for b in reversed(planned)
    ]
    for index in {-1, plan.num_batches} | {
        k for k in range(plan.num_batches) if k * batch + batch <= start
    }:
        with pytest.raises(ValueError, match=f"batch {index} is not in this share"):
            plan.batch(index)


@settings(max_examples=200, deadline=None)
@given(n=sizes, world=worlds, batch=batch_sizes, drop_last=st.booleans(), data=st.data())
def test_ranks_split_the_rest_of_an_epoch_from_an_origin_as_a_whole_epoch(
    n: int, world: int, batch: int, drop_last: bool, data: st.DataObject
) -> None:
    """A job resumed after ``origin`` samples on ``world`` ranks: the rest of the order
    once (padding fewer than ``world`` repeats), every rank the same number of batches."""
    origin = data.draw(st.integers(0, n))
    plans = [
        Plan(
            num_samples=n,
            batch_size=batch,
            world_size=world,
            rank=r,
            drop_last=drop_last,
            seed=4,
            origin=origin,
        )
        for r in range(world)
    ]
    rest = epoch_order(4, 0, n)[origin:].tolist()
    shares = [all_ids(plan) for plan in plans]
    assert len({len(list(plan.batches())) for plan in plans}) == 1
    # Global step k is the k-th batch of every rank: elements [k·W·B, (k+1)·W·B) of the rest.
    steps = [
        sorted(i for plan in plans for i in list(plan.batches())[k].ids.tolist())
        for k in range(plans[0].num_batches)
    ]
    full = (len(rest) // world // batch) * world * batch
    for k, step in enumerate(steps):
        if (k + 1) * world * batch <= full:
            assert step == sorted(rest[k * world * batch : (k + 1) * world * batch])
    counts = collections.Counter(i for share in shares for i in share)
    if drop_last:
        assert sorted(counts) == sorted(rest[:full]) and set(counts.values()) <= {1}
    else:
        assert sorted(counts) == sorted(rest)
        assert sum(counts.values()) - len(rest) < world


@pytest.mark.parametrize(("world", "batch"), [(1, 12), (3, 4), (4, 3), (2, 6)])
def test_with_world_times_batch_constant_a_resumed_epoch_has_the_same_global_batches(
    world: int, batch: int
) -> None:
    """2 ranks of 6 stop after 3 global steps; the job resumes on ``world`` ranks of
    ``batch`` at origin 3·2·6: its global steps are the undisturbed job's steps 3, 4, ..."""
    undisturbed = [
        Plan(num_samples=107, batch_size=6, world_size=2, rank=r, seed=9) for r in (0, 1)
    ]
    resumed = [
        Plan(num_samples=107, batch_size=batch, world_size=world, rank=r, seed=9, origin=36)
        for r in range(world)
    ]

    def steps(plans: list[Plan]) -> list[list[int]]:
        batches = [list(plan.batches()) for plan in plans]
        return [
            sorted(i for b in step for i in b.ids.tolist()) for step in zip(*batches, strict=True)
        ]

    assert steps(resumed) == steps(undisturbed)[3:]


def test_cursor_of_each_batch_resumes_after_it() -> None:
    plan = Plan(num_samples=103, batch_size=10, world_size=2, rank=1, drop_last=False, seed=5)
    batches = list(plan.batches())
    assert batches[-1].end == plan.share_size == 52
    for k, b in enumerate(batches):
        resumed = list(
            Plan(
                num_samples=103,
                batch_size=10,
                world_size=2,
                rank=1,
                drop_last=False,
                seed=5,
                start=b.end,
            ).batches()
        )
        assert [x.index for x in resumed] == list(range(k + 1, len(batches)))


def test_rank_share_matches_torch_distributed_sampler() -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    indices = list(range(23))
    for drop_last in (False, True):
        for rank in range(4):
            sampler = torch_data.distributed.DistributedSampler(
                indices, num_replicas=4, rank=rank, shuffle=False, drop_last=drop_last
            )
            ours = rank_share(np.arange(23), rank, 4, drop_last)
            assert ours.tolist() == list(iter(sampler))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"start": 1000}, "start"),
        ({"seed": -1}, ">= 0"),
        ({"origin": 101}, "origin"),
    ],
)
def test_bad_plans_are_refused_with_a_clear_message(kwargs: dict[str, int], message: str) -> None:
    base = {"num_samples": 100, "batch_size": 8}
    with pytest.raises(ValueError, match=message):
        Plan(**{**base, **kwargs})


def test_share_fields_are_every_field_of_a_share_with_its_type() -> None:
    share = Share(batch_size=3, seed=5, epoch=2, shuffle=False, rank=1, world_size=2, start=4)
    names = [f.name for f in dataclasses.fields(Share)]
    assert typing.get_type_hints(ShareFields) == typing.get_type_hints(Share)
    assert share.share_fields() == {name: getattr(share, name) for name in names}
    assert share.plan(20) == Plan(num_samples=20, **share.share_fields())
