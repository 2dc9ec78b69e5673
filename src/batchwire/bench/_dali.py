"""(a) DALI's own pipeline in-process, as a DALI user writes it: the anchor of ``--compare``.

``fn.readers.caffe`` over the dataset's shards (DALI's C++ reader: LMDB, the Datum parse and
the shuffle buffer, no Python per record), the served pipeline's own graph function on the
same device, and DALI's PyTorch iterator, whose tensors stay where DALI made them: on the
GPU on a GPU host. This is what a DALI user runs instead of a batchwire server. The presets
of several outputs read their data as a DALI user reads it: detection with the COCO reader,
segmentation with two file readers, captions with the WebDataset reader.

And the two stand-ins that isolate what batchwire adds around DALI on a host without a GPU,
each measured against this anchor: :func:`no_decode` (a record's bytes cut or padded to one
image, so that the record and output paths, not decoding, are the work) and small images
(:data:`SMALL_PHOTO`: 48-pixel JPEGs through ``train`` at size 32).
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

from batchwire.bench._probe import CpuClock, RssSampler
from batchwire.bench._runs import RunResult
from batchwire.bench._wait import WAIT_TOML

__all__ = [
    "NO_DECODE_TOML",
    "SMALL_PHOTO",
    "SMALL_SIZE",
    "no_decode",
    "pipeline_spec",
    "run_dali",
]

SMALL_PHOTO = (48, 48)  # the small-image stand-in's photos, pixels
SMALL_SIZE = 32  # and its train pipeline's output size

# The server's presets and the stand-in pipelines (no decoding; the waiting pipeline of
# ``_wait``), as a server config's [pipelines] table names them: what the bench's servers
# serve, and what run_dali builds.
NO_DECODE_TOML = (
    WAIT_TOML
    + """
[pipelines.train]
preset = "train"

[pipelines.val]
preset = "val"

[pipelines.multicrop]
preset = "multicrop"

[pipelines.detection]
preset = "detection"

[pipelines.segmentation]
preset = "segmentation"

[pipelines.captions]
preset = "captions"

[pipelines.nodecode]
function = "batchwire.bench._dali:no_decode"
description = "a record's bytes cut or padded to one size x size x 3 image: no decoding"
params = { size = { default = 224, low = 8, high = 1024, integer = true } }
"""
)


def no_decode(encoded: Any, labels: Any, ctx: Any, p: Mapping[str, float]) -> tuple[Any, Any]:
    """Each record's encoded bytes cut or padded to ``size`` x ``size`` x 3 and laid out as
    every pipeline's output: a pipeline whose cost is moving records and images, not
    decoding them."""
    import nvidia.dali.fn as fn

    size = int(p["size"])
    pixels = fn.slice(
        encoded, start=[0], shape=[size * size * 3], axes=[0], out_of_bounds_policy="pad"
    )
    images = fn.reshape(pixels, shape=[size, size, 3], layout="HWC")
    if ctx.device == "gpu":
        images = images.gpu()
    return ctx.finish(images), labels


def pipeline_spec(name: str) -> Any:
    """The PipelineSpec named ``name`` as the bench's servers declare it (:data:`NO_DECODE_TOML`)."""
    import tomllib

    from batchwire.server import pipelines_from_config

    return pipelines_from_config(tomllib.loads(NO_DECODE_TOML)["pipelines"])[name]


