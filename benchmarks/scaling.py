"""``python -m benchmarks --scaling``: one server pinned to core 0, then two pinned to cores
0 and 1 with a lane each, streaming to one loader; the ratio of their rates (ideal 2.00x)."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

__all__ = ["run_scaling"]


def run_scaling(args: argparse.Namespace) -> int:
    from batchwire.bench import LocalServer, bench_dataset, run_remote

    if (os.cpu_count() or 1) < 2:
        print("error: --scaling needs at least 2 cores", file=sys.stderr)
        return 2
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)

    def measure(*servers: LocalServer) -> float:
        result = run_remote(
            "remote",
            [s.address for s in servers],
            [s.pid for s in servers],
            dataset,
            args.pipeline,
            args.batch_size,
            args.images,
        )
        return result.images_per_second

    print(f"{'servers':>8} {'cores':>6} {'images/s':>9}")
    with tempfile.TemporaryDirectory(prefix="batchwire-bench-") as tmp:
        work = pathlib.Path(tmp)
        with LocalServer(data_dir, work, cpus="0", threads=1) as one:
            single = measure(one)
        print(f"{1:>8} {'0':>6} {single:9.0f}")
        with (
            LocalServer(data_dir, work, cpus="0", threads=1) as a,
            LocalServer(data_dir, work, cpus="1", threads=1) as b,
        ):
            double = measure(a, b)
        print(f"{2:>8} {'0,1':>6} {double:9.0f}")
    print(f"scaling: {double / single:.2f}x with 2 servers (ideal 2.00x)")
    return 0
