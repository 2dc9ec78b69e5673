"""Run (c) of ``batchwire bench --compare``: the usual recipe without batchwire, a torch
DataLoader over the same LMDB with PIL decode, random-resized-crop and flip,
``num_workers`` = cores."""

from __future__ import annotations

import gc
import math
import os
import pathlib
import random
import time
from typing import Any

from batchwire.bench._probe import CpuClock, RssSampler
from batchwire.bench._runs import RunResult

__all__ = ["LmdbPilDataset", "pil_train_sample", "run_pil"]


# -- (c) torch DataLoader with PIL over the same LMDB -----------------------------------


class LmdbPilDataset:
    """The usual PyTorch recipe: LMDB (readonly, lock=False, readahead=False) opened
    lazily in each worker, PIL decode, RandomResizedCrop(224) + horizontal flip."""

    def __init__(self, dataset_dir: pathlib.Path, size: int = 224) -> None:
        from batchwire.server.data import Manifest

        self.dir = dataset_dir
        self.manifest = Manifest.load(dataset_dir)
        self.size = size
        self._envs: list[Any] | None = None

    def __len__(self) -> int:
        return self.manifest.num_samples

    def _record(self, index: int) -> tuple[bytes, int]:
        import bisect

        import lmdb

        from batchwire.server.data import sample_key
        from batchwire.v1 import datum_pb2

        if self._envs is None:
            self._envs = [
                lmdb.open(
                    str(self.dir / s.path),
                    readonly=True,
                    lock=False,
                    readahead=False,
                    meminit=False,
                )
                for s in self.manifest.shards
            ]
        starts = [s.first_id for s in self.manifest.shards]
        shard = bisect.bisect_right(starts, index) - 1
        with self._envs[shard].begin() as txn:
            datum = datum_pb2.Datum.FromString(txn.get(sample_key(index)))
        return datum.data, datum.label

    def __getitem__(self, index: int) -> tuple[Any, int]:
        data, label = self._record(index)
        return pil_train_sample(data, self.size), label


def pil_train_sample(data: bytes, size: int = 224) -> Any:
    """Run (c)'s per-sample work: PIL decode, random-resized-crop, flip, CHW uint8 tensor."""
    import io

    import numpy as np
    import torch
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    box = _random_resized_crop_box(image.size)
    image = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if random.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())


def _random_resized_crop_box(size: tuple[int, int]) -> tuple[float, float, float, float]:
    """torchvision's RandomResizedCrop sampling: area [0.08, 1], aspect [3/4, 4/3]."""
    width, height = size
    area = width * height
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        aspect = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            x, y = random.randint(0, width - w), random.randint(0, height - h)
            return (x, y, x + w, y + h)
    side = min(width, height)
    x, y = (width - side) // 2, (height - side) // 2
    return (x, y, x + side, y + side)


def run_pil(dataset_dir: pathlib.Path, batch_size: int, images: int, workers: int) -> RunResult:
    import torch.utils.data

    dataset = LmdbPilDataset(dataset_dir)
    cpu = CpuClock(children=True)
    done, first = 0, None
    with RssSampler(os.getpid(), children=True) as rss:
        started = time.perf_counter()
        while done < images:
            loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
                dataset,  # type: ignore[arg-type]  # a map-style dataset by protocol
                batch_size=batch_size,
                shuffle=True,
                num_workers=workers,
                drop_last=True,
                prefetch_factor=2,
                persistent_workers=False,
            )
            iterator = iter(loader)
            for batch, _ in iterator:
                done += len(batch)
                first = first or time.perf_counter() - started
                if done >= images:
                    break
            del iterator  # shut the workers down, so their CPU time is counted
            gc.collect()
        seconds = time.perf_counter() - started
    return RunResult("pil", done, seconds, cpu.seconds(), None, rss.peaks[0], None, first)