def run_dali(
    name: str,
    dataset_dir: pathlib.Path,
    pipeline: str,
    batch_size: int,
    images: int,
    *,
    params: Mapping[str, float] | None = None,
    device: str = "auto",
    num_threads: int = 0,
    hw_decoder_load: float | None = None,
    coco: pathlib.Path | None = None,
    masks: pathlib.Path | None = None,
    webdataset: pathlib.Path | None = None,
) -> RunResult:
    """``images`` images of ``pipeline``'s graph fed by DALI's caffe reader in this process
    (or, with ``coco``, an ``instances.json`` beside its ``images/``, by DALI's COCO reader,
    as a DALI user reads a detection dataset; with ``masks``, a folder of ``images/`` and
    their ``masks/`` PNGs by two of DALI's file readers shuffled alike, as a DALI user reads
    a segmentation dataset; with ``webdataset``, a folder of WebDataset ``.tar`` shards and
    their DALI indexes by DALI's WebDataset reader, as a DALI user reads image-text data),
    iterated with DALI's PyTorch iterator
    (outputs left on the device they are made on). Threads as the server gives a pipeline
    (``num_threads`` 0: its default), and the server's ``hw_decoder_load`` unless given."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from batchwire.server.engine import visible_gpu_count

    gpu = device == "gpu" or (device == "auto" and visible_gpu_count() > 0)
    with RssSampler(os.getpid()) as rss:
        started = time.perf_counter()
        if coco is not None:
            pipe, names = _coco_pipeline(
                coco, pipeline, params, batch_size, gpu, num_threads, hw_decoder_load
            )
        elif masks is not None:
            pipe, names = _masks_pipeline(
                masks, pipeline, params, batch_size, gpu, num_threads, hw_decoder_load
            )
        elif webdataset is not None:
            pipe, names = _webdataset_pipeline(
                webdataset, pipeline, params, batch_size, gpu, num_threads, hw_decoder_load
            )
        else:
            pipe, names = _caffe_pipeline(
                dataset_dir, pipeline, params, batch_size, gpu, num_threads, hw_decoder_load
            )
        batches = DALIGenericIterator(
            [pipe],
            names,
            reader_name="Reader",
            last_batch_policy=LastBatchPolicy.DROP,
            auto_reset=True,
        )
        form = pipeline_spec(pipeline).form
        cpu = CpuClock()  # from the first run on: a DALI user builds a pipeline once
        measured_from = time.perf_counter()
        done, first = _take_images(batches, form, images, started, gpu)
        seconds = time.perf_counter() - measured_from
        del batches, pipe
    return RunResult(name, done, seconds, cpu.seconds(), None, rss.peaks[0], None, first)


def _take_images(
    batches: Any, form: str, images: int, started: float, gpu: bool
) -> tuple[int, float | None]:
    """Batches of ``batches``, epoch after epoch, until ``images`` samples are taken (and, on
    a GPU, made): how many were, and the seconds from ``started`` to the first."""
    done, first = 0, None
    while done < images:
        for batch in batches:
            done += _take(form, batch[0])
            first = first or time.perf_counter() - started
            if done >= images:
                break
    if gpu:
        import torch

        torch.cuda.synchronize()
    return done, first


def _take(form: str, outputs: dict[str, Any]) -> int:
    """Makes a batch's ``outputs`` what the loop takes, as RemoteLoader gives them, and
    returns its samples: a segmentation batch's masks as int64 class maps (cross_entropy's
    targets), not DALI's uint8; a captions batch's captions as one ``str`` a sample, decoded
    from DALI's bytes of them (padded to the batch's longest, each with its length)."""
    if form == "segmentation":
        outputs["mask"] = outputs["mask"].long()
    if form == "captions":
        rows, lengths = outputs["caption"].numpy(), outputs.pop("caption_bytes").tolist()
        outputs["caption"] = [
            rows[i, :n].tobytes().decode("utf-8") for i, (n,) in enumerate(lengths)
        ]
        return len(outputs["caption"])
    return int(outputs["labels"].shape[0])


def _caffe_pipeline(
    dataset_dir: pathlib.Path,
    pipeline: str,
    params: Mapping[str, float] | None,
    batch_size: int,
    gpu: bool,
    num_threads: int,
    hw_decoder_load: float | None,
) -> tuple[Any, list[str]]:
    """A built DALI pipeline: the caffe reader over the dataset's shards (shuffled), then
    ``pipeline``'s graph as the server builds it; and its outputs' names."""
    from nvidia.dali import fn

    from batchwire.server.data import Manifest

    spec, ctx, pipe = _graph(pipeline, batch_size, gpu, num_threads, hw_decoder_load)
    shards = [str(dataset_dir / shard.path) for shard in Manifest.load(dataset_dir).shards]
    with pipe:
        encoded, labels = fn.readers.caffe(path=shards, random_shuffle=True, name="Reader")
        made = spec.function(encoded, labels, ctx, spec.resolve(params))
        names = [o.name for o in spec.outputs] or ["images"]
        outputs = [made[name] for name in names] if spec.outputs else [made[0]]
        pipe.set_outputs(*outputs, labels)
    pipe.build()
    return pipe, [*names, "labels"]


def _coco_pipeline(
    coco: pathlib.Path,
    pipeline: str,
    params: Mapping[str, float] | None,
    batch_size: int,
    gpu: bool,
    num_threads: int,
    hw_decoder_load: float | None,
) -> tuple[Any, list[str]]:
    """A built DALI pipeline: DALI's COCO reader over ``coco`` (boxes as absolute
    ``ltrb``, shuffled), then ``pipeline``'s graph as the server builds it, its ragged
    outputs padded to the batch's longest (as DALI's iterator takes them)."""
    from nvidia.dali import fn

    spec, ctx, pipe = _graph(pipeline, batch_size, gpu, num_threads, hw_decoder_load)
    with pipe:
        encoded, boxes, classes = fn.readers.coco(
            file_root=str(coco.parent / "images"),
            annotations_file=str(coco),
            ltrb=True,
            random_shuffle=True,
            name="Reader",
        )
        made = spec.function(
            encoded, classes, ctx, spec.resolve(params), {"boxes": boxes, "labels": classes}
        )
        names = [o.name for o in spec.outputs]
        outputs = [
            fn.pad(made[o.name], fill_value=-1) if o.kind == "ragged" else made[o.name]
            for o in spec.outputs
        ]
        pipe.set_outputs(*outputs)
    pipe.build()
    # "labels": the boxes' classes, one list a sample: the samples are counted by it.
    return pipe, names


def _masks_pipeline(
    root: pathlib.Path,
    pipeline: str,
    params: Mapping[str, float] | None,
    batch_size: int,
    gpu: bool,
    num_threads: int,
    hw_decoder_load: float | None,
) -> tuple[Any, list[str]]:
    """A built DALI pipeline: two file readers, of ``root``'s ``images/`` and of its
    ``masks/`` (the same names as PNGs), shuffled with one seed so that each image meets
    its mask, then ``pipeline``'s graph as the server builds it."""
    from nvidia.dali import fn

    spec, ctx, pipe = _graph(pipeline, batch_size, gpu, num_threads, hw_decoder_load)
    images = sorted((root / "images").iterdir())
    masks = [root / "masks" / f"{image.stem}.png" for image in images]
    seed = int(time.time()) % (1 << 31)
    with pipe:
        encoded, labels = fn.readers.file(
            files=[str(i) for i in images], random_shuffle=True, seed=seed, name="Reader"
        )
        mask, _ = fn.readers.file(files=[str(m) for m in masks], random_shuffle=True, seed=seed)
        made = spec.function(encoded, labels, ctx, spec.resolve(params), {"mask": mask})
        names = [o.name for o in spec.outputs]
        pipe.set_outputs(*(made[name] for name in names), labels)
    pipe.build()
    return pipe, [*names, "labels"]


