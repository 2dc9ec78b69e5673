"""``batchwire bench``: throughput, trainer CPU and memory, measured side by side.

    batchwire bench --address HOST:PORT --dataset D     # a running server, as a trainer sees it
    batchwire bench --compare [--json F] [--plot F.png] # (a)..(e) alternated on this host
    batchwire bench --messages                          # gRPC message sizes, parts vs whole
    batchwire bench --scaling                           # one server vs two pinned to their own core
    batchwire bench --duration 600                      # a long run: memory at start and end
    batchwire bench --reading                           # the server's record path: inline or parallel
    batchwire bench --stages                            # CPU per image of each stage, DALI vs PIL
    batchwire bench --streams 1,64,256 [--size 64]      # one server under K concurrent streams
    batchwire bench --fleet                             # two servers, one slowed: one loader over both
    batchwire bench --chaos --duration 300              # servers killed and restarted: exactly once?

Without ``--data-dir``, a dataset of generated ImageNet-sized JPEGs is built once in
the cache (``~/.cache/batchwire/bench``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import sys
import tempfile
import time
from typing import Any

from batchwire.cli import _credentials as credentials

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="measure throughput, trainer CPU and memory (remote vs in-process vs PIL)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--address", help="a running server (HOST:PORT) to measure as a trainer")
    parser.add_argument("--dataset", help="dataset name (default: the generated one)")
    parser.add_argument("--pipeline", default="train", help="pipeline (default train)")
    parser.add_argument("--batch-size", type=int, default=128, help="batch size (default 128)")
    parser.add_argument(
        "--images", type=int, default=4096, help="images per run (default 4096: one epoch)"
    )
    parser.add_argument("--compare", action="store_true", help="runs (a)..(e) side by side")
    parser.add_argument("--repeats", type=int, default=3, help="alternated repetitions (default 3)")
    parser.add_argument(
        "--runs",
        default="inprocess,remote,pil,transport,raw",
        help="with --compare: which of inprocess, remote, pil, transport, raw (default all; "
        "e.g. transport,raw to profile the transport)",
    )
    parser.add_argument("--messages", action="store_true", help="measure gRPC message sizes")
    parser.add_argument("--scaling", action="store_true", help="one vs two servers pinned to cores")
    parser.add_argument(
        "--stages", action="store_true", help="CPU per image of each stage, DALI next to PIL"
    )
    parser.add_argument(
        "--reading",
        action="store_true",
        help="the server's record path (LMDB, parse, screen) inline vs threads vs DALI workers",
    )
    parser.add_argument(
        "--duration", type=float, help="stream for this many seconds; report memory"
    )
    parser.add_argument(
        "--streams",
        help="K[,K...]: one server under K concurrent streams each (--duration seconds a K, "
        "default 20): images/s, server threads and RSS, first batch, rate spread",
    )
    parser.add_argument(
        "--size", type=int, help="with --streams or --chaos: the pipeline's output size"
    )
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="two servers on a core each, one sharing its core with busy processes: their "
        "solo rates against one loader over both",
    )
    parser.add_argument(
        "--chaos",
        action="store_true",
        help="three servers, two ranks, a server killed or drained and restarted every "
        "--every seconds for --duration seconds (default 300): samples lost and repeated",
    )
    parser.add_argument(
        "--every", type=float, default=5.0, help="with --chaos: seconds between stops (5)"
    )
    parser.add_argument(
        "--data-dir", type=pathlib.Path, help="datasets (default: generated photos)"
    )
    parser.add_argument(
        "--photos",
        type=int,
        default=4096,
        help="generated photos (default 4096, so that a run is one epoch, not several short ones)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="DataLoader workers for (c) (default: cores)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="write the results as JSON")
    parser.add_argument("--plot", type=pathlib.Path, help="draw a chart (PNG)")
    credentials.add_arguments(parser)
    parser.set_defaults(func=run, default_log_level="WARNING")
    return parser


def _cache() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return (
        pathlib.Path(os.environ.get("BATCHWIRE_CACHE", pathlib.Path(base) / "batchwire")) / "bench"
    )


def _dataset(args: argparse.Namespace) -> tuple[pathlib.Path, str]:
    """The data directory and dataset name to measure on (generated once if needed)."""
    if args.data_dir is not None:
        if not args.dataset:
            raise SystemExit("error: --data-dir needs --dataset NAME")
        return args.data_dir, args.dataset
    from tqdm import tqdm

    from batchwire.server.data import ingest, write_photo_folders

    name = f"photos-{args.photos}"
    data_dir = _cache() / "datasets"
    if not (data_dir / name / "manifest.json").is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="batchwire-bench-", dir=data_dir.parent) as tmp:
            source = pathlib.Path(tmp) / "images"
            with tqdm(total=args.photos, desc="generating photos", unit="img") as bar:
                write_photo_folders(source, count=args.photos, on_image=lambda: bar.update())
            ingest(source, data_dir, name=name, overwrite=True, progress=True)
    return data_dir, name


def _machine() -> dict[str, Any]:
    from batchwire.server.core import visible_gpu_count

    cpu = "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "gpus": visible_gpu_count(),
        "python": platform.python_version(),
    }


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", leave=False)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.images < args.batch_size or args.repeats < 1:
        print(
            "error: need --batch-size >= 1, --images >= --batch-size, --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    if args.address and not (args.compare or args.messages or args.scaling):
        return _against(args)
    if args.compare:
        return _compare(args)
    if args.messages:
        return _messages(args)
    if args.scaling:
        return _scaling(args)
    if args.reading:
        return _reading(args)
    if args.streams:
        return _streams(args)
    if args.fleet:
        return _fleet(args)
    if args.chaos:
        return _chaos(args)
    if args.stages:
        from batchwire.cli._bench_stages import measure_stages

        data_dir, dataset = _dataset(args)
        print(measure_stages(data_dir / dataset))
        return 0
    if args.duration:
        return _long_run(args)
    print(
        "error: give --address, --compare, --messages, --scaling, --reading, --stages, "
        "--streams, --fleet, --chaos or --duration",
        file=sys.stderr,
    )
    return 2


def _against(args: argparse.Namespace) -> int:
    """A running server, as a trainer sees it: rate, MB/s, first batch, client CPU."""
    from batchwire.cli._bench_probe import CpuClock, rss_mib
    from batchwire.client import RemoteLoader

    if not args.dataset:
        print("error: --address needs --dataset NAME", file=sys.stderr)
        return 2
    loader = RemoteLoader(
        args.address,
        dataset=args.dataset,
        pipeline=args.pipeline,
        batch_size=args.batch_size,
        normalize=False,
        **credentials.loader_options(args),
    )
    deadline = time.monotonic() + args.duration if args.duration else None
    target = args.images
    cpu = CpuClock()
    rss_start = rss_mib([os.getpid()])
    images = nbytes = 0
    first = None
    started = time.perf_counter()
    with _progress(0 if deadline else target, "streaming") as bar:
        while (deadline and time.monotonic() < deadline) or (not deadline and images < target):
            batches = 0
            for batch, _ in loader:
                batches += 1
                first = first or time.perf_counter() - started
                images += len(batch)
                nbytes += batch.numel() * batch.element_size()
                bar.update(len(batch))
                if (deadline and time.monotonic() >= deadline) or (
                    not deadline and images >= target
                ):
                    break
            if batches == 0:  # another epoch would yield none either: stop, and say why
                samples = loader.num_samples
                loader.close()
                print(_no_batch_error(args.dataset, samples, args.batch_size), file=sys.stderr)
                return 2
    seconds = time.perf_counter() - started
    loader.close()
    print(
        f"{images} images in {seconds:.1f}s: {images / seconds:.0f} images/s, {nbytes / seconds / 1e6:.0f} MB/s"
    )
    print(
        f"time to first batch {first:.2f}s; client CPU {cpu.seconds() / images * 1000:.3f} s per 1000 images"
    )
    print(f"client RSS {rss_start:.0f} MiB at start, {rss_mib([os.getpid()]):.0f} MiB at end")
    return 0


def _no_batch_error(dataset: str, samples: int, batch_size: int) -> str:
    return (
        f"error: an epoch of {dataset!r} yielded no batch: --batch-size {batch_size} is larger "
        f"than the dataset ({samples} samples), or than this client's share of it (the last "
        f"partial batch is dropped); lower --batch-size"
    )


def _compare(args: argparse.Namespace) -> int:
    from batchwire.cli._bench_report import draw_chart, summarize, table, write_json
    from batchwire.cli._bench_runs import (
        IMAGE_BYTES,
        LocalServer,
        raw_server,
        run_inprocess,
        run_pil,
        run_raw,
        run_remote,
        transport_server,
    )
    from batchwire.server import ServerConfig
    from batchwire.server.data import Manifest

    data_dir, dataset = _dataset(args)
    num_samples = Manifest.load(data_dir / dataset).num_samples
    message_bytes = min(args.batch_size * IMAGE_BYTES, ServerConfig.max_message_bytes)
    per_message = message_bytes / IMAGE_BYTES
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work,
        LocalServer(data_dir, pathlib.Path(work)) as server,
        transport_server(dataset, num_samples) as (transport_address, transport_pid),
        raw_server(round(per_message) * IMAGE_BYTES) as (raw_address, raw_pid),
    ):
        runs = {
            "inprocess": lambda: run_inprocess(data_dir, dataset, args.batch_size, args.images),
            "remote": lambda: run_remote(
                "remote",
                [server.address],
                [server.pid],
                dataset,
                "train",
                args.batch_size,
                args.images,
            ),
            "pil": lambda: run_pil(data_dir / dataset, args.batch_size, args.images, args.workers),
            "transport": lambda: run_remote(
                "transport",
                [transport_address],
                [transport_pid],
                dataset,
                "transport",
                args.batch_size,
                args.images,
            ),
            "raw": lambda: run_raw(
                raw_address,
                raw_pid,
                round(per_message) * IMAGE_BYTES,
                round(per_message),
                args.images,
            ),
        }
        wanted = [name.strip() for name in args.runs.split(",") if name.strip()]
        unknown = sorted(set(wanted) - set(runs))
        if unknown or not wanted:
            print(f"error: --runs takes names from {', '.join(runs)}", file=sys.stderr)
            return 2
        runs = {name: measure for name, measure in runs.items() if name in wanted}
        for name, measure in runs.items():  # warm-up: pipelines built, caches filled
            print(f"warming up {name} ...", file=sys.stderr)
            measure()
        for repeat in range(args.repeats):
            for name, measure in runs.items():
                result = measure()
                print(
                    f"[{repeat + 1}/{args.repeats}] {name:<10} {result.images_per_second:8.0f} images/s",
                    file=sys.stderr,
                )
                results.append(result)
    summary = summarize(results)
    machine = _machine()
    print(
        f"\nbatchwire bench --compare: {args.images} images per run, batch {args.batch_size}, "
        f"median of {args.repeats}; {machine['cores']} cores ({machine['cpu']}), {machine['gpus']} GPUs"
    )
    print(table(summary))
    if args.json:
        write_json(
            args.json,
            {
                "machine": machine,
                "args": {k: str(v) for k, v in vars(args).items() if k != "func"},
                "summary": summary,
                "runs": [r.__dict__ for r in results],
            },
        )
    if args.plot:
        draw_chart(
            args.plot,
            summary,
            f"batchwire bench --compare ({machine['cores']} cores, batch {args.batch_size})",
        )
    return 0


def _messages(args: argparse.Namespace) -> int:
    """Raw gRPC throughput by message size, and a large batch in parts vs whole."""
    from batchwire.cli._bench_runs import (
        IMAGE_BYTES,
        raw_server,
        run_raw,
        run_remote,
        transport_server,
    )

    print(f"{'message':>10} {'GB/s':>7} {'client CPU-s/GB':>16}")
    rows: list[dict[str, Any]] = []
    for mb in (1, 4, 8, 16, 32):
        size = mb * 2**20
        with raw_server(size) as (address, pid):
            result = run_raw(address, pid, size, 1.0, max(8, 4 * 2**30 // size))
        gigabytes = result.images * size / 1e9
        rows.append(
            {
                "message_mb": mb,
                "gb_per_s": gigabytes / result.seconds,
                "cpu_s_per_gb": result.trainer_cpu / gigabytes,
            }
        )
        print(
            f"{mb:>8} MB {gigabytes / result.seconds:7.2f} {result.trainer_cpu / gigabytes:16.2f}"
        )
    batch = max(args.batch_size, 512)
    print(f"\nbatches of {batch} ({batch * IMAGE_BYTES / 2**20:.0f} MiB), transport only (d):")
    for label, limit in (
        ("parts of 1 MiB", 2**20),
        ("parts of 2 MiB", 2 * 2**20),
        ("parts of 4 MiB", 4 * 2**20),
        ("parts of 8 MiB", 8 * 2**20),
        ("parts of 16 MiB", 16 * 2**20),
        ("whole", 2**30),
    ):
        with transport_server("memory", 4096, max_message_bytes=limit) as (address, pid):
            result = run_remote(
                "transport", [address], [pid], "memory", "transport", batch, batch * 8
            )
        rows.append({"batch": batch, "messages": label, "images_per_s": result.images_per_second})
        print(
            f"  {label:<16} {result.images_per_second:8.0f} images/s ({result.images_per_second * IMAGE_BYTES / 1e9:.2f} GB/s)"
        )
    if args.json:
        from batchwire.cli._bench_report import write_json

        write_json(args.json, {"machine": _machine(), "messages": rows})
    return 0


def _scaling(args: argparse.Namespace) -> int:
    """One server pinned to core 0, then two pinned to cores 0 and 1 with a lane each."""
    from batchwire.cli._bench_runs import LocalServer, run_remote

    cores = os.cpu_count() or 1
    if cores < 2:
        print("error: --scaling needs at least 2 cores", file=sys.stderr)
        return 2
    data_dir, dataset = _dataset(args)
    print(f"{'servers':>8} {'cores':>6} {'images/s':>9}")
    with tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work:
        with LocalServer(data_dir, pathlib.Path(work), cpus="0", threads=1) as one:
            single = run_remote(
                "remote",
                [one.address],
                [one.pid],
                dataset,
                args.pipeline,
                args.batch_size,
                args.images,
            )
        print(f"{1:>8} {'0':>6} {single.images_per_second:9.0f}")
        with (
            LocalServer(data_dir, pathlib.Path(work), cpus="0", threads=1) as a,
            LocalServer(data_dir, pathlib.Path(work), cpus="1", threads=1) as b,
        ):
            double = run_remote(
                "remote",
                [a.address, b.address],
                [a.pid, b.pid],
                dataset,
                args.pipeline,
                args.batch_size,
                args.images,
            )
        print(f"{2:>8} {'0,1':>6} {double.images_per_second:9.0f}")
    print(
        f"scaling: {double.images_per_second / single.images_per_second:.2f}x with 2 servers (ideal 2.00x)"
    )
    return 0


def _reading(args: argparse.Namespace) -> int:
    """The record path inline, in threads and in DALI's parallel workers, next to decoding."""
    from batchwire.cli._bench_reading import measure_reading, measure_serving, reading_table
    from batchwire.cli._bench_runs import run_inprocess

    data_dir, dataset = _dataset(args)
    results = measure_reading(
        data_dir,
        dataset,
        args.batch_size,
        args.images,
        args.repeats,
        decode=lambda: run_inprocess(data_dir, dataset, args.batch_size, args.images),
        log=lambda line: print(line, file=sys.stderr),
    )
    text, rows = reading_table(results)
    workers = os.cpu_count() or 1
    serving, serving_rows = measure_serving(
        data_dir,
        dataset,
        args.batch_size,
        args.images,
        args.repeats,
        workers,
        log=lambda line: print(line, file=sys.stderr),
    )
    machine = _machine()
    print(
        f"\nbatchwire bench --reading: {args.images} records per run, batch {args.batch_size}, "
        f"median of {args.repeats}; {machine['cores']} cores ({machine['cpu']})"
    )
    print(text)
    print(f"\nremote (b) from a server reading inline vs with --read-workers {workers}:")
    print(serving)
    if args.json:
        from batchwire.cli._bench_report import write_json

        write_json(args.json, {"machine": machine, "reading": rows, "serving": serving_rows})
    return 0


