"""``python -m benchmarks --reading``: the server's record path, read inline or in parallel.

A stream's records are read by ``read_job`` (LMDB read, ``Datum`` parse, format
screen) in the thread that feeds DALI. Whether that should run in parallel is a
question of measurement, so these are measured side by side on the same batches,
alternated, medians reported:

``inline``          ``read_job`` in one thread: what the server does
``threads-N``       ``read_job`` in N threads, a batch each
``dali-inline``     a pass-through DALI pipeline (external_source straight to its outputs)
                    fed by the server's ``PlannedSource`` in this thread
``dali-workers-N``  the same pipeline with a parallel external_source: N worker processes,
                    forked before this process opens any LMDB or touches CUDA (DALI's fork
                    rule), each running the server's ``PlannedSource``
``decode``          the full pipeline in-process, run (a) of ``--compare``, for scale

For each: records/s, and CPU microseconds per record in this process and in the
workers. This process's share is what one server process can spend on records
before its interpreter lock, not its cores, sets the ceiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from batchwire.bench import CpuClock, process_tree

__all__ = ["ReadingResult", "measure_reading", "measure_serving", "reading_table", "run_reading"]


@dataclasses.dataclass(frozen=True)
class ReadingResult:
    name: str
    records: int
    seconds: float
    main_cpu: float
    worker_cpu: float
    worker_processes: int = 0  # DALI worker processes that did the reading

    @property
    def records_per_second(self) -> float:
        return self.records / self.seconds


def _passthrough(source: Any, batch_size: int, workers: int) -> Any:
    """A DALI pipeline whose outputs are its external_source's: only the reading costs."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import Pipeline

    pipe = Pipeline(
        batch_size=batch_size,
        num_threads=os.cpu_count() or 1,
        device_id=None,
        py_num_workers=max(workers, 1),
        py_start_method="fork",
    )
    with pipe:
        encoded, labels, meta = fn.external_source(
            source=source,
            num_outputs=3,
            batch=True,
            batch_info=True,
            parallel=workers > 0,
            dtype=[types.UINT8, types.INT64, types.INT64],
        )
        pipe.set_outputs(encoded, labels, meta)
    if workers > 0:
        pipe.start_py_workers()  # fork now: before any LMDB is open here, before CUDA
    pipe.build()
    return pipe


def _epoch(pipe: Any) -> int:
    records = 0
    try:
        while True:
            _, labels, _ = pipe.run()
            records += len(labels)
    except StopIteration:
        pipe.reset()
    return records


def _timed(name: str, run: Callable[[], int], workers: Sequence[int] = ()) -> ReadingResult:
    main = CpuClock()
    clocks = [CpuClock(pid) for pid in workers]
    started = time.perf_counter()
    records = run()
    seconds = time.perf_counter() - started
    return ReadingResult(
        name,
        records,
        seconds,
        main.seconds(),
        sum(clock.seconds() for clock in clocks),
        len(workers),
    )


def measure_reading(
    data_dir: pathlib.Path,
    dataset: str,
    batch_size: int,
    images: int,
    repeats: int,
    *,
    decode: Callable[[], Any],
    log: Callable[[str], None] = print,
) -> list[ReadingResult]:
    """Every run of the module docstring, ``repeats`` times alternated, after a warm-up."""
    from batchwire.server.core import PlannedSource, read_job
    from batchwire.server.data import Dataset, Manifest

    directory = data_dir / dataset
    batches = _batches(Manifest.load(directory).num_samples, images, batch_size)
    cores = os.cpu_count() or 1

    # Workers first: nothing of LMDB may be open in this process when they fork.
    worker_counts = sorted({1, cores})
    parallel = {}
    for count in worker_counts:
        before = set(process_tree(os.getpid()))
        pipe = _passthrough(PlannedSource(str(directory), batches, read_job), batch_size, count)
        parallel[count] = (pipe, sorted(set(process_tree(os.getpid())) - before))
    inline_pipe = _passthrough(PlannedSource(str(directory), batches, read_job), batch_size, 0)

    dataset_handle = Dataset(directory)

    def inline() -> int:
        return sum(len(read_job(dataset_handle, i, ids).ids) for i, ids in enumerate(batches))

    def threaded(pool: futures.ThreadPoolExecutor) -> int:
        jobs = pool.map(lambda item: read_job(dataset_handle, *item), enumerate(batches))
        return sum(len(job.ids) for job in jobs)

    def decoded() -> ReadingResult:
        result = decode()
        return ReadingResult("decode", result.images, result.seconds, result.trainer_cpu, 0.0)

    with futures.ThreadPoolExecutor(cores, thread_name_prefix="bench-read") as pool:
        runs: dict[str, Callable[[], ReadingResult]] = {
            "inline": lambda: _timed("inline", inline),
            f"threads-{cores}": lambda: _timed(f"threads-{cores}", lambda: threaded(pool)),
            "dali-inline": lambda: _timed("dali-inline", lambda: _epoch(inline_pipe)),
        }
        for count, (pipe, pids) in parallel.items():
            runs[f"dali-workers-{count}"] = functools.partial(
                _timed, f"dali-workers-{count}", functools.partial(_epoch, pipe), pids
            )
        runs["decode"] = decoded
        results = _alternate(runs, repeats, log)
    dataset_handle.close()
    return results