def _webdataset_pipeline(
    root: pathlib.Path,
    pipeline: str,
    params: Mapping[str, float] | None,
    batch_size: int,
    gpu: bool,
    num_threads: int,
    hw_decoder_load: float | None,
) -> tuple[Any, list[str]]:
    """A built DALI pipeline: DALI's WebDataset reader over ``root``'s ``.tar`` shards with
    their indexes (each shard's ``.idx`` beside it; shuffled), each sample's ``jpg`` and its
    ``txt`` as the ``caption`` field, then ``pipeline``'s graph as the server builds it; the
    captions' bytes padded to the batch's longest, and their lengths (``caption_bytes``)."""
    from nvidia.dali import fn

    spec, ctx, pipe = _graph(pipeline, batch_size, gpu, num_threads, hw_decoder_load)
    shards = sorted(root.glob("*.tar"))
    with pipe:
        encoded, text = fn.readers.webdataset(
            paths=[str(shard) for shard in shards],
            index_paths=[str(shard.with_suffix(".idx")) for shard in shards],
            ext=["jpg", "txt"],
            random_shuffle=True,
            name="Reader",
        )
        # No labels: an image-text sample has none (the graph passes them through).
        made = spec.function(encoded, None, ctx, spec.resolve(params), {"caption": text})
        caption = made["caption"]
        pipe.set_outputs(made["images"], fn.pad(caption), caption.shape())
    pipe.build()
    return pipe, ["images", "caption", "caption_bytes"]


def _graph(
    pipeline: str, batch_size: int, gpu: bool, num_threads: int, hw_decoder_load: float | None
) -> tuple[Any, Any, Any]:
    """``pipeline``'s spec, the context its graph is built in as the server builds it (on
    this run's device, the server's ``hw_decoder_load`` unless given), and the DALI
    pipeline to define it in: what every anchor's reader feeds."""
    from batchwire.server import ServerConfig
    from batchwire.server.pipelines import BuildContext, OutputSpec

    load = ServerConfig.hw_decoder_load if hw_decoder_load is None else hw_decoder_load
    ctx = BuildContext(device="gpu" if gpu else "cpu", output=OutputSpec(), hw_decoder_load=load)
    return pipeline_spec(pipeline), ctx, _pipeline(batch_size, gpu, num_threads, ctx.device)


def _pipeline(batch_size: int, gpu: bool, num_threads: int, device: str) -> Any:
    from nvidia.dali import Pipeline

    from batchwire.server.engine import pipeline_threads, usable_cpus

    return Pipeline(
        batch_size=batch_size,
        num_threads=pipeline_threads(num_threads, device, 1, usable_cpus()),
        device_id=0 if gpu else None,
        prefetch_queue_depth=2,
        seed=int(time.time() * 1000) % (1 << 31),
    )
