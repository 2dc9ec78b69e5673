"""``python -m benchmarks --cold``: the global shuffle from a cold page cache, next to warm.

A dataset larger than the data host's memory is read from the disk in a random order.
Before each cold run the dataset's pages are dropped from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)`` on each shard's ``data.mdb``; no root needed, and
pages only a running server maps stay, so each run starts a server of its own); before each
warm run every shard is read through once. For 1, 4 and 16 streams (``--cold-streams``),
interleaved, medians of ``--repeats``:

- images/s of a server with its read-ahead (the defaults), cold and warm, and their ratio
  (of the medians, and of each repeat's two runs, which run back to back); and cold with
  ``read_ahead_reads = 0`` (each record read when its batch is);
- the server's resident memory at its peak, and its CPU time per image, cold and warm;
- the read stage alone, in this process: records/s of K threads each reading the batches of
  a stream of its own with ``read_job``, cold, with the server's read-ahead and without.

Streams are those of ``--streams`` (raw PullBatches calls, each on an epoch of its own,
``--duration`` seconds, the second half counted). Keep what a run reads (images/s times
``--duration``) well under the dataset's size, or a cold run warms itself as it goes.

With ``--cold-mixture``, a mixture's read path instead, cold and warm, beside one
dataset's: the dataset (``first``) and a copy of it on the same disk (``second``: files of
their own, so pages of their own) mixed half and half, each epoch a random half of each, so
that an epoch reads as many records as one of the dataset; and the dataset alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import statistics
import sys
import threading
import time
from typing import Any

from benchmarks._server_probe import ServerProbe
from benchmarks.streams import StreamsResult, measure_streams

__all__ = [
    "STREAMS",
    "disk_of",
    "evict",
    "measure_read_stage",
    "prewarm",
    "run_cold",
    "run_cold_mixture",
]

STREAMS = (1, 4, 16)
_CHUNK = 8 << 20


def _shards(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("*/data.mdb"))


def evict(directory: pathlib.Path) -> None:
    """Drop the pages of the dataset in ``directory`` from the page cache (those no process
    maps)."""
    for path in _shards(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prewarm(directory: pathlib.Path) -> None:
    """Read every shard of the dataset in ``directory`` once, into the page cache."""
    for path in _shards(directory):
        with path.open("rb", buffering=0) as file:
            while file.read(_CHUNK):
                pass


def disk_of(directory: pathlib.Path) -> str:
    """The block device ``directory`` is on, and whether the kernel calls it rotational."""
    dev = os.stat(directory).st_dev
    block = pathlib.Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    try:
        name = block.resolve().name
        rotational = (block / "queue" / "rotational").read_text().strip()
    except OSError:
        return f"device {os.major(dev)}:{os.minor(dev)}"
    return f"{name} (rotational={rotational})"


def measure_read_stage(
    directory: pathlib.Path, streams: int, batch_size: int, records: int, *, ahead: bool
) -> float:
    """Records/s of ``streams`` threads each reading ``records // streams`` records of its
    own shuffled epoch in batches (``read_job``), from a cold page cache; with ``ahead``,
    through a read-ahead sized as the server's defaults."""
    from batchwire.common.sampler import Plan
    from batchwire.server import ServerConfig
    from batchwire.server.data import Dataset, ReadAhead

    defaults = ServerConfig(data_dir=directory)
    evict(directory)
    per_stream = max(1, records // streams // batch_size)
    with Dataset(directory) as dataset:
        pool = (
            ReadAhead.sized(defaults.read_ahead_reads, defaults.read_ahead_mib) if ahead else None
        )
        plans = [
            Plan(num_samples=dataset.num_samples, batch_size=batch_size, seed=7, epoch=index)
            for index in range(streams)
        ]

        def stream(plan: Plan) -> None:
            batches = [batch.ids for batch in plan.batches()][:per_stream]
            _read_stream(dataset, batches, pool)

        threads = [threading.Thread(target=stream, args=(plan,)) for plan in plans]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        if pool is not None:
            pool.close()
    return per_stream * batch_size * streams / seconds


def _read_stream(dataset: Any, batches: list[Any], pool: Any) -> None:
    """Read ``batches`` in order with ``read_job``, through ``pool`` (a ReadAhead) if any."""
    from batchwire.server.runners import read_job

    def read(seq: int) -> Any:
        return read_job(dataset, seq, batches[seq])

    if pool is None:
        for seq in range(len(batches)):
            read(seq)
        return
    reader = pool.open(dataset)
    reader.follow(_Planned(batches))
    try:
        for seq in range(len(batches)):
            # As a stream's read tells its read-ahead (BatchStream.read).
            reader.reading(seq)
            try:
                read(seq)
            finally:
                reader.read(seq)
    finally:
        reader.close()


@dataclasses.dataclass(frozen=True)
class _Planned:
    """The ids of each batch of a stream read here (a read-ahead's ``BatchIds``)."""

    batches: list[Any]

    def batch_ids(self, seq: int) -> Any:
        return self.batches[seq] if seq < len(self.batches) else None


@dataclasses.dataclass(frozen=True)
class _Run:
    streams: int
    state: str  # "cold", "warm", or "cold, one at a time"
    serving: StreamsResult


def _serve(
    args: argparse.Namespace, data_dir: pathlib.Path, dataset: str, streams: int, state: str
) -> StreamsResult:
    from batchwire.bench import NO_DECODE_TOML, LocalServer

    directory = data_dir / dataset
    if state == "warm":
        prewarm(directory)
    else:
        evict(directory)
    with LocalServer(
        data_dir,
        max_streams=max(64, streams + 8),
        device=args.device,
        metrics=True,
        read_ahead_reads=0 if state.endswith("one at a time") else None,
        pipelines=NO_DECODE_TOML,  # --pipeline nodecode: the record path without decoding
    ) as server:
        assert server.metrics_port is not None  # metrics=True
        probe = ServerProbe(server.pid, server.metrics_port)
        return measure_streams(
            server.address,
            probe,
            dataset,
            args.pipeline,
            args.batch_size,
            streams,
            args.duration or 20.0,
            {"size": float(args.size)} if args.size else None,
        )


_STATES = ("warm", "cold", "cold, one at a time")


def _values(runs: list[_Run], streams: int, state: str, field: str) -> list[float]:
    """``field`` of each run of ``streams`` streams in ``state``, in the order run."""
    return [getattr(r.serving, field) for r in runs if r.streams == streams and r.state == state]


def _median(runs: list[_Run], streams: int, state: str, field: str) -> float:
    return statistics.median(_values(runs, streams, state, field))


def _ratios(runs: list[_Run], streams: int) -> list[float]:
    """Cold / warm of each repeat (the two run back to back), in the order run."""
    cold = _values(runs, streams, "cold", "images_per_s")
    warm = _values(runs, streams, "warm", "images_per_s")
    return [c / w for c, w in zip(cold, warm, strict=True)]


def _tables(
    runs: list[_Run], reads: dict[tuple[int, bool], list[float]], counts: list[int]
) -> tuple[str, list[dict[str, Any]]]:
    lines = [
        f"{'streams':>7} {'cold img/s':>11} {'warm img/s':>11} {'cold/warm':>10} "
        f"{'cold, 1-at-a-time':>18} {'RSS cold MiB':>13} {'RSS warm MiB':>13} {'RSS c/w':>8}"
        f" {'CPU ms/img cold':>16} {'warm':>6}  cold/warm, each repeat"
    ]
    rows: list[dict[str, Any]] = []
    for k in counts:
        row: dict[str, Any] = {
            "streams": k,
            "cold_images_per_s": _median(runs, k, "cold", "images_per_s"),
            "warm_images_per_s": _median(runs, k, "warm", "images_per_s"),
            "cold_one_at_a_time_images_per_s": _median(
                runs, k, "cold, one at a time", "images_per_s"
            ),
            "rss_cold_mib": _median(runs, k, "cold", "rss_mib"),
            "rss_warm_mib": _median(runs, k, "warm", "rss_mib"),
            "read_ahead_records_per_s": statistics.median(reads[k, True]),
            "one_at_a_time_records_per_s": statistics.median(reads[k, False]),
            "cpu_ms_per_image_cold": _median(runs, k, "cold", "cpu_ms_per_image"),
            "cpu_ms_per_image_warm": _median(runs, k, "warm", "cpu_ms_per_image"),
            "cold_over_warm_each_repeat": _ratios(runs, k),
        }
        rows.append(row)
        lines.append(
            f"{k:>7} {row['cold_images_per_s']:>11.0f} {row['warm_images_per_s']:>11.0f} "
            f"{row['cold_images_per_s'] / row['warm_images_per_s']:>10.2f} "
            f"{row['cold_one_at_a_time_images_per_s']:>18.0f} {row['rss_cold_mib']:>13.0f} "
            f"{row['rss_warm_mib']:>13.0f} {row['rss_cold_mib'] / row['rss_warm_mib']:>8.2f} "
            f"{row['cpu_ms_per_image_cold']:>16.3f} {row['cpu_ms_per_image_warm']:>6.3f}  "
            + " ".join(f"{ratio:.2f}" for ratio in row["cold_over_warm_each_repeat"])
        )
    lines += [
        "",
        f"{'streams':>7} {'read stage, cold: read-ahead':>29} {'one at a time':>14} "
        f"{'ratio':>6}  (records/s)",
    ]
    for row in rows:
        ratio = row["read_ahead_records_per_s"] / row["one_at_a_time_records_per_s"]
        lines.append(
            f"{row['streams']:>7} {row['read_ahead_records_per_s']:>29.0f} "
            f"{row['one_at_a_time_records_per_s']:>14.0f} {ratio:>6.2f}"
        )
    return "\n".join(lines), rows


def run_cold(args: argparse.Namespace) -> int:
    """Each stream count cold and warm, interleaved, a new server each; then the read
    stage alone, cold, with and without read-ahead."""
    from batchwire.bench import bench_dataset, machine, write_json

    if args.cold_mixture:
        return run_cold_mixture(args)
    counts = [int(k) for k in args.cold_streams.split(",")]
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    directory = data_dir / dataset
    size = sum(path.stat().st_size for path in _shards(directory))
    host = machine()
    print(
        f"python -m benchmarks --cold: {dataset} ({size / 2**30:.1f} GiB on disk "
        f"{disk_of(directory)}), pipeline {args.pipeline}, batch {args.batch_size}, "
        f"{args.duration or 20.0:.0f} s a run, median of {args.repeats}; {host['cores']} cores "
        f"({host['cpu']})",
        flush=True,
    )
    runs: list[_Run] = []
    reads: dict[tuple[int, bool], list[float]] = {}
    for repeat in range(args.repeats):
        for k in counts:
            for state in _STATES if repeat % 2 == 0 else _STATES[::-1]:
                result = _serve(args, data_dir, dataset, k, state)
                runs.append(_Run(k, state, result))
                print(
                    f"  [{repeat + 1}] {k} streams, {state}: {result.images_per_s:.0f} "
                    f"images/s, RSS {result.rss_mib:.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
            for ahead in (True, False) if repeat % 2 == 0 else (False, True):
                rate = measure_read_stage(directory, k, args.batch_size, args.images, ahead=ahead)
                reads.setdefault((k, ahead), []).append(rate)
                print(
                    f"  [{repeat + 1}] read stage, {k} threads, "
                    f"{'read-ahead' if ahead else 'one at a time'}: {rate:.0f} records/s",
                    file=sys.stderr,
                    flush=True,
                )
    text, rows = _tables(runs, reads, counts)
    print(text)
    if args.json:
        run = {"dataset": dataset, "bytes": size, "disk": disk_of(directory)}
        run |= {"pipeline": args.pipeline, "batch_size": args.batch_size}
        write_json(args.json, {"machine": host, "run": run, "cold": rows})
    return 0


_MIXED = ("first", "second")


def _mixture_dir(data_dir: pathlib.Path, dataset: str) -> pathlib.Path:
    """A data directory of ``first`` (``dataset``, linked) and ``second`` (a copy of its
    files, made once), beside ``data_dir``."""
    root = data_dir.parent / f"{data_dir.name}-cold-mixture" / dataset
    first, second = root / _MIXED[0], root / _MIXED[1]
    if not first.exists():
        root.mkdir(parents=True, exist_ok=True)
        first.symlink_to((data_dir / dataset).resolve(), target_is_directory=True)
    if not second.exists():
        shutil.copytree(data_dir / dataset, root / ".copying", dirs_exist_ok=True)
        (root / ".copying").rename(second)
    return root


def _serve_mixture(
    args: argparse.Namespace, root: pathlib.Path, size: int, streams: int, state: str, kind: str
) -> StreamsResult:
    from batchwire.bench import NO_DECODE_TOML, LocalServer
    from batchwire.v1 import batchwire_pb2

    for name in _MIXED:
        (prewarm if state == "warm" else evict)(root / name)
    sources = [batchwire_pb2.Source(dataset=name, count=size // 2) for name in _MIXED]
    with LocalServer(
        root,
        max_streams=max(64, streams + 8),
        device=args.device,
        metrics=True,
        pipelines=NO_DECODE_TOML,
    ) as server:
        assert server.metrics_port is not None  # metrics=True
        return measure_streams(
            server.address,
            ServerProbe(server.pid, server.metrics_port),
            _MIXED[0],
            args.pipeline,
            args.batch_size,
            streams,
            args.duration or 20.0,
            {"size": float(args.size)} if args.size else None,
            sources=sources if kind == "mixture" else (),
        )


def run_cold_mixture(args: argparse.Namespace) -> int:
    """Each stream count, cold and warm, one dataset and a mixture, interleaved, a new
    server each (see the module)."""
    from batchwire.bench import bench_dataset, machine, write_json
    from batchwire.server.data import Dataset

    counts = [int(k) for k in args.cold_streams.split(",")]
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    root = _mixture_dir(data_dir, dataset)
    with Dataset(root / _MIXED[0]) as opened:
        size = opened.num_samples
    host = machine()
    print(
        f"python -m benchmarks --cold --cold-mixture: {dataset} ({size} samples) alone and "
        f"mixed half and half with a copy of it, on {disk_of(root / _MIXED[1])}, pipeline "
        f"{args.pipeline}, batch {args.batch_size}, {args.duration or 20.0:.0f} s a run, "
        f"median of {args.repeats}; {host['cores']} cores ({host['cpu']})",
        flush=True,
    )
    results: dict[tuple[int, str, str], list[float]] = {}
    kinds = ("one", "mixture")
    for repeat in range(args.repeats):
        for k in counts:
            for state in ("cold", "warm") if repeat % 2 == 0 else ("warm", "cold"):
                for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                    result = _serve_mixture(args, root, size, k, state, kind)
                    results.setdefault((k, state, kind), []).append(result.images_per_s)
                    print(
                        f"  [{repeat + 1}] {k} streams, {state}, {kind}: "
                        f"{result.images_per_s:.0f} images/s",
                        file=sys.stderr,
                        flush=True,
                    )
    lines = [
        f"{'streams':>7} {'state':>5} {'one img/s':>10} {'mixture img/s':>14} {'mixture/one':>12}"
    ]
    rows = []
    for k in counts:
        for state in ("cold", "warm"):
            one, mixed = (statistics.median(results[k, state, kind]) for kind in kinds)
            rows.append({"streams": k, "state": state, "one": one, "mixture": mixed})
            lines.append(f"{k:>7} {state:>5} {one:>10.0f} {mixed:>14.0f} {mixed / one:>12.2f}")
    print("\n".join(lines))
    if args.json:
        run = {"dataset": dataset, "samples": size, "disk": disk_of(root / _MIXED[1])}
        run |= {"pipeline": args.pipeline, "batch_size": args.batch_size}
        write_json(args.json, {"machine": host, "run": run, "cold_mixture": rows})
    return 0
