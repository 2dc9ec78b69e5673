"""``python -m benchmarks --mix [SPEC]``: one server shared by streams of several pipelines.

A shared server serves the ranks of a training job beside a validation pass, another job at
another image size, a job with other augmentation parameters. ``SPEC`` lists the streams
as groups ``COUNT:PIPELINE[:PARAM=VALUE...]`` separated by commas; the default,
:data:`DEFAULT_MIX`, is 8 ``train`` streams at size 64 (a job's ranks) and three others that
differ in pipeline or parameters, one stream each: ``val``, ``train`` at size 96, and
``train`` at size 64 with ``area_min`` 0.25.

One server with default settings (``--device``), every stream a ``PullBatches`` call that
asks as ``RemoteLoader`` does, each on epochs of its own, for ``--duration`` seconds (40).
Reported: per group, the latest first batch and the batches per stream over the whole run;
over all streams, the slowest first batch and the fewest batches of a stream against the
most (the fairness ratio); from the server's metrics, each pipeline's share of the slots'
time, the mean time a batch waited for a slot, and the pipeline builds, evictions and key
switches.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import sys
from typing import Any

from benchmarks._server_probe import ServerProbe
from benchmarks.streams import PeakSampler, run_streams_async

__all__ = ["DEFAULT_MIX", "MixGroup", "MixResult", "measure_mix", "parse_mix", "run_mix"]

DEFAULT_MIX = "8:train:size=64,1:val,1:train:size=96,1:train:size=64:area_min=0.25"


@dataclasses.dataclass(frozen=True)
class MixGroup:
    count: int
    pipeline: str
    params: dict[str, float]

    @property
    def label(self) -> str:
        params = " ".join(f"{k}={v:g}" for k, v in sorted(self.params.items()))
        return f"{self.pipeline} {params}".strip()


def parse_mix(spec: str) -> list[MixGroup]:
    """Groups of ``COUNT:PIPELINE[:PARAM=VALUE...]``, comma-separated; ValueError if not."""
    groups = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        if len(fields) < 2 or not fields[0].isdigit() or int(fields[0]) < 1 or not fields[1]:
            raise ValueError(f"{part!r} is not COUNT:PIPELINE[:PARAM=VALUE...]")
        params = {}
        for field in fields[2:]:
            name, _, value = field.partition("=")
            params[name] = float(value)
        groups.append(MixGroup(int(fields[0]), fields[1], params))
    return groups


@dataclasses.dataclass
class MixResult:
    groups: list[dict[str, Any]]  # label, streams, first_max, batches_min, batches_max
    seconds: float
    images_per_s: float  # all streams, second half
    first_max: float  # the slowest first batch of any stream (inf: one got none)
    fairness: float  # fewest batches of a stream / most, over the whole run
    threads: int
    rss_mib: float
    server: dict[str, dict[str, float]]  # pipeline -> busy share, wait ms, builds, ...


def measure_mix(
    address: str,
    probe: ServerProbe,
    dataset: str,
    groups: list[MixGroup],
    batch_size: int,
    seconds: float,
) -> MixResult:
    requests = [
        {"dataset": dataset, "pipeline": g.pipeline, "batch_size": batch_size, "params": g.params}
        for g in groups
        for _ in range(g.count)
    ]
    with PeakSampler(probe.pid, None) as peak:
        run = asyncio.run(run_streams_async(address, probe, requests, seconds))
    firsts = [first if first is not None else float("inf") for first in run.firsts]
    rows, start = [], 0
    for group in groups:
        mine = range(start, start + group.count)
        start += group.count
        rows.append(
            {
                "label": group.label,
                "streams": group.count,
                "first_max": max(firsts[i] for i in mine),
                "batches_min": min(run.batches[i] for i in mine),
                "batches_max": max(run.batches[i] for i in mine),
            }
        )
    most = max(run.batches)
    return MixResult(
        groups=rows,
        seconds=seconds,
        images_per_s=sum(run.counted) / (seconds / 2),
        first_max=max(firsts),
        fairness=min(run.batches) / most if most else 0.0,
        threads=peak.threads,
        rss_mib=peak.rss_mib,
        server=_server_side(probe),
    )


def _server_side(probe: ServerProbe) -> dict[str, dict[str, float]]:
    """Per pipeline: its share of the slots' busy time, the mean wait of a batch for a slot
    (ms), and the builds, evictions and switches of its pipelines."""
    names = {
        "batchwire_pipeline_busy_seconds_total": "busy",
        "batchwire_pipeline_builds_total": "builds",
        "batchwire_pipeline_evictions_total": "evictions",
        "batchwire_pipeline_switches_total": "switches",
        "batchwire_queue_wait_seconds_sum": "wait_sum",
        "batchwire_queue_wait_seconds_count": "wait_count",
    }
    table: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: dict.fromkeys(names.values(), 0.0)
    )
    for sample in probe.scrape():
        if sample.name in names:
            table[sample.labels["pipeline"]][names[sample.name]] += sample.value
    busy = sum(row["busy"] for row in table.values()) or 1.0
    return {
        pipeline: {
            "busy_share": row["busy"] / busy,
            "wait_ms": row["wait_sum"] / row["wait_count"] * 1000 if row["wait_count"] else 0.0,
            "builds": row["builds"],
            "evictions": row["evictions"],
            "switches": row["switches"],
        }
        for pipeline, row in sorted(table.items())
    }


def table(result: MixResult) -> str:
    lines = [f"{'streams':>7}  {'group':<34} {'first batch max':>15} {'batches/stream':>15}"]
    for row in result.groups:
        spread = f"{row['batches_min']}..{row['batches_max']}"
        first = "never" if row["first_max"] == float("inf") else f"{row['first_max']:.2f}s"
        lines.append(f"{row['streams']:>7}  {row['label']:<34} {first:>15} {spread:>15}")
    slowest = "never" if result.first_max == float("inf") else f"{result.first_max:.2f}s"
    lines += [
        "",
        f"all streams: {result.images_per_s:.0f} images/s; slowest first batch {slowest}; "
        f"fewest batches / most {result.fairness:.2f}; server threads {result.threads}, "
        f"RSS {result.rss_mib:.0f} MiB",
        "",
        f"{'pipeline':<10} {'slot time':>9} {'wait ms':>8} {'builds':>6} {'evicted':>7} "
        f"{'switches':>8}",
    ]
    for pipeline, row in result.server.items():
        lines.append(
            f"{pipeline:<10} {row['busy_share']:>9.0%} {row['wait_ms']:>8.1f} "
            f"{row['builds']:>6.0f} {row['evictions']:>7.0f} {row['switches']:>8.0f}"
        )
    return "\n".join(lines)


def run_mix(args: argparse.Namespace) -> int:
    """One server with default settings on ``--device``, the mix for ``--duration`` (40) s."""
    from batchwire.bench import LocalServer, bench_dataset, machine, write_json

    try:
        groups = parse_mix(args.mix)
    except ValueError as exc:
        print(f"error: --mix: {exc}", file=sys.stderr)
        return 2
    seconds = args.duration or 40.0
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    streams = sum(g.count for g in groups)
    print(
        f"{dataset}, batch {args.batch_size}, device {args.device}: {streams} streams in "
        f"{len(groups)} groups for {seconds:.0f} s, one server with default settings",
        flush=True,
    )
    with LocalServer(
        data_dir, max_streams=max(64, streams + 8), device=args.device, metrics=True
    ) as server:
        assert server.metrics_port is not None  # metrics=True
        probe = ServerProbe(server.pid, server.metrics_port)
        result = measure_mix(server.address, probe, dataset, groups, args.batch_size, seconds)
    print(table(result))
    if args.json:
        run = {"dataset": dataset, "mix": args.mix, "batch_size": args.batch_size}
        run |= {"device": args.device, "seconds": seconds}
        write_json(args.json, {"machine": machine(), "run": run, "mix": dataclasses.asdict(result)})
    return 0
