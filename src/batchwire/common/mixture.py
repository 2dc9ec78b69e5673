"""Mixtures of datasets: one epoch order over several sources in set proportions, as pure
functions, so that every server and client computes the same order.

A mixture's sources are datasets of ``sizes[s]`` samples, each taking ``counts[s]``
positions of every epoch (:func:`mixture_counts` turns weights, or counts, and a rule for
the epoch's length into those counts). Sample ``i`` of source ``s`` has the *mixed id*
``offsets[s] + i``, the offsets being the running sum of the sizes in source order
(:func:`split_ids` goes back). An epoch of a mixture is then an order of mixed ids, which
ranks split, batches cut and cursors resume exactly as they do one dataset's:
:class:`MixturePlan` is a :class:`~batchwire.common.sampler.Plan` whose order is the
mixture's.

The order of epoch ``e`` (:func:`mixture_order`) is a pure function of ``(seed, e, sizes,
counts)``, from NumPy's ``SeedSequence`` and ``PCG64`` bit streams as one dataset's is:

* Source ``s`` gives ``counts[s]`` ids: its own permutation for ``(seed, e, s)`` taken in
  order. Fewer than its size (downsampled): distinct ids, a different subset each epoch.
  More (upsampled): further passes, each a permutation of its own, so every sample comes
  ``counts[s] // sizes[s]`` or one more times.
* The sources take their positions in a seeded permutation of the multiset of source
  labels (``counts[s]`` copies of ``s``): the epoch's per-source counts are exact, and
  every batch is a random mix of them. Without ``shuffle``, ids come in id order and the
  sources are interleaved evenly (each source's ``k``-th sample at ``(k + 0.5) /
  counts[s]`` of the epoch).

Where the sources cannot share a batch (another pipeline, image size or server), each
batch comes from one source ("per source" batching): source ``s`` is then streamed as a
mixture of itself alone, ``counts[s]`` samples of its own order for the seed
:func:`source_seed` gives it, and :func:`batch_schedule` says which source each global
step comes from, in proportion to the sources' batches. Where every batch must hold each
source's share ("stratified" batching), the sources are streamed so too, source ``s`` in
batches of :func:`stratum_sizes`'s ``[s]`` samples, and each batch is one of each.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import numpy as np

from batchwire.common.sampler import Plan, seeded_permutation

__all__ = [
    "EPOCH_LENGTHS",
    "MAX_EPOCH_FACTOR",
    "MIN_EPOCH_BOUND",
    "MixturePlan",
    "batch_schedule",
    "check_length",
    "check_weights",
    "mixture_counts",
    "mixture_order",
    "offsets_of",
    "source_seed",
    "split_ids",
    "stratum_sizes",
]

# How long a mixture's epoch is, given weights (see mixture_counts).
EPOCH_LENGTHS = ("sum", "first", "all")
# A mixture's epoch holds at most this many times its sources' samples added up (or
# MIN_EPOCH_BOUND): its order is computed in memory, by every server a client asks, and an
# epoch that repeats the whole data more often than this is a mistake, not a mixture.
MAX_EPOCH_FACTOR = 4
MIN_EPOCH_BOUND = 1 << 20

# Tags that keep the mixture's random streams apart from one dataset's ([seed, epoch]).
_SOURCE_STREAM, _INTERLEAVE_STREAM, _SOURCE_SEED, _SCHEDULE_STREAM = 1, 2, 3, 4


def mixture_counts(
    sizes: Sequence[int],
    *,
    weights: Sequence[float] | None = None,
    counts: Sequence[int] | None = None,
    length: int | str = "sum",
) -> tuple[int, ...]:
    """Samples each source gives an epoch: ``counts`` as given, or ``weights`` (relative
    proportions of the epoch) applied to its length, rounded by largest remainder so that
    they add up to it exactly. ``length`` is a number of samples, or ``"sum"`` (the
    sources' sizes added up), ``"first"`` (the epoch ends as the first source would repeat
    a sample), or ``"all"`` (as the last source would see its last new sample: the
    smaller ones repeat). ``ValueError`` says what is wrong with the input."""
    if not sizes:
        raise ValueError("a mixture needs at least one source")
    if any(size < 0 for size in sizes):
        raise ValueError(f"a source's size must be >= 0, got {list(sizes)}")
    if (weights is None) == (counts is None):
        raise ValueError("give each source either a weight or a count, not both or neither")
    if counts is not None:
        given = [int(count) for count in counts]
        if len(given) != len(sizes):
            raise ValueError(f"{len(given)} counts for {len(sizes)} sources")
        if any(count < 0 for count in given):
            raise ValueError(f"a count must be >= 0, got {given}")
        result = tuple(given)
    else:
        assert weights is not None
        result = _counts_of_weights(sizes, [float(w) for w in weights], length)
    empty = [
        s for s, (size, count) in enumerate(zip(sizes, result, strict=True)) if count and not size
    ]
    if empty:
        raise ValueError(f"source {empty[0]} is empty but is given {result[empty[0]]} samples")
    if not sum(result):
        raise ValueError("the mixture's epoch has no samples")
    bound = max(MAX_EPOCH_FACTOR * sum(sizes), MIN_EPOCH_BOUND)
    if sum(result) > bound:
        raise ValueError(
            f"the mixture's epoch of {sum(result)} samples is more than {MAX_EPOCH_FACTOR} "
            f"times its datasets' {sum(sizes)} samples added up (at most {bound}): lower the "
            "counts, or the length"
        )
    return result


def _counts_of_weights(
    sizes: Sequence[int], weights: list[float], length: int | str
) -> tuple[int, ...]:
    if len(weights) != len(sizes):
        raise ValueError(f"{len(weights)} weights for {len(sizes)} sources")
    check_weights(weights)
    check_length(length)
    total_weight = sum(weights)
    shares = [w / total_weight for w in weights]
    used = [(size, share) for size, share in zip(sizes, shares, strict=True) if share > 0]
    if isinstance(length, str):
        if length == "sum":
            total = sum(sizes)
        elif length == "first":
            total = min(math.floor(size / share) for size, share in used)
        else:
            total = max(math.ceil(size / share) for size, share in used)
    else:
        total = int(length)
    return _largest_remainder(shares, total)


def _largest_remainder(shares: Sequence[float], total: int) -> tuple[int, ...]:
    """``total`` split in proportion to ``shares`` (which add up to 1) in whole numbers:
    each share's part rounded down, the rest one each to the largest remainders, ties to
    the earlier share. They add up to ``total``."""
    exact = [share * total for share in shares]
    result = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda s: (result[s] - exact[s], s))
    for s in by_remainder[: total - sum(result)]:
        result[s] += 1
    return tuple(result)


def check_weights(weights: Sequence[float]) -> None:
    """``ValueError`` unless ``weights`` are finite numbers >= 0, one of them above 0."""
    if not all(
        isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
        for w in weights
    ):
        raise ValueError(f"weights must be finite numbers >= 0, got {list(weights)}")
    if sum(weights) <= 0:
        raise ValueError(f"at least one weight must be above 0, got {list(weights)}")


def check_length(length: int | str) -> None:
    """``ValueError`` unless ``length`` is a number of samples (>= 1) or one of
    :data:`EPOCH_LENGTHS`."""
    if isinstance(length, str):
        if length not in EPOCH_LENGTHS:
            raise ValueError(
                f"length must be a number of samples or one of {EPOCH_LENGTHS}, got {length!r}"
            )
    elif not isinstance(length, numbers.Integral) or isinstance(length, bool) or length < 1:
        raise ValueError(f"length must be at least 1 sample, got {length!r}")


def offsets_of(sizes: Sequence[int]) -> np.ndarray:
    """Each source's first mixed id: the running sum of the sizes before it."""
    return np.concatenate(([0], np.cumsum(np.asarray(sizes, dtype=np.int64))[:-1])).astype(np.int64)


