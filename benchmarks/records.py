"""The record path alone, from the page cache: microseconds a record.

    python -m benchmarks.records [--batches 64] [--passes 7]

Over the generated datasets of ``batchwire bench`` (its ImageNet-sized photos, and the
48 x 48 photos of its small-image stand-in), reads the same shuffled batches of 128 ids
``--passes`` times with ``Dataset.read`` (located, read and found inside their ``Datum``)
and with ``Dataset.read_screened`` (the same, and screened: what a server does for each
batch), one thread, after a first pass that reads them into the page cache and screens
them. Prints the best pass of each, in microseconds a record.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from batchwire.bench import SMALL_PHOTO, bench_dataset
from batchwire.server.data import Dataset

BATCH = 128


def best_us(batches: list[np.ndarray], read: Callable[[np.ndarray], object], passes: int) -> float:
    """The best of ``passes`` passes of ``read`` over ``batches``, in µs a record."""
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for ids in batches:
            read(ids)
        best = min(best, time.perf_counter() - started)
    return best / (len(batches) * BATCH) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=64, help="batches of 128 a pass")
    parser.add_argument("--passes", type=int, default=7, help="passes; the best is printed")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for label, size in (("ImageNet-sized photos", None), ("48 x 48 photos", SMALL_PHOTO)):
        data_dir, name = bench_dataset(None, None, 4096, *([size] if size else []))
        with Dataset(data_dir / name) as dataset:
            n = dataset.num_samples
            batches = [rng.choice(n, min(BATCH, n), replace=False) for _ in range(args.batches)]
            for ids in batches:  # into the page cache, and screened once
                dataset.read_screened(ids)
            read = best_us(batches, dataset.read, args.passes)
            screened = best_us(batches, dataset.read_screened, args.passes)
        print(f"{label}: Dataset.read {read:.2f} µs a record, read_screened {screened:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
