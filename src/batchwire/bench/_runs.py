"""The runs ``batchwire bench --compare`` measures side by side, on the same data and cores.

(a) ``dali``       DALI's own pipeline in this process, as a DALI user writes it: its caffe
                   reader, the same graph, its PyTorch iterator (:mod:`batchwire.bench._dali`)
(b) ``remote``     a local ``batchwire serve`` process streaming to ``RemoteLoader``
(c) ``pil``        a torch DataLoader over the same LMDB, PIL decode + random-resized-crop
                   + flip (the usual PyTorch LMDB recipe), ``num_workers`` = cores
(d) ``transport``  batchwire's streaming path (batch encoding, parts, grpc.aio, RemoteLoader)
                   with batches already in memory: no LMDB, no decoding
(e) ``raw``        the gRPC ceiling: messages of the same sizes, identity serializers

and, as diagnostics, ``engine`` (batchwire's engine in this process, no gRPC) and the
stand-ins that isolate what the server adds around DALI without a GPU: ``nodecode`` and
``small``, each DALI's own pipeline in-process beside the server's.

Each run reports images, seconds, CPU seconds on the trainer side (this process, plus
DataLoader workers) and on the server, and peak RSS on each side.

Also what every measurement shares (the research modes of ``python -m benchmarks``, run
from a checkout, too): the dataset of generated photos cached in
``~/.cache/batchwire/bench``, and a description of this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchwire.bench._probe import CpuClock, RssSampler
from batchwire.common.batchings import BATCHING_HELP, BATCHINGS

if TYPE_CHECKING:
    from batchwire.client import Mixture

__all__ = [
    "RunResult",
    "add_run_arguments",
    "bench_coco",
    "bench_dataset",
    "bench_masks",
    "cache_dir",
    "machine",
    "progress",
    "run_inprocess",
    "run_remote",
]

IMAGE_BYTES = 3 * 224 * 224  # one uint8 NCHW sample of the train pipeline


def cache_dir() -> pathlib.Path:
    """Where generated datasets are kept: ``$BATCHWIRE_CACHE/bench``, by default
    ``~/.cache/batchwire/bench`` (``$XDG_CACHE_HOME`` respected)."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return (
        pathlib.Path(os.environ.get("BATCHWIRE_CACHE", pathlib.Path(base) / "batchwire")) / "bench"
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every measurement takes: what it runs on (:func:`bench_dataset`), the
    pipeline and batch size, and how many images and repetitions."""
    parser.add_argument(
        "--dataset",
        help="dataset name (default: the generated one); `batchwire bench --address` also takes "
        "a mixture of the server's datasets, NAME=WEIGHT,NAME=WEIGHT (e.g. pets=0.7,curated=0.3)",
    )
    parser.add_argument(
        "--batching",
        choices=BATCHINGS,
        default="random",
        help=f"with --address: {BATCHING_HELP}",
    )
    parser.add_argument("--pipeline", default="train", help="pipeline (default train)")
    parser.add_argument(
        "--batch-size", type=int, default=128, metavar="N", help="batch size (default 128)"
    )
    parser.add_argument(
        "--images",
        type=int,
        default=4096,
        metavar="N",
        help="images per run (default 4096: one epoch)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, metavar="N", help="alternated repetitions (default 3)"
    )
    parser.add_argument(
        "--data-dir", type=pathlib.Path, help="datasets (default: generated photos)"
    )
    parser.add_argument(
        "--photos",
        type=int,
        default=4096,
        metavar="N",
        help="generated photos (default 4096, so that a run is one epoch, not several short ones)",
    )


def bench_coco(images: int, *, progress: bool = True) -> tuple[pathlib.Path, pathlib.Path, str]:
    """A generated detection dataset of ``images`` pictures (``write_coco_boxes``, 320x240),
    built once in :func:`cache_dir`: its COCO ``instances.json`` (beside ``images/``), which
    DALI's COCO reader reads, and the data directory and name of its ingested dataset, which
    a server serves."""
    from batchwire.server.data import ingest, write_coco_boxes

    name = f"coco-{images}"
    root = cache_dir() / "coco" / name
    data_dir = cache_dir() / "datasets"
    if not (data_dir / name / "manifest.json").is_file() or not _segmented(root):
        print(f"generating {images} COCO pictures into {root}, once", file=sys.stderr, flush=True)
        coco = write_coco_boxes(root, count=images, size=(320, 240))
        ingest(coco, data_dir, name=name, images=root / "images", overwrite=True, progress=progress)
    return root / "instances.json", data_dir, name


def _segmented(root: pathlib.Path) -> bool:
    """Whether the COCO file in ``root`` gives its boxes' segmentations (a cache made
    before ``write_coco_boxes`` wrote them gives none: it is made again)."""
    import json

    try:
        annotations = json.loads((root / "instances.json").read_text())["annotations"]
    except (OSError, ValueError, KeyError):
        return False
    return all("segmentation" in a for a in annotations[:1])


def bench_masks(images: int, *, progress: bool = True) -> tuple[pathlib.Path, pathlib.Path, str]:
    """The segmentation dataset of :func:`bench_coco`'s pictures, built once: each picture's
    mask as a PNG of its own in ``masks/`` beside ``images/`` (``write_coco_masks``: what
    DALI's file readers read), and the data directory and name of its dataset ingested
    with ``--masks``."""
    from batchwire.server.data import ingest, write_coco_masks

    coco, data_dir, _ = bench_coco(images, progress=progress)
    root = coco.parent
    name = f"coco-{images}-masked"
    if not (data_dir / name / "manifest.json").is_file():
        print(f"drawing the masks of {images} COCO pictures, once", file=sys.stderr, flush=True)
        write_coco_masks(coco, root / "masks")
        ingest(
            coco,
            data_dir,
            name=name,
            images=root / "images",
            masks=True,
            overwrite=True,
            progress=progress,
        )
    return root, data_dir, name


def bench_dataset(
    data_dir: pathlib.Path | None,
    dataset: str | None,
    photos: int,
    size: tuple[int, int] = (500, 375),
    *,
    progress: bool = True,
) -> tuple[pathlib.Path, str]:
    """The data directory and dataset name to measure on: ``data_dir``'s ``dataset``, or
    ``photos`` generated JPEGs of ``size`` pixels (default ImageNet-sized), built once in
    :func:`cache_dir` (with progress bars where ``progress`` and stderr is a terminal)."""
    if data_dir is not None:
        if not dataset:
            raise SystemExit("error: --data-dir needs --dataset NAME")
        return data_dir, dataset
    from tqdm import tqdm

    from batchwire.server.data import ingest, write_photo_folders

    name = f"photos-{photos}" if size == (500, 375) else f"photos-{photos}-{size[0]}x{size[1]}"
    root = cache_dir() / "datasets"
    if not (root / name / "manifest.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        # Said whether or not a bar shows (a log file gets no bar): this takes minutes.
        print(
            f"generating {photos} photos of {size[0]}x{size[1]} into {root / name}, once "
            "(later runs reuse them)",
            file=sys.stderr,
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix="batchwire-bench-", dir=root.parent) as tmp:
            source = pathlib.Path(tmp) / "images"
            show = None if progress else True  # None: off where stderr is no terminal
            with tqdm(total=photos, desc="generating photos", unit="img", disable=show) as bar:
                write_photo_folders(source, count=photos, size=size, on_image=lambda: bar.update())
            ingest(source, root, name=name, overwrite=True, progress=progress)
    return root, name


def machine() -> dict[str, Any]:
    """Cores, CPU model, visible GPUs and Python version, as results report them."""
    from batchwire.server.engine import visible_gpu_count

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


def progress(total: int, desc: str, *, show: bool = True) -> Any:
    """A transient progress bar counting images (``total`` 0: no end known); shown only
    where ``show`` and stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", leave=False, disable=None if show else True)


@dataclasses.dataclass(frozen=True)
class RunResult:
    name: str
    images: int
    seconds: float
    trainer_cpu: float
    server_cpu: float | None
    trainer_rss_mib: float
    server_rss_mib: float | None
    first_batch_seconds: float | None = None
    # Bytes of a batch as the loop takes it, per image (a RemoteLoader's runs, served as
    # uint8: images, labels, and the outputs of a pipeline of several).
    bytes_per_image: float | None = None

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds

    def per_1000(self, cpu: float | None) -> float | None:
        return None if cpu is None else cpu / self.images * 1000


# -- batchwire's engine in-process (a diagnostic: (a) is DALI's own, in _dali) -----------


def run_inprocess(
    data_dir: pathlib.Path, dataset: str, batch_size: int, images: int, *, name: str = "inprocess"
) -> RunResult:
    """``images`` images of ``train`` through batchwire's engine in this process: its record
    path, scheduler and pipelines without gRPC."""
    from batchwire.common.stream import StreamSpec
    from batchwire.server import ServerConfig
    from batchwire.server.engine import Engine

    engine = Engine(ServerConfig(data_dir=data_dir, device="auto"))
    engine.open_datasets()
    try:
        cpu = CpuClock()
        with RssSampler(os.getpid()) as rss:
            started = time.perf_counter()
            done, first = 0, None
            while done < images:
                stream = engine.open_stream(
                    StreamSpec(dataset=dataset, pipeline="train", batch_size=batch_size, epoch=done)
                )
                try:
                    for batch in stream:
                        done += len(batch.ids)
                        first = first or time.perf_counter() - started
                        if done >= images:
                            break
                finally:
                    stream.close()
            seconds = time.perf_counter() - started
        return RunResult(name, done, seconds, cpu.seconds(), None, rss.peaks[0], None, first)
    finally:
        engine.close()


# -- (b), (d) remote through RemoteLoader (from a LocalServer: _local_server.py) ---------


def run_remote(
    name: str,
    addresses: list[str],
    server_pids: list[int],
    dataset: str | Mixture,
    pipeline: str,
    batch_size: int,
    images: int,
    *,
    progress: Callable[[int], None] | None = None,
    params: dict[str, float] | None = None,
) -> RunResult:
    from batchwire.client import RemoteLoader

    loader = RemoteLoader(
        addresses,
        dataset=dataset,
        pipeline=pipeline,
        batch_size=batch_size,
        drop_last=True,  # as the anchor's iterator, LastBatchPolicy.DROP
        normalize=False,
        prefetch=2,
        params=params,
    )
    loader.set_epoch(random.randrange(1 << 20))
    server_clocks = [CpuClock(pid) for pid in server_pids]
    cpu = CpuClock()
    done, first, received = 0, None, 0
    with RssSampler(os.getpid(), *server_pids) as rss:
        started = time.perf_counter()
        while done < images:
            for batch in loader:
                # A batch's second part has an entry a sample: its labels, or its targets
                # or captions (a pipeline of several outputs).
                done += len(batch[1])
                received += _nbytes(batch)
                first = first or time.perf_counter() - started
                if progress is not None:
                    progress(len(batch[1]))
                if done >= images:
                    break
        seconds = time.perf_counter() - started
    loader.close()
    server_cpu = sum(clock.seconds() for clock in server_clocks)
    return RunResult(
        name,
        done,
        seconds,
        cpu.seconds(),
        server_cpu,
        rss.peaks[0],
        sum(rss.peaks[1:]),
        first,
        received / max(done, 1),
    )


def _nbytes(value: Any) -> int:
    """The bytes of a batch as the loop takes it: its tensors, however nested, and texts."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0
