"""batchwire bench: a running server as a trainer sees it, or the runs side by side.

  batchwire bench --address HOST:PORT --dataset D          a running server, as a trainer
                                                           sees it (rate, first batch, CPU,
                                                           the wait between passes)
  batchwire bench --address HOST:PORT --dataset D --duration 600   the same for 10 minutes
  batchwire bench --compare [--json F] [--plot F.png]      the runs below, alternated on
                                                           this host, medians printed

--compare runs, on the same data and cores:
  (a) dali       DALI's own pipeline in this process, as a DALI user writes it (its caffe
                 reader over the dataset's shards, the same graph, its PyTorch iterator)
  (b) remote     a local batchwire serve streaming to RemoteLoader
  (c) pil        a torch DataLoader decoding with PIL from the same LMDB (--workers)
  (d) transport  batchwire's streaming path over batches already in memory, no decoding
  (e) raw        plain gRPC with messages of the same sizes: the ceiling
  and engine (batchwire's engine in this process, no gRPC) and the stand-ins nodecode
  (records cut to one image, no decoding), socket (the same from a server without shared
  memory: a trainer on another host's path) and small (48-pixel JPEGs), each beside DALI's
  own pipeline, and mixture: a mixture of two datasets (the same records under two names)
  beside one of them, both without decoding, so that what mixing costs shows; and the
  presets of several outputs, each beside DALI's own pipeline of the same graph: multicrop
  (DINO's ten views of each photo), detection (generated COCO pictures, DALI's COCO
  reader for DALI's own), segmentation (the same pictures and their masks as PNGs,
  DALI's file readers for DALI's own) and captions (the generated photos with a caption
  each, as WebDataset .tar shards: DALI's WebDataset reader for DALI's own, the same
  shards ingested for the server). It prints the ratios against their targets. Without
  --data-dir it builds generated ImageNet-sized photos once in the cache
  (~/.cache/batchwire/bench).

More benchmarks (message sizes, scaling, many streams, profiles) run from a checkout of
batchwire as python -m benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchwire.cli import _credentials as credentials
from batchwire.cli._datasets import batched, dataset_or_mixture

if TYPE_CHECKING:
    from batchwire.bench import RunResult
    from batchwire.client import Mixture

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

NO_MODE = (
    "error: give --address HOST:PORT --dataset NAME (a running server, as a trainer sees "
    "it) or --compare (runs (a)..(e) side by side on this host). The research modes "
    "(--messages, --scaling, --reading, --stages, --streams, --fleet, --chaos, and a long "
    "run with --duration alone) live in `python -m benchmarks`, run from a checkout of "
    "batchwire."
)


HELP = "measure a running server as a trainer sees it, or compare (a)..(e) on this host"
DESCRIPTION = __doc__
RAW_DESCRIPTION = True
DEFAULT_LOG_LEVEL = "WARNING"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from batchwire.bench import add_run_arguments

    parser.add_argument("--address", help="a running server (HOST:PORT) to measure as a trainer")
    add_run_arguments(parser)
    parser.add_argument(
        "--duration", type=float, help="with --address: stream for this many seconds instead"
    )
    parser.add_argument("--compare", action="store_true", help="runs (a)..(e) side by side")
    parser.add_argument(
        "--runs",
        default=",".join(_RUNS),
        help="with --compare: which of " + ", ".join(_RUNS) + " (default all; e.g. "
        "transport,raw to profile the transport, nodecode,small for the stand-ins)",
    )
    parser.add_argument(
        "--standin-images",
        type=int,
        default=0,
        help="with --compare: images per run of the stand-ins (default 8 x --images)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="DataLoader workers for (c) (default: cores)",
    )
    parser.add_argument(
        "--json", type=pathlib.Path, help="with --compare: write the results as JSON"
    )
    parser.add_argument("--plot", type=pathlib.Path, help="with --compare: draw a chart (PNG)")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (they are off anyway where output is not a terminal)",
    )
    credentials.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.images < args.batch_size or args.repeats < 1:
        print(
            "error: need --batch-size >= 1, --images >= --batch-size, --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    if args.compare:
        from batchwire.bench import ServerStartError

        try:
            return _compare(args)
        except ServerStartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.address:
        return _against(args)
    print(NO_MODE, file=sys.stderr)
    return 2


def _against(args: argparse.Namespace) -> int:
    """A running server, as a trainer sees it: rate, MB/s, first batch, client CPU."""
    from batchwire.client import BatchwireError

    if not args.dataset:
        print("error: --address needs --dataset NAME (or NAME=WEIGHT,NAME=WEIGHT)", file=sys.stderr)
        return 2
    try:
        dataset = dataset_or_mixture(args.dataset)
    except argparse.ArgumentTypeError as exc:
        print(f"error: --dataset {exc}", file=sys.stderr)
        return 2
    try:
        dataset = batched(dataset, args.batching)
    except argparse.ArgumentTypeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _measure_against(args, dataset)
    except BatchwireError as exc:
        print(f"error: {exc.details}", file=sys.stderr)
        return 2


def _measure_against(args: argparse.Namespace, dataset: str | Mixture) -> int:
    from batchwire.bench import CpuClock, progress, rss_mib
    from batchwire.client import RemoteLoader

    loader = RemoteLoader(
        args.address,
        dataset=dataset,
        pipeline=args.pipeline,
        batch_size=args.batch_size,
        drop_last=True,  # full batches, as training measures them and `bench` runs its anchor
        normalize=False,
        **credentials.loader_options(args),
    )
    deadline = time.monotonic() + args.duration if args.duration else None
    target = args.images
    cpu = CpuClock()
    rss_start = rss_mib([os.getpid()])
    images = nbytes = 0
    first = None
    # Seconds from a batch to the next: within a pass, and from a pass's last batch to the
    # first of the pass after it (what a trainer waits at each epoch's start).
    within: list[float] = []
    between: list[float] = []
    last_at = None
    started = time.perf_counter()
    with progress(0 if deadline else target, "streaming", show=not args.no_progress) as bar:
        while (deadline and time.monotonic() < deadline) or (not deadline and images < target):
            batches = 0
            for batch, _ in loader:
                now = time.perf_counter()
                if last_at is not None:
                    (within if batches else between).append(now - last_at)
                last_at = now
                batches += 1
                first = first or now - started
                images += len(batch)
                nbytes += batch.numel() * batch.element_size()
                bar.update(len(batch))
                if (deadline and time.monotonic() >= deadline) or (
                    not deadline and images >= target
                ):
                    last_at = None  # a pass left mid-way: the next is not its sequel
                    break
            if batches == 0:  # another epoch would yield none either: stop, and say why
                samples = loader.num_samples
                loader.close()
                print(
                    _no_batch_error(loader.dataset_name, samples, args.batch_size), file=sys.stderr
                )
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
    if between and within:
        print(
            f"between passes: {statistics.median(between):.3f}s from a pass's last batch to the "
            f"next one's first (median of {len(between)}), against "
            f"{statistics.median(within):.3f}s from batch to batch within a pass"
        )
    return 0


def _no_batch_error(dataset: str, samples: int, batch_size: int) -> str:
    return (
        f"error: an epoch of {dataset!r} yielded no batch: --batch-size {batch_size} is larger "
        f"than the dataset ({samples} samples), or than this client's share of it (the last "
        f"partial batch is dropped); lower --batch-size"
    )


_RUNS = (
    "dali",
    "remote",
    "pil",
    "transport",
    "raw",
    "engine",
    "nodecode",
    "socket",
    "small",
    "mixture",
    "multicrop",
    "detection",
    "segmentation",
    "captions",
)
# A stand-in is two measured runs: DALI's own pipeline in-process and the server's; the
# mixture, one dataset and a mixture (batched at random, stratified and per source) through
# the same server.
_PAIRS = {
    "nodecode": ("dali-nodecode", "remote-nodecode"),
    "socket": ("dali-nodecode", "remote-socket"),
    "small": ("dali-small", "remote-small"),
    "mixture": ("remote-one", "remote-mixture", "remote-stratified", "remote-per-source"),
    "multicrop": ("dali-multicrop", "remote-multicrop"),
    "detection": ("dali-detection", "remote-detection"),
    "segmentation": ("dali-segmentation", "remote-segmentation"),
    "captions": ("dali-captions", "remote-captions"),
}


def _compare(args: argparse.Namespace) -> int:
    """Runs (a)..(e), the diagnostic and the stand-ins alternated on the same data and
    cores, medians reported."""
    from batchwire.bench import (
        IMAGE_BYTES,
        NO_DECODE_TOML,
        SMALL_PHOTO,
        LocalServer,
        bench_captions,
        bench_coco,
        bench_dataset,
        bench_masks,
        raw_server,
        transport_server,
    )
    from batchwire.server.data import Manifest

    wanted = [name.strip() for name in args.runs.split(",") if name.strip()]
    if not wanted or set(wanted) - set(_RUNS):
        print(f"error: --runs takes names from {', '.join(_RUNS)}", file=sys.stderr)
        return 2
    show = not args.no_progress
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos, progress=show)
    num_samples = Manifest.load(data_dir / dataset).num_samples
    if num_samples < args.batch_size:
        print(_no_batch_error(dataset, num_samples, args.batch_size), file=sys.stderr)
        return 2
    # The small-image stand-in's photos are made only where it runs.
    small_dir, small = data_dir, dataset
    if "small" in wanted:
        small_dir, small = bench_dataset(None, None, args.photos, SMALL_PHOTO, progress=show)
    with contextlib.ExitStack() as stack:
        work = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchwire-")))
        server = stack.enter_context(LocalServer(data_dir, work, pipelines=NO_DECODE_TOML))
        small_server = server
        if small_dir != data_dir:
            small_server = stack.enter_context(LocalServer(small_dir, work))
        transport = stack.enter_context(transport_server(dataset, num_samples))
        raw = stack.enter_context(raw_server(_per_message(args.batch_size) * IMAGE_BYTES))
        servers = {
            "": (server.address, server.pid),
            "small": (small_server.address, small_server.pid),
        }
        if "socket" in wanted:
            # No shared memory: the path of a trainer on another host, over loopback.
            remote_only = {"shared_memory": False}
            socket_server = stack.enter_context(
                LocalServer(data_dir, work, pipelines=NO_DECODE_TOML, settings=remote_only)
            )
            servers["socket"] = (socket_server.address, socket_server.pid)
        if "mixture" in wanted:
            # The dataset under two names: a mixture's records are then the same bytes as
            # one dataset's, and only mixing differs.
            mixed = work / "mixture"
            mixed.mkdir()
            for name in _MIXED:
                (mixed / name).symlink_to((data_dir / dataset).resolve(), target_is_directory=True)
            mixed_server = stack.enter_context(LocalServer(mixed, work, pipelines=NO_DECODE_TOML))
            servers["mixture"] = (mixed_server.address, mixed_server.pid)
        coco = None
        if "detection" in wanted:
            coco, coco_dir, coco_name = bench_coco(args.photos, progress=show)
            coco_server = stack.enter_context(LocalServer(coco_dir, work, pipelines=NO_DECODE_TOML))
            servers["detection"] = (coco_server.address, coco_server.pid)
            servers["detection-dataset"] = (coco_name, 0)
        masks = None
        if "segmentation" in wanted:
            masks, masks_dir, masks_name = bench_masks(args.photos, progress=show)
            masks_server = stack.enter_context(LocalServer(masks_dir, work))
            servers["segmentation"] = (masks_server.address, masks_server.pid)
            servers["segmentation-dataset"] = (masks_name, 0)
        shards = None
        if "captions" in wanted:
            shards, captions_dir, captions_name = bench_captions(args.photos, progress=show)
            captions_server = stack.enter_context(
                LocalServer(captions_dir, work, pipelines=NO_DECODE_TOML)
            )
            servers["captions"] = (captions_server.address, captions_server.pid)
            servers["captions-dataset"] = (captions_name, 0)
        data = _PresetData(coco=coco, masks=masks, shards=shards)
        runs = _compare_runs(
            args, data_dir / dataset, small_dir / small, servers, transport, raw, data
        )
        chosen = [run for name in _RUNS if name in wanted for run in _PAIRS.get(name, (name,))]
        results = _alternate({run: runs[run] for run in chosen}, args.repeats)
    _report_compare(args, results)
    return 0


# The mixture run's two datasets, and how it mixes them.
_MIXED = ("first", "second")
# The presets' sizes in their runs: DINO's 224 and 96 pixel views, SSD's 320 (the detection
# run's pictures are --photos generated COCO pictures).
_MULTICROP = {"global_size": 224.0, "local_size": 96.0}
_DETECTION = {"size": 320.0}
_SEGMENTATION = {"size": 320.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PresetData:
    """What DALI's own pipelines of the presets read, where their runs are asked for: the
    COCO file of the detection run's pictures, the folder of the segmentation run's pictures
    and masks, the folder of the captions run's WebDataset shards."""

    coco: pathlib.Path | None = None
    masks: pathlib.Path | None = None
    shards: pathlib.Path | None = None


