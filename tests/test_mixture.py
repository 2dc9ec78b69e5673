"""A mixture's epoch order: exact per-source counts, distinct samples where a source gives
no more than its size, the same order everywhere, and the one-dataset contract (ranks,
cursors, origins) kept over mixed ids."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from batchwire.common.mixture import (
    MixturePlan,
    batch_schedule,
    mixture_counts,
    mixture_order,
    source_seed,
    split_ids,
)

SIZES = (300, 200, 50)
WEIGHTS = (0.5, 0.3, 0.2)


def per_source(order: np.ndarray, sizes: tuple[int, ...] = SIZES) -> list[np.ndarray]:
    sources, ids = split_ids(order, sizes)
    return [ids[sources == s] for s in range(len(sizes))]


def test_weights_give_exact_counts_for_each_rule_of_the_epoch_length() -> None:
    assert mixture_counts(SIZES, weights=WEIGHTS) == (275, 165, 110)  # 550 = the sizes' sum
    assert mixture_counts(SIZES, weights=(5, 3, 2), length=1000) == (500, 300, 200)
    # The first source used up: the third, 50 samples at 0.2, makes the epoch 250 long.
    assert mixture_counts(SIZES, weights=WEIGHTS, length="first") == (125, 75, 50)
    # Every source used up: the second, 200 samples at 0.3, makes it 667 long (the first
    # at 0.5 would take 600, the third 250); the others repeat samples.
    assert mixture_counts(SIZES, weights=WEIGHTS, length="all") == (334, 200, 133)
    # Largest remainder: the counts add up to the length whatever the rounding.
    counts = mixture_counts((10, 10, 10), weights=(1, 1, 1), length=100)
    assert sum(counts) == 100 and max(counts) - min(counts) == 1
    assert mixture_counts(SIZES, counts=(10, 400, 0)) == (10, 400, 0)


def test_an_epoch_has_each_sources_count_distinct_where_it_fits_and_repeats_evenly() -> None:
    counts = mixture_counts(SIZES, weights=WEIGHTS)
    for epoch in range(20):
        order = mixture_order(11, epoch, SIZES, counts)
        assert len(order) == sum(counts)
        first, second, third = per_source(order)
        assert [len(first), len(second), len(third)] == list(counts)
        # Downsampled sources: distinct samples.
        assert len(set(first.tolist())) == len(first) and len(set(second.tolist())) == 110 + 55
        # The upsampled one (110 from 50): every sample 2 or 3 times.
        assert set(collections.Counter(third.tolist()).values()) <= {2, 3}
        assert set(third.tolist()) == set(range(50))


def test_the_order_is_a_pure_function_of_seed_epoch_sizes_and_counts() -> None:
    counts = mixture_counts(SIZES, weights=WEIGHTS)
    order = mixture_order(11, 3, SIZES, counts)
    assert np.array_equal(order, mixture_order(11, 3, list(SIZES), list(counts)))
    assert not np.array_equal(order, mixture_order(11, 4, SIZES, counts))
    assert not np.array_equal(order, mixture_order(12, 3, SIZES, counts))
    # Downsampled sources see other samples in other epochs.
    seen = {
        epoch: set(per_source(mixture_order(11, epoch, SIZES, counts))[0].tolist())
        for epoch in (0, 1)
    }
    assert seen[0] != seen[1]
    # Batches mix the sources, in the set proportions on average.
    batches = order[: 64 * 8].reshape(8, 64)
    assert all(len(set(split_ids(batch, SIZES)[0].tolist())) >= 2 for batch in batches)


def test_without_shuffle_ids_come_in_order_and_sources_are_spread_evenly() -> None:
    order = mixture_order(0, 0, (4, 2), (4, 2), shuffle=False)
    sources, ids = split_ids(order, (4, 2))
    assert ids[sources == 0].tolist() == [0, 1, 2, 3] and ids[sources == 1].tolist() == [0, 1]
    assert sources.tolist() == [0, 1, 0, 0, 1, 0]


def plan(**fields: object) -> MixturePlan:
    counts = mixture_counts(SIZES, weights=WEIGHTS)
    settings: dict[str, object] = {
        "num_samples": sum(counts), "sizes": SIZES, "counts": counts, "batch_size": 16,
        "seed": 5, "epoch": 2,
    }  # fmt: skip
    return MixturePlan(**{**settings, **fields})  # type: ignore[arg-type]


def test_ranks_split_a_mixture_as_they_split_a_dataset() -> None:
    whole = plan().order()
    shares = [plan(rank=r, world_size=3, drop_last=False).share() for r in range(3)]
    assert all(len(share) == len(shares[0]) for share in shares)
    # Position p of rank r is element r + 3p of the order (padded by wrapping around).
    interleaved = np.stack(shares, axis=1).reshape(-1)
    assert np.array_equal(interleaved[: len(whole)], whole)
    # Batches as a pulling client asks for them: the share's, cut in order.
    ranked = plan(rank=1, world_size=3, drop_last=False)
    asked = ranked.batches_at(range(ranked.num_batches))
    assert np.array_equal(np.concatenate([b.ids for b in asked]), shares[1])


def test_a_cursor_resumes_the_rest_and_an_origin_resumes_on_another_world_size() -> None:
    share = plan(rank=0, world_size=2).share()
    for cursor in (0, 7, 16, 100, len(share)):
        rest = [b.ids for b in plan(rank=0, world_size=2, start=cursor).batches()]
        assert np.array_equal(np.concatenate(rest or [np.zeros(0, np.int64)]), share[cursor:])
    # Two ranks took 5 global steps (5 x 2 x 16 samples); three ranks take the rest.
    origin = 5 * 2 * 16
    rest = [plan(rank=r, world_size=3, origin=origin, drop_last=False).share() for r in range(3)]
    taken = np.stack(rest, axis=1).reshape(-1)[: len(plan().order()) - origin]
    assert np.array_equal(taken, plan().order()[origin:])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"weights": (0.5, -0.1, 0.6)}, "finite numbers >= 0"),
        ({"weights": (0, 0, 0)}, "at least one weight must be above 0"),
        ({"weights": (0.5, float("nan"), 0.5)}, "finite numbers >= 0"),
        ({"weights": (0.5, 0.5)}, "2 weights for 3 sources"),
        ({"weights": WEIGHTS, "counts": (1, 1, 1)}, "either a weight or a count"),
        ({}, "either a weight or a count"),
        ({"counts": (1, -1, 1)}, "a count must be >= 0"),
        ({"counts": (0, 0, 0)}, "no samples"),
        ({"weights": WEIGHTS, "length": "longest"}, "one of ('sum', 'first', 'all')"),
        ({"weights": WEIGHTS, "length": 0}, "at least 1 sample"),
    ],
)
def test_bad_mixtures_are_refused_with_what_is_wrong(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mixture_counts(SIZES, **options)  # type: ignore[arg-type]


def test_an_empty_source_cannot_be_given_samples() -> None:
    with pytest.raises(ValueError, match="source 1 is empty"):
        mixture_counts((10, 0), counts=(5, 5))
    assert mixture_counts((10, 0), weights=(1, 0)) == (10, 0)


def test_an_epoch_is_at_most_a_few_times_the_data() -> None:
    """Every server computes a mixture's order in memory: a request for an epoch of many
    times its data (a mistake, or a hostile client) is refused before any is made."""
    big = (5_000_000, 10)  # 4 times their sum: 20,000,040 samples at most
    assert sum(mixture_counts(big, counts=(5_000_000, 15_000_040))) == 20_000_040
    with pytest.raises(ValueError, match="more than 4 times its datasets' 5000010 samples"):
        mixture_counts(big, counts=(5_000_000, 15_000_041))
    with pytest.raises(ValueError, match="lower the counts, or the length"):
        mixture_counts(big, weights=(0.001, 0.999), length="all")  # 5e9 samples
    # Small datasets may still make an epoch of up to 2**20 samples.
    assert mixture_counts((10, 10), counts=(1 << 19, 1 << 19)) == (1 << 19, 1 << 19)
    with pytest.raises(ValueError, match=f"at most {1 << 20}"):
        mixture_counts((10, 10), counts=(1 << 19, (1 << 19) + 1))


def test_a_batch_schedule_takes_each_sources_batches_in_a_seeded_order() -> None:
    schedule = batch_schedule(7, 2, [9, 3, 0, 4])
    assert np.bincount(schedule, minlength=4).tolist() == [9, 3, 0, 4]
    assert (batch_schedule(7, 2, [9, 3, 0, 4]) == schedule).all()  # a pure function
    assert not (batch_schedule(7, 3, [9, 3, 0, 4]) == schedule).all()  # another epoch
    orders = {tuple(batch_schedule(seed, 0, [2, 2]).tolist()) for seed in range(64)}
    assert len(orders) == 6  # every order of two and two comes up
    # Without shuffle the sources' batches are spread evenly: 3 of 0 around each of 1.
    assert batch_schedule(0, 0, [6, 2], shuffle=False).tolist() == [0, 0, 1, 0, 0, 0, 1, 0]
    with pytest.raises(ValueError, match=">= 0"):
        batch_schedule(0, 0, [1, -1])


def test_each_source_has_a_seed_of_its_own() -> None:
    seeds = [source_seed(11, source) for source in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= seed < 1 << 63 for seed in seeds)
    assert seeds == [source_seed(11, source) for source in range(8)]
    assert source_seed(12, 0) != seeds[0]