def _batches(num_samples: int, images: int, batch_size: int) -> list[np.ndarray]:
    """``images`` ids in shuffled epochs, cut into batches."""
    rng = np.random.default_rng(0)
    order = np.concatenate(
        [rng.permutation(num_samples) for _ in range(-(-images // num_samples))]
    )[:images]
    return [order[i : i + batch_size] for i in range(0, images, batch_size)]


def _alternate(
    runs: dict[str, Callable[[], ReadingResult]], repeats: int, log: Callable[[str], None]
) -> list[ReadingResult]:
    """Each run once to warm up, then ``repeats`` rounds of all of them."""
    for name, run in runs.items():
        log(f"warming up {name} ...")
        run()
    results = []
    for repeat in range(repeats):
        for name, run in runs.items():
            result = run()
            log(f"[{repeat + 1}/{repeats}] {name:<16} {result.records_per_second:8.0f} records/s")
            results.append(result)
    return results


def reading_table(results: Sequence[ReadingResult]) -> tuple[str, list[dict[str, Any]]]:
    """The medians per run as a table, and as rows for JSON."""
    names = list(dict.fromkeys(r.name for r in results))
    rows: list[dict[str, Any]] = []
    for name in names:
        runs = [r for r in results if r.name == name]
        rows.append(
            {
                "run": name,
                "records": runs[0].records,
                "worker_processes": runs[0].worker_processes,
                "records_per_s": statistics.median(r.records_per_second for r in runs),
                "main_cpu_us_per_record": statistics.median(
                    r.main_cpu / r.records * 1e6 for r in runs
                ),
                "worker_cpu_us_per_record": statistics.median(
                    r.worker_cpu / r.records * 1e6 for r in runs
                ),
            }
        )
    inline = next(row["records_per_s"] for row in rows if row["run"] == "inline")
    decode = next(row["records_per_s"] for row in rows if row["run"] == "decode")
    lines = [
        f"{'run':<16} {'records/s':>10} {'vs inline':>10} {'main CPU us/rec':>16} "
        f"{'worker CPU us/rec':>18}"
    ]
    for row in rows:
        lines.append(
            f"{row['run']:<16} {row['records_per_s']:10.0f} "
            f"{row['records_per_s'] / inline:10.2f} {row['main_cpu_us_per_record']:16.1f} "
            f"{row['worker_cpu_us_per_record']:18.1f}"
        )
    lines.append(
        f"the record path read inline runs at {inline / decode:.1f}x the pipeline's decode rate"
    )
    return "\n".join(lines), rows


def measure_serving(
    data_dir: pathlib.Path,
    dataset: str,
    batch_size: int,
    images: int,
    repeats: int,
    workers: int,
    log: Callable[[str], None] = print,
) -> tuple[str, list[dict[str, Any]]]:
    """Run (b) of ``--compare`` against a server reading inline and one with ``workers``
    read workers, alternated; the medians as a table and as rows for JSON."""
    import tempfile

    from batchwire.bench import LocalServer, RunResult, run_remote

    results: dict[str, list[RunResult]] = {"inline": [], f"read_workers={workers}": []}
    with (
        tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work,
        LocalServer(data_dir, pathlib.Path(work)) as inline,
        LocalServer(data_dir, pathlib.Path(work), read_workers=workers) as parallel,
    ):
        servers = dict(zip(results, (inline, parallel), strict=True))
        for repeat in range(repeats + 1):  # the first round warms up
            for name, server in servers.items():
                result = run_remote(
                    name, [server.address], [server.pid], dataset, "train", batch_size, images
                )
                if repeat:
                    results[name].append(result)
                    log(f"[{repeat}/{repeats}] {name:<16} {result.images_per_second:8.0f} images/s")
    lines = [
        f"{'server':<16} {'images/s':>9} {'first batch s':>14} {'server main CPU-s/1000 img':>27}"
    ]
    rows: list[dict[str, Any]] = []
    for name, runs in results.items():
        row = {
            "server": name,
            "images_per_s": statistics.median(r.images_per_second for r in runs),
            "first_batch_s": statistics.median(r.first_batch_seconds or 0.0 for r in runs),
            "server_main_cpu_per_1000": statistics.median(
                (r.server_cpu or 0.0) / r.images * 1000 for r in runs
            ),
        }
        rows.append(row)
        lines.append(
            f"{name:<16} {row['images_per_s']:9.0f} {row['first_batch_s']:14.2f} "
            f"{row['server_main_cpu_per_1000']:27.2f}"
        )
    return "\n".join(lines), rows


def run_reading(args: argparse.Namespace) -> int:
    """The record path inline, in threads and in DALI's workers, next to decoding; then
    run (b) from a server reading inline and from one with read workers."""
    from batchwire.bench import bench_dataset, machine, run_inprocess, write_json

    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    batch, images, repeats = args.batch_size, args.images, args.repeats

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    results = measure_reading(
        data_dir,
        dataset,
        batch,
        images,
        repeats,
        decode=lambda: run_inprocess(data_dir, dataset, batch, images),
        log=log,
    )
    text, rows = reading_table(results)
    workers = os.cpu_count() or 1
    serving, serving_rows = measure_serving(
        data_dir, dataset, batch, images, repeats, workers, log=log
    )
    host = machine()
    print(
        f"\npython -m benchmarks --reading: {images} records per run, batch {batch}, "
        f"median of {repeats}; {host['cores']} cores ({host['cpu']})"
    )
    print(text)
    print(f"\nremote (b) from a server reading inline vs with --read-workers {workers}:")
    print(serving)
    if args.json:
        write_json(args.json, {"machine": host, "reading": rows, "serving": serving_rows})
    return 0
