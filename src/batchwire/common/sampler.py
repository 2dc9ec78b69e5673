"""The order, sharding and resume contract, as pure functions.

Every server and client computes the same thing from the same numbers:

* The order of an epoch is a pure function of ``(seed, epoch, num_samples,
  shuffle)``: a full permutation of ``0..N-1`` (a true global shuffle), or id
  order when ``shuffle`` is false. It depends only on NumPy's ``SeedSequence``
  and ``PCG64`` bit streams, which NumPy keeps stable across releases, so any
  server produces the same order.
* Rank ``r`` of ``world_size`` ``W`` takes every ``W``-th element of the order
  starting at ``r``. With ``drop_last`` every rank gets ``N // W`` samples and
  only full batches; without it, ranks are padded to ``ceil(N / W)`` by
  wrapping around to the start of the order (as torch's DistributedSampler
  does) and the last batch may be short. All ranks get the same number of
  batches.
* A rank's share is cut into batches of ``batch_size`` in order.
* A cursor is a position in the rank's share: the number of share positions
  before the next sample to deliver. Resuming from a cursor yields exactly the
  rest of the share, whatever the batch boundaries.
* An ``origin`` is a position in the epoch order: the ranks split the rest of
  the order, ``order[origin:]``, as they split a whole epoch (padding wraps to
  ``order[origin]``). Global step ``k`` of world ``W`` and batch ``B`` covers
  ``order[origin + k·W·B : origin + (k+1)·W·B]``, so a job that stopped after
  ``G`` samples of an epoch resumes on any world size at ``origin = G``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import TypedDict, cast

import numpy as np

__all__ = [
    "Plan",
    "PlannedBatch",
    "Share",
    "ShareFields",
    "epoch_order",
    "num_batches",
    "rank_share",
    "seeded_permutation",
]


def seeded_permutation(entropy: Sequence[int], size: int) -> np.ndarray:
    """A uniform permutation of ``0..size-1`` (int64), a pure function of ``entropy``
    (a ``SeedSequence``'s entropy) and ``size``."""
    keys = np.random.PCG64(np.random.SeedSequence(list(entropy))).random_raw(size)
    # Sorting 64-bit random keys gives a uniform permutation; a stable sort
    # makes the (vanishingly rare) ties deterministic too.
    return np.argsort(keys, kind="stable").astype(np.int64)


@functools.lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    order = seeded_permutation((seed, epoch), num_samples)
    order.setflags(write=False)
    return order


def epoch_order(seed: int, epoch: int, num_samples: int, shuffle: bool = True) -> np.ndarray:
    """All ids ``0..num_samples-1`` in the order of ``epoch`` (read-only int64)."""
    if num_samples < 0 or seed < 0 or epoch < 0:
        raise ValueError("seed, epoch and num_samples must be >= 0")
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return _permutation(seed, epoch, num_samples)


def rank_share(order: np.ndarray, rank: int, world_size: int, drop_last: bool) -> np.ndarray:
    """The ids rank ``rank`` takes from an epoch order (or the rest of one, from an
    origin on), in delivery order."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}"
        )
    n = len(order)
    if drop_last:
        per_rank = n // world_size
        return order[rank::world_size][:per_rank]
    per_rank = math.ceil(n / world_size)
    total = per_rank * world_size
    if total > n and n > 0:
        repeats = math.ceil(total / n)
        order = np.tile(order, repeats)[:total]
    return order[rank:total:world_size]


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    """Batch ``index`` of a rank's share: share positions ``[begin, end)``."""

    index: int
    begin: int
    end: int
    ids: np.ndarray


class ShareFields(TypedDict):
    """A :class:`Share`'s fields by name, as :meth:`Share.share_fields` gives them."""

    batch_size: int
    seed: int
    epoch: int
    shuffle: bool
    drop_last: bool
    rank: int
    world_size: int
    start: int
    origin: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Share:
    """Which share of which epoch: every number that fixes a rank's batches but the
    dataset's size. ``start`` is a cursor: batches (or the tail of a batch, when
    ``start`` falls inside one) before it are not planned. ``origin`` is where in the
    epoch order the ranks' split begins (0: the whole epoch; see the module)."""

    batch_size: int
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    drop_last: bool = True
    rank: int = 0
    world_size: int = 1
    start: int = 0
    origin: int = 0

    def __post_init__(self) -> None:
        checks = (
            (self.batch_size >= 1, f"batch_size must be at least 1, got {self.batch_size}"),
            (
                self.world_size >= 1 and 0 <= self.rank < self.world_size,
                f"rank must be in [0, world_size), got {self.rank} of {self.world_size}",
            ),
            (self.seed >= 0 and self.epoch >= 0, "seed and epoch must be >= 0"),
            (self.start >= 0, f"start must be >= 0, got {self.start}"),
            (self.origin >= 0, f"origin must be >= 0, got {self.origin}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def share_fields(self) -> ShareFields:
        """This share's numbers by name (what a Plan needs besides the dataset's size)."""
        # ShareFields names every field of Share (a test holds them equal).
        fields = {name: getattr(self, name) for name in ShareFields.__annotations__}
        return cast(ShareFields, fields)

    def plan(self, num_samples: int) -> Plan:
        """This share of a dataset of ``num_samples`` (``ValueError`` if, say, ``start``
        lies past its end)."""
        return Plan(num_samples=num_samples, **self.share_fields())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan(Share):
    """One rank's share of one epoch of a dataset of ``num_samples``, cut into
    batches."""

    num_samples: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")
        if self.origin > self.num_samples:
            raise ValueError(
                f"origin must be a position in [0, {self.num_samples}] of the epoch, "
                f"got {self.origin}"
            )
        if self.start > self.share_size:
            raise ValueError(
                f"start must be a cursor in [0, {self.share_size}] for this share, got {self.start}"
            )

    @property
    def share_size(self) -> int:
        """Positions in this rank's share that are delivered (after drop_last)."""
        if self.drop_last:
            return self.num_batches * self.batch_size
        return math.ceil(self.remaining / self.world_size)

    @property
    def remaining(self) -> int:
        """Samples of the epoch order from ``origin`` on: what the ranks split."""
        return self.num_samples - self.origin

    @property
    def num_batches(self) -> int:
        """Batches in this rank's share of the epoch."""
        return num_batches(self.remaining, self.batch_size, self.world_size, self.drop_last)

    def order(self) -> np.ndarray:
        """The epoch's order of ids (read-only): :func:`epoch_order` of the dataset."""
        return epoch_order(self.seed, self.epoch, self.num_samples, self.shuffle)

    def share(self) -> np.ndarray:
        rest = self.order()[self.origin :]
        return rank_share(rest, self.rank, self.world_size, self.drop_last)[: self.share_size]

    def batches(self) -> Iterator[PlannedBatch]:
        """The share's batches from ``start`` on, in order."""
        share = self.share()
        for index in range(self.start // self.batch_size, self.num_batches):
            begin, end = self._bounds(index)
            if begin < end:
                yield PlannedBatch(index=index, begin=begin, end=end, ids=share[begin:end])

    def batch(self, index: int) -> PlannedBatch:
        """Batch ``index`` of the share, without the rest of the share: what a
        client pulling batches one at a time asks for. ``ValueError`` if the share has no
        such batch from ``start`` on."""
        return self.batches_at([index])[0]

    def batches_at(self, indices: Sequence[int]) -> list[PlannedBatch]:
        """Batches ``indices`` of the share, in that order, the epoch's order
        computed once for all of them; ``ValueError`` as :meth:`batch`."""
        bounds = [(index, *self._bounds(index)) for index in indices]
        for index, begin, end in bounds:
            if not 0 <= index < self.num_batches or begin >= end:
                raise ValueError(
                    f"batch {index} is not in this share from cursor {self.start} "
                    f"(batches {self.start // self.batch_size}..{self.num_batches - 1})"
                )
        if not bounds:
            return []
        order = self.order()
        # Share position p is element rank + p * world_size of the rest of the order,
        # wrapped around when ranks are padded (rank_share's tiling).
        rest = order[self.origin :]
        planned = []
        for index, begin, end in bounds:
            positions = self.rank + np.arange(begin, end, dtype=np.int64) * self.world_size
            ids = rest[positions % len(rest)]
            planned.append(PlannedBatch(index=index, begin=begin, end=end, ids=ids))
        return planned

    def _bounds(self, index: int) -> tuple[int, int]:
        """Share positions ``[begin, end)`` of batch ``index`` from ``start`` on."""
        begin = max(index * self.batch_size, self.start)
        return begin, min((index + 1) * self.batch_size, self.share_size)


def num_batches(num_samples: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    """Batches per rank per epoch: equal on every rank, so DDP never hangs."""
    if batch_size < 1 or world_size < 1:
        raise ValueError("batch_size and world_size must be >= 1")
    if drop_last:
        return (num_samples // world_size) // batch_size
    return math.ceil(math.ceil(num_samples / world_size) / batch_size)
