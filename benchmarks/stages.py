"""``python -m benchmarks --stages``: CPU time per image of each stage, DALI next to PIL.

Where a CPU pipeline spends its time, one thread, the same records. DALI's stages are
measured by adding them to the graph one at a time (the difference is the stage):
decode with a random crop (only the crop's region is decoded), resize to 224 x 224
with antialiasing (the default, like PIL's resampling), then crop_mirror_normalize to
uint8 CHW with a random flip. PIL's: full decode, then run (c)'s own per-sample
function (crop-and-resize in one ``Image.resize(box=...)`` call, flip, CHW).
"""

from __future__ import annotations

import argparse
import io
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["measure_stages", "run_stages"]

_SIZE = 224


def _records(directory: pathlib.Path, count: int) -> list[np.ndarray]:
    from batchwire.server.data import Dataset

    with Dataset(directory) as dataset:
        ids = np.arange(min(count, dataset.num_samples))
        images, _ = dataset.read(ids)
    return [image for image in images if image is not None]


def _dali_stage(
    records: list[np.ndarray], batch_size: int, build: Callable[[Any], Any], batches: int
) -> float:
    """CPU seconds per image of a one-thread synchronous pipeline ending in ``build``."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import Pipeline

    def source() -> Iterator[list[np.ndarray]]:
        start = 0
        while True:
            yield [records[(start + k) % len(records)] for k in range(batch_size)]
            start += batch_size

    pipe = Pipeline(
        batch_size=batch_size, num_threads=1, device_id=None, exec_async=False, exec_pipelined=False
    )
    with pipe:
        pipe.set_outputs(build(fn.external_source(source=source(), batch=True, dtype=types.UINT8)))
    pipe.build()
    pipe.run()  # warm-up: buffers allocated
    started = time.process_time()
    for _ in range(batches):
        pipe.run()
    return (time.process_time() - started) / (batches * batch_size)


def _pil_stages(records: list[np.ndarray], count: int) -> tuple[float, float]:
    """CPU seconds per image: (full decode, what run (c) does per sample)."""
    from PIL import Image

    from batchwire.bench import pil_train_sample

    chosen = [records[i % len(records)].tobytes() for i in range(count)]
    started = time.process_time()
    for data in chosen:
        Image.open(io.BytesIO(data)).convert("RGB").load()
    decode = (time.process_time() - started) / count
    started = time.process_time()
    for data in chosen:
        pil_train_sample(data, _SIZE)
    whole = (time.process_time() - started) / count
    return decode, whole


def measure_stages(directory: pathlib.Path, batch_size: int = 64, batches: int = 8) -> str:
    """The table of CPU microseconds per image by stage."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types

    records = _records(directory, 512)

    def crop(encoded: Any) -> Any:
        return fn.decoders.image_random_crop(
            encoded, device="cpu", random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3]
        )

    def resize(encoded: Any) -> Any:
        return fn.resize(crop(encoded), resize_x=_SIZE, resize_y=_SIZE, antialias=True)

    def finish(encoded: Any) -> Any:
        return fn.crop_mirror_normalize(
            resize(encoded),
            dtype=types.UINT8,
            output_layout="CHW",
            mirror=fn.random.coin_flip(),
        )

    full = _dali_stage(records, batch_size, lambda e: fn.decoders.image(e, device="cpu"), batches)
    cumulative = [
        _dali_stage(records, batch_size, stage, batches) for stage in (crop, resize, finish)
    ]
    pil_decode, pil_whole = _pil_stages(records, batch_size * batches)
    rows = [
        ("DALI decode, whole image", full),
        ("DALI decode, random crop region only", cumulative[0]),
        ("DALI resize to 224, antialiased", cumulative[1] - cumulative[0]),
        ("DALI flip + uint8 CHW (crop_mirror_normalize)", cumulative[2] - cumulative[1]),
        ("DALI all of train's stages", cumulative[2]),
        ("PIL decode, whole image", pil_decode),
        ("PIL crop-resize to 224 + flip + CHW", pil_whole - pil_decode),
        ("PIL all of run (c)'s stages", pil_whole),
    ]
    lines = [f"{'stage (one thread)':<48} {'CPU us/image':>13}"]
    lines += [f"{name:<48} {seconds * 1e6:13.0f}" for name, seconds in rows]
    return "\n".join(lines)


def run_stages(args: argparse.Namespace) -> int:
    from batchwire.bench import bench_dataset

    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    print(measure_stages(data_dir / dataset))
    return 0