def split_ids(mixed: np.ndarray, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source, id within the source) of each mixed id."""
    mixed = np.asarray(mixed, dtype=np.int64)
    bounds = np.cumsum(np.asarray(sizes, dtype=np.int64))
    if len(mixed) and not (mixed.min() >= 0 and mixed.max() < bounds[-1]):
        raise ValueError(
            f"mixed ids must be in [0, {int(bounds[-1])}), got {mixed.min()}..{mixed.max()}"
        )
    sources = np.searchsorted(bounds, mixed, side="right")
    return sources, mixed - offsets_of(sizes)[sources]


def _source_ids(
    seed: int, epoch: int, source: int, size: int, count: int, shuffle: bool
) -> np.ndarray:
    """Source ``source``'s ``count`` ids of the epoch, in the order it gives them."""
    passes = -(-count // size) if count else 0
    if not shuffle:
        return np.tile(np.arange(size, dtype=np.int64), passes)[:count]
    taken = [
        seeded_permutation((seed, epoch, _SOURCE_STREAM, source, p), size) for p in range(passes)
    ]
    return np.concatenate(taken)[:count] if taken else np.zeros(0, dtype=np.int64)


def source_seed(seed: int, source: int) -> int:
    """The seed source ``source`` of a mixture of seed ``seed`` is streamed with when each
    batch is of one source: sources of the same size do not share an order."""
    if seed < 0 or source < 0:
        raise ValueError("seed and source must be >= 0")
    state = np.random.SeedSequence([seed, _SOURCE_SEED, source]).generate_state(2, np.uint64)
    return int(state[0]) >> 1  # in [0, 2**63): any seed a stream takes


def stratum_sizes(batch_size: int, shares: Sequence[float]) -> tuple[int, ...]:
    """Each source's samples in a stratified batch of ``batch_size``: its share (relative
    to their sum) of the batch, rounded by largest remainder so that they add up to
    ``batch_size``. ``ValueError`` if a source with a share would get no sample."""
    check_weights(shares)
    total = sum(shares)
    sizes = _largest_remainder([share / total for share in shares], batch_size)
    starved = [
        s for s, (share, size) in enumerate(zip(shares, sizes, strict=True)) if share and not size
    ]
    if starved:
        share = shares[starved[0]] / total
        raise ValueError(
            f"a batch of {batch_size} holds {batch_size * share:.2f} samples of source "
            f"{starved[0]} (its share, {share:.3g}): raise the batch size to at least "
            f"{math.ceil(1 / share)}, or its weight"
        )
    return sizes


def batch_schedule(
    seed: int, epoch: int, batches: Sequence[int], shuffle: bool = True
) -> np.ndarray:
    """Which source each of ``sum(batches)`` global steps takes its batch from, source
    ``s`` ``batches[s]`` times: a seeded permutation, a pure function of ``(seed, epoch,
    batches)`` (every rank has the same batches of each source, so every rank computes the
    same schedule and takes each step's batch from the same source). Without ``shuffle``
    the sources are interleaved evenly, as :func:`mixture_order` interleaves samples."""
    if seed < 0 or epoch < 0 or any(b < 0 for b in batches):
        raise ValueError("seed, epoch and batches must be >= 0")
    counts = tuple(int(b) for b in batches)
    # The batches are in the entropy: a resumed rest is scheduled apart from a whole epoch.
    return _interleave((seed, epoch, _SCHEDULE_STREAM, *counts), counts, shuffle)


def _interleave(entropy: Sequence[int], counts: Sequence[int], shuffle: bool) -> np.ndarray:
    """``counts[s]`` copies of each label ``s``, in the seeded order of ``entropy`` or
    evenly spread."""
    labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if shuffle:
        shuffled: np.ndarray = labels[seeded_permutation(entropy, len(labels))]
        return shuffled
    # each label's k-th copy at (k + 0.5) / count of the sequence, evenly spread
    keys = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c] or [np.zeros(0)])
    spread: np.ndarray = labels[np.argsort(keys, kind="stable")]
    return spread