def _per_message(batch_size: int) -> int:
    """Images per gRPC message of run (e): as many as one message of (b) carries."""
    from batchwire.bench import IMAGE_BYTES
    from batchwire.server import ServerConfig

    return round(min(batch_size * IMAGE_BYTES, ServerConfig.max_message_bytes) / IMAGE_BYTES)


def _compare_runs(
    args: argparse.Namespace,
    dataset_dir: pathlib.Path,
    small_dir: pathlib.Path,
    servers: dict[str, tuple[str, int]],
    transport: tuple[str, int],
    raw: tuple[str, int],
    data: _PresetData,
) -> dict[str, Callable[[], RunResult]]:
    """Each run as a function that measures one run of it; servers as (address, pid)."""
    from batchwire.bench import (
        IMAGE_BYTES,
        SMALL_SIZE,
        run_dali,
        run_inprocess,
        run_pil,
        run_raw,
        run_remote,
    )
    from batchwire.client import Mixture

    batch, images = args.batch_size, args.images
    standin = args.standin_images or 8 * images
    per_message = _per_message(batch)
    dataset, small = dataset_dir.name, small_dir.name
    small_params = {"size": float(SMALL_SIZE)}

    def remote(
        name: str, at: tuple[str, int], data: str | Mixture, pipeline: str, count: int, **kw: Any
    ) -> RunResult:
        return run_remote(name, [at[0]], [at[1]], data, pipeline, batch, count, **kw)

    mixture = Mixture(dict.fromkeys(_MIXED, 0.5))
    stratified = Mixture(dict.fromkeys(_MIXED, 0.5), batching="stratified")
    per_source = Mixture(dict.fromkeys(_MIXED, 0.5), batching="per_source")
    return {
        "dali": lambda: run_dali("dali", dataset_dir, "train", batch, images),
        "remote": lambda: remote("remote", servers[""], dataset, "train", images),
        "pil": lambda: run_pil(dataset_dir, batch, images, args.workers),
        "transport": lambda: remote("transport", transport, dataset, "transport", images),
        "raw": lambda: run_raw(raw[0], raw[1], per_message * IMAGE_BYTES, per_message, images),
        "engine": lambda: run_inprocess(dataset_dir.parent, dataset, batch, images, name="engine"),
        "dali-nodecode": lambda: run_dali("dali-nodecode", dataset_dir, "nodecode", batch, standin),
        "remote-nodecode": lambda: remote(
            "remote-nodecode", servers[""], dataset, "nodecode", standin
        ),
        "remote-socket": lambda: remote(
            "remote-socket", servers["socket"], dataset, "nodecode", standin
        ),
        "dali-small": lambda: run_dali(
            "dali-small", small_dir, "train", batch, standin, params=small_params
        ),
        "remote-small": lambda: remote(
            "remote-small", servers["small"], small, "train", standin, params=small_params
        ),
        "remote-one": lambda: remote(
            "remote-one", servers["mixture"], _MIXED[0], "nodecode", standin
        ),
        "remote-mixture": lambda: remote(
            "remote-mixture", servers["mixture"], mixture, "nodecode", standin
        ),
        "remote-stratified": lambda: remote(
            "remote-stratified", servers["mixture"], stratified, "nodecode", standin
        ),
        "remote-per-source": lambda: remote(
            "remote-per-source", servers["mixture"], per_source, "nodecode", standin
        ),
        "dali-multicrop": lambda: run_dali(
            "dali-multicrop", dataset_dir, "multicrop", batch, images, params=_MULTICROP
        ),
        "remote-multicrop": lambda: remote(
            "remote-multicrop", servers[""], dataset, "multicrop", images, params=_MULTICROP
        ),
        "dali-detection": lambda: run_dali(
            "dali-detection",
            dataset_dir,
            "detection",
            batch,
            images,
            params=_DETECTION,
            coco=data.coco,
        ),
        "remote-detection": lambda: remote(
            "remote-detection",
            servers["detection"],
            servers["detection-dataset"][0],
            "detection",
            images,
            params=_DETECTION,
        ),
        "dali-segmentation": lambda: run_dali(
            "dali-segmentation",
            dataset_dir,
            "segmentation",
            batch,
            images,
            params=_SEGMENTATION,
            masks=data.masks,
        ),
        "remote-segmentation": lambda: remote(
            "remote-segmentation",
            servers["segmentation"],
            servers["segmentation-dataset"][0],
            "segmentation",
            images,
            params=_SEGMENTATION,
        ),
        "dali-captions": lambda: run_dali(
            "dali-captions", dataset_dir, "captions", batch, images, webdataset=data.shards
        ),
        "remote-captions": lambda: remote(
            "remote-captions",
            servers["captions"],
            servers["captions-dataset"][0],
            "captions",
            images,
        ),
    }


