"""``batchwire demo``: build a small dataset, serve it on localhost, stream an epoch.

Everything a new user needs to see the product work on one machine: generated
images of four shapes are ingested into ``CACHE/datasets/shapes`` (kept for the
next run), a server starts in-process on a free port, and ``RemoteLoader``
streams one epoch through the ``train`` pipeline while the rate is printed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

from batchwire.common.words import counted

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

DATASET = "shapes"


def _default_cache() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(os.environ.get("BATCHWIRE_CACHE", pathlib.Path(base) / "batchwire"))


HELP = "build a sample dataset, serve it on localhost and stream it"
DESCRIPTION = "Build a small generated dataset, serve it in-process and stream one epoch."
DEFAULT_LOG_LEVEL = "WARNING"
DEFAULT_IMAGES = 2000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cache_help = "where the dataset is kept (default ~/.cache/batchwire) [BATCHWIRE_CACHE]"
    parser.add_argument("--cache", type=pathlib.Path, help=cache_help)
    parser.add_argument(
        "--images",
        type=int,
        default=None,
        metavar="N",
        help=f"images to generate, rounded down to a multiple of 4 (default: those of the "
        f"cached dataset, else {DEFAULT_IMAGES}); another number than the cached dataset's "
        "makes it again",
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, metavar="N", help="batch size (default 64)"
    )
    parser.add_argument(
        "--pipeline",
        default="train",
        choices=["train", "val"],
        help="pipeline to stream (default train)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "gpu"],
        help="server device (default auto)",
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="generate and ingest the dataset again"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (they are off anyway where output is not a terminal)",
    )


def _ensure_dataset(
    data_dir: pathlib.Path, images: int | None, rebuild: bool, progress: bool
) -> None:
    """The dataset of ``images`` images (None: the cached one, whatever its size) in
    ``data_dir/shapes``, generated and ingested unless it is there already."""
    from tqdm import tqdm

    from batchwire.server.data import (
        SHAPES,
        DatasetError,
        ingest,
        read_manifest,
        write_image_folders,
    )

    target = data_dir / DATASET
    per_class = max(1, (images or DEFAULT_IMAGES) // len(SHAPES))
    if (target / "manifest.json").is_file() and not rebuild:
        try:
            cached = read_manifest(target).num_samples
        except DatasetError:
            cached = None  # unreadable: made again below
        if (cached is not None and images is None) or cached == per_class * len(SHAPES):
            print(f"using the sample dataset in {target} ({cached} images)")
            return
        if cached is not None:
            print(
                f"the sample dataset in {target} has {cached} images, not "
                f"{per_class * len(SHAPES)}: making it again"
            )
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="batchwire-demo-", dir=data_dir.parent) as tmp:
        source = pathlib.Path(tmp) / "images"
        with tqdm(
            total=per_class * len(SHAPES),
            desc="generating images",
            unit="img",
            disable=None if progress else True,  # None: off where stderr is no terminal
        ) as bar:
            write_image_folders(source, per_class=per_class, on_image=lambda: bar.update())
        report = ingest(source, data_dir, name=DATASET, overwrite=True, progress=progress)
    print(
        f"ingested {counted(report.num_samples, 'image')} in "
        f"{counted(len(report.classes), 'class', 'classes')} into {target}"
    )


def run(args: argparse.Namespace) -> int:
    from batchwire.server import BatchwireServer, ServerConfig

    cache = args.cache or _default_cache()
    data_dir = cache / "datasets"
    if args.rebuild and (data_dir / DATASET).exists():
        shutil.rmtree(data_dir / DATASET)
    _ensure_dataset(data_dir, args.images, args.rebuild, not args.no_progress)
    server = BatchwireServer(
        ServerConfig(data_dir=data_dir, host="localhost", port=0, device=args.device)
    )
    server.start()
    try:
        if not server.wait_serving(120):
            print(
                "error: the server did not become ready within 120s; see the log above",
                file=sys.stderr,
            )
            return 1
        print(f"serving on {server.target} ({server.engine.devices.kind})")
        _stream_epoch(server.target, args)
    finally:
        server.stop(grace=1.0)
    return 0


def _stream_epoch(target: str, args: argparse.Namespace) -> None:
    """One epoch of the dataset from the server at ``target``, its rate and its labels per
    class printed."""
    from tqdm import tqdm

    from batchwire.client import RemoteLoader

    with RemoteLoader(
        target,
        dataset=DATASET,
        pipeline=args.pipeline,
        batch_size=args.batch_size,
        drop_last=False,
    ) as loader:
        images = 0
        nbytes = 0
        counts = [0] * len(loader.classes)
        started = time.perf_counter()
        with tqdm(
            total=len(loader),
            desc=f"streaming {DATASET}/{args.pipeline}",
            unit="batch",
            disable=True if args.no_progress else None,  # None: off where no terminal
        ) as bar:
            for batch, labels in loader:
                images += len(labels)
                nbytes += batch.numel()  # uint8 on the wire: one byte per value
                for label in labels.tolist():
                    counts[label] += 1
                bar.update()
        seconds = time.perf_counter() - started
    shape = tuple(batch.shape[1:])
    per_class = ", ".join(f"{name} {n}" for name, n in zip(loader.classes, counts, strict=True))
    print(
        f"streamed {images} images of {shape} in {seconds:.2f}s: {images / seconds:.0f} images/s, {nbytes / seconds / 1e6:.0f} MB/s"
    )
    print(f"labels per class: {per_class}")
    print(
        "(one epoch from a server just started: the rate includes building its DALI "
        "pipelines and warming up, and the first run on a machine also loads DALI from "
        "disk; `batchwire bench --address HOST:PORT --dataset NAME` measures a running "
        "server)"
    )
