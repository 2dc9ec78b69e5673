"""Several servers behind one loader: ``python -m benchmarks --fleet``.

Two servers, each pinned to a core of its own, the second sharing its core with two busy
processes (noisy neighbours: about half speed). Each server's solo rate, then one loader
over both, alternated; the loader should reach the sum of the solo rates, because batches
go to whichever server is ready.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from batchwire.bench import LocalServer, RunResult, run_remote

__all__ = ["Burner", "fleet", "fleet_table", "run_fleet"]


class Burner:
    """``count`` processes that keep core ``cpu`` busy while the ``with`` block runs."""

    def __init__(self, cpu: str, count: int = 1) -> None:
        self._command = ["taskset", "-c", cpu, sys.executable, "-c", "while True: pass"]
        self._count = count
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Burner:
        self._processes = [subprocess.Popen(self._command) for _ in range(self._count)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for process in self._processes:
            process.kill()
            process.wait(10)


def fleet(
    data_dir: pathlib.Path,
    work: pathlib.Path,
    dataset: str,
    pipeline: str,
    batch_size: int,
    images: int,
    repeats: int,
) -> dict[str, RunResult]:
    """Median runs of: the fast server alone, the slowed one alone, one loader over both."""
    runs: dict[str, list[RunResult]] = collections.defaultdict(list)
    # The loader runs on core 0 beside the fast server in every run: on core 1 the busy
    # neighbours would slow the loader itself, and by chance, run to run.
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    with (
        contextlib.ExitStack() as restore,
        LocalServer(data_dir, work, cpus="0", threads=1) as fast,
        LocalServer(data_dir, work, cpus="1", threads=1) as slow,
        Burner("1", count=2),  # one left the server about 0.7 of its speed; two, about half
    ):
        restore.callback(os.sched_setaffinity, 0, affinity)
        setups = {
            "fast": [fast],
            "slow": [slow],
            "both": [fast, slow],
        }
        for repeat in range(repeats):
            for name, servers in setups.items():
                result = run_remote(
                    name,
                    [s.address for s in servers],
                    [s.pid for s in servers],
                    dataset,
                    pipeline,
                    batch_size,
                    images,
                )
                print(
                    f"[{repeat + 1}/{repeats}] {name:<5} {result.images_per_second:8.0f} images/s",
                    flush=True,
                )
                runs[name].append(result)
    return {
        name: sorted(results, key=lambda r: r.images_per_second)[len(results) // 2]
        for name, results in runs.items()
    }


def fleet_table(results: Mapping[str, RunResult]) -> str:
    fast, slow, both = (results[n].images_per_second for n in ("fast", "slow", "both"))
    return "\n".join(
        [
            f"{'run':<44}{'images/s':>9}",
            f"{'fast: server on core 0 alone':<44}{fast:9.0f}",
            f"{'slow: server on core 1 (shared) alone':<44}{slow:9.0f}",
            f"{'both: one loader over the two servers':<44}{both:9.0f}",
            "",
            f"slow/fast images/s               {slow / fast:5.2f}   (the slowed server's speed)",
            f"both/(fast+slow) images/s        {both / (fast + slow):5.2f}   target >= 0.85",
            f"2*slow/(fast+slow)               {2 * slow / (fast + slow):5.2f}   (arithmetic, not "
            "measured: static lanes, batch k on server k % 2, move at the slow server's pace)",
        ]
    )


def run_fleet(args: argparse.Namespace) -> int:
    """Two servers, the second slowed by busy neighbours: solo rates against both."""
    from batchwire.bench import bench_dataset, machine, write_json

    if (os.cpu_count() or 1) < 2:
        print("error: --fleet needs at least 2 cores", file=sys.stderr)
        return 2
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    print(
        f"{dataset}, pipeline {args.pipeline}, batch {args.batch_size}, {args.images} images a run"
    )
    with tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work:
        results = fleet(
            data_dir,
            pathlib.Path(work),
            dataset,
            args.pipeline,
            args.batch_size,
            args.images,
            args.repeats,
        )
    print(fleet_table(results))
    if args.json:
        rows = {name: {"images_per_s": r.images_per_second} for name, r in results.items()}
        write_json(args.json, {"machine": machine(), "fleet": rows})
    return 0