def _alternate(runs: dict[str, Callable[[], RunResult]], repeats: int) -> list[RunResult]:
    """Each run once to warm up (pipelines built, caches filled), then ``repeats`` rounds."""
    for name, measure in runs.items():
        print(f"warming up {name} ...", file=sys.stderr)
        measure()
    results = []
    for repeat in range(repeats):
        for name, measure in runs.items():
            result = measure()
            print(
                f"[{repeat + 1}/{repeats}] {name:<10} {result.images_per_second:8.0f} images/s",
                file=sys.stderr,
            )
            results.append(result)
    return results


def _report_compare(args: argparse.Namespace, results: list[RunResult]) -> None:
    from batchwire.bench import draw_chart, machine, summarize, table, write_json

    summary = summarize(results)
    host = machine()
    standin = args.standin_images or 8 * args.images
    print(
        f"\nbatchwire bench --compare: {args.images} images per run ({standin} for nodecode, "
        f"small and mixture), batch {args.batch_size}, median of {args.repeats}; "
        f"{host['cores']} cores ({host['cpu']}), {host['gpus']} GPUs"
    )
    print(table(summary))
    if args.json:
        write_json(
            args.json,
            {
                "machine": host,
                "args": {k: str(v) for k, v in vars(args).items() if k != "func"},
                "summary": summary,
                "runs": [r.__dict__ for r in results],
            },
        )
    if args.plot:
        draw_chart(
            args.plot,
            summary,
            f"batchwire bench --compare ({host['cores']} cores, batch {args.batch_size})",
        )