def _streams(args: argparse.Namespace) -> int:
    """One server of its own under K concurrent streams, for each K given."""
    from batchwire.cli._bench_runs import LocalServer
    from batchwire.cli._bench_streams import measure_streams, table

    try:
        counts = [int(k) for k in args.streams.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        print("error: --streams takes stream counts, e.g. 1,64,256", file=sys.stderr)
        return 2
    seconds = args.duration or 20.0
    data_dir, dataset = _dataset(args)
    params = {"size": float(args.size)} if args.size else None
    results = []
    print(
        f"{dataset}, pipeline {args.pipeline}, batch {args.batch_size}"
        f"{f', size {args.size}' if args.size else ''}: {seconds:.0f} s a run, a new server each"
    )
    for count in counts:
        with (
            tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work,
            LocalServer(data_dir, pathlib.Path(work), max_streams=max(64, count + 8)) as server,
        ):
            print(f"  {count} streams ...", flush=True)
            results.append(
                measure_streams(
                    server.address,
                    server.pid,
                    dataset,
                    args.pipeline,
                    args.batch_size,
                    count,
                    seconds,
                    params,
                )
            )
    print(table(results))
    if args.json:
        from batchwire.cli._bench_report import write_json

        write_json(args.json, {"machine": _machine(), "streams": [vars(r) for r in results]})
    return 0


def _fleet(args: argparse.Namespace) -> int:
    """Two servers, the second slowed by a busy neighbour: solo rates against both."""
    from batchwire.cli._bench_fleet import fleet, fleet_table

    if (os.cpu_count() or 1) < 2:
        print("error: --fleet needs at least 2 cores", file=sys.stderr)
        return 2
    data_dir, dataset = _dataset(args)
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
        from batchwire.cli._bench_report import write_json

        rows = {name: {"images_per_s": r.images_per_second} for name, r in results.items()}
        write_json(args.json, {"machine": _machine(), "fleet": rows})
    return 0


def _chaos(args: argparse.Namespace) -> int:
    """Servers stopped and restarted under two streaming ranks: exit 1 unless exactly once."""
    from batchwire.cli._bench_fleet import chaos, chaos_report
    from batchwire.server.data import Manifest

    data_dir, dataset = _dataset(args)
    seconds = args.duration or 300.0
    print(
        f"{dataset}: 3 servers, 2 ranks, a server stopped every ~{args.every:.0f} s for {seconds:.0f} s"
    )
    with tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work:
        result = chaos(
            data_dir,
            pathlib.Path(work),
            dataset,
            num_samples=Manifest.load(data_dir / dataset).num_samples,
            pipeline=args.pipeline,
            batch_size=args.batch_size,
            seconds=seconds,
            every=args.every,
            params={"size": float(args.size)} if args.size else None,
        )
    print(chaos_report(result))
    if args.json:
        from batchwire.cli._bench_report import write_json

        chaos = {
            "seconds": result.seconds,
            "kills": dict(result.kills),  # asdict would rebuild a Counter from its items
            "restarts": {str(k): v for k, v in result.restarts.items()},
            "ranks": [dataclasses.asdict(r) for r in result.ranks],
            "rss_start_mib": result.rss_start_mib,
            "rss_end_mib": result.rss_end_mib,
            "exact": result.exact,
        }
        write_json(args.json, {"machine": _machine(), "chaos": chaos})
    return 0 if result.exact else 1


def _long_run(args: argparse.Namespace) -> int:
    """Stream from a local server for --duration seconds; memory at start and end."""
    from batchwire.cli._bench_probe import process_tree, rss_mib
    from batchwire.cli._bench_runs import LocalServer
    from batchwire.client import RemoteLoader

    data_dir, dataset = _dataset(args)
    with (
        tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work,
        LocalServer(data_dir, pathlib.Path(work)) as server,
    ):
        loader = RemoteLoader(
            server.address,
            dataset=dataset,
            pipeline=args.pipeline,
            batch_size=args.batch_size,
            normalize=False,
        )
        samples: list[tuple[float, float, float]] = []
        started = time.monotonic()
        images = 0
        next_sample = started
        with _progress(0, "streaming") as bar:
            while time.monotonic() - started < args.duration:
                for batch, _ in loader:
                    images += len(batch)
                    bar.update(len(batch))
                    now = time.monotonic()
                    if now >= next_sample:
                        samples.append(
                            (
                                now - started,
                                rss_mib(process_tree(server.pid)),
                                rss_mib([os.getpid()]),
                            )
                        )
                        next_sample = now + max(1.0, args.duration / 20)
                    if now - started >= args.duration:
                        break
        loader.close()
    print(f"{images} images in {args.duration:.0f}s ({images / args.duration:.0f} images/s)")
    print(f"{'t (s)':>8} {'server RSS MiB':>15} {'client RSS MiB':>15}")
    for t, server_rss, client_rss in samples:
        print(f"{t:8.0f} {server_rss:15.0f} {client_rss:15.0f}")
    if len(samples) >= 2:
        (_, s0, c0), (_, s1, c1) = samples[1], samples[-1]
        print(f"after warm-up to end: server {s1 - s0:+.0f} MiB, client {c1 - c0:+.0f} MiB")
    return 0