def mixture_order(
    seed: int, epoch: int, sizes: Sequence[int], counts: Sequence[int], shuffle: bool = True
) -> np.ndarray:
    """The mixed ids of epoch ``epoch``, ``sum(counts)`` of them (read-only int64)."""
    if seed < 0 or epoch < 0:
        raise ValueError("seed and epoch must be >= 0")
    if len(sizes) != len(counts):
        raise ValueError(f"{len(counts)} counts for {len(sizes)} sources")
    return _mixture_order(seed, epoch, tuple(sizes), tuple(counts), shuffle)


@functools.lru_cache(maxsize=8)
def _mixture_order(
    seed: int, epoch: int, sizes: tuple[int, ...], counts: tuple[int, ...], shuffle: bool
) -> np.ndarray:
    labels = _interleave((seed, epoch, _INTERLEAVE_STREAM), counts, shuffle)
    order = np.empty(len(labels), dtype=np.int64)
    for source, (size, count, offset) in enumerate(
        zip(sizes, counts, offsets_of(sizes), strict=True)
    ):
        if count:
            order[labels == source] = offset + _source_ids(
                seed, epoch, source, size, count, shuffle
            )
    order.setflags(write=False)
    return order


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixturePlan(Plan):
    """One rank's share of one epoch of a mixture: a :class:`Plan` over ``sum(counts)``
    positions whose order is :func:`mixture_order`; its ids are mixed ids
    (:func:`split_ids`)."""

    sizes: tuple[int, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.sizes) != len(self.counts) or not self.sizes:
            raise ValueError(f"{len(self.counts)} counts for {len(self.sizes)} sources")
        if self.num_samples != sum(self.counts):
            raise ValueError(
                f"num_samples must be the mixture's epoch, {sum(self.counts)}, got {self.num_samples}"
            )

    def order(self) -> np.ndarray:
        return mixture_order(self.seed, self.epoch, self.sizes, self.counts, self.shuffle)
