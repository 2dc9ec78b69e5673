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
import dataclasses
import os
import pathlib
import statistics
import sys
import time
from typing import TYPE_CHECKING

from batchwire.cli import _credentials as credentials
from batchwire.cli._bench_compare import RUNS, compare
from batchwire.cli._datasets import batched, dataset_or_mixture, no_batch_error

if TYPE_CHECKING:
    from batchwire.client import Mixture, RemoteLoader

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
        default=",".join(RUNS),
        help="with --compare: which of " + ", ".join(RUNS) + " (default all; e.g. "
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
            return compare(args)
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
    from batchwire.bench import CpuClock, rss_mib
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
    cpu = CpuClock()
    rss_start = rss_mib([os.getpid()])
    streamed = _stream(loader, args)
    if streamed is None:  # another epoch would yield none either: stop, and say why
        samples = loader.num_samples
        loader.close()
        print(no_batch_error(loader.dataset_name, samples, args.batch_size), file=sys.stderr)
        return 2
    loader.close()
    _print_streamed(streamed, cpu.seconds(), rss_start, rss_mib([os.getpid()]))
    return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Streamed:
    """What a trainer saw of a server: ``images`` of ``nbytes`` in ``seconds``, the first
    batch ``first`` seconds after the start; the seconds from a batch to the next within a
    pass (``within``), and from a pass's last batch to the first of the pass after it
    (``between``: what a trainer waits at each epoch's start)."""

    images: int
    nbytes: int
    seconds: float
    first: float | None
    within: list[float]
    between: list[float]


def _stream(loader: RemoteLoader, args: argparse.Namespace) -> _Streamed | None:
    """Pass after pass of ``loader`` until ``args.images`` images, or ``args.duration``
    seconds; ``None`` where a pass yields no batch."""
    from batchwire.bench import progress

    deadline = time.monotonic() + args.duration if args.duration else None
    target = args.images
    images = nbytes = 0
    first = None
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
            if batches == 0:
                return None
    seconds = time.perf_counter() - started
    return _Streamed(
        images=images, nbytes=nbytes, seconds=seconds, first=first, within=within, between=between
    )


def _print_streamed(
    streamed: _Streamed, cpu_seconds: float, rss_start: float, rss_end: float
) -> None:
    images, seconds = streamed.images, streamed.seconds
    print(
        f"{images} images in {seconds:.1f}s: {images / seconds:.0f} images/s, {streamed.nbytes / seconds / 1e6:.0f} MB/s"
    )
    print(
        f"time to first batch {streamed.first:.2f}s; client CPU {cpu_seconds / images * 1000:.3f} s per 1000 images"
    )
    print(f"client RSS {rss_start:.0f} MiB at start, {rss_end:.0f} MiB at end")
    between, within = streamed.between, streamed.within
    if between and within:
        print(
            f"between passes: {statistics.median(between):.3f}s from a pass's last batch to the "
            f"next one's first (median of {len(between)}), against "
            f"{statistics.median(within):.3f}s from batch to batch within a pass"
        )
