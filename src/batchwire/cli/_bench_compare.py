"""``batchwire bench --compare``: the runs it can make (:data:`RUNS`), the servers they
stream from, each run as a function that measures it once, the runs alternated, and the
report of their medians (a table, and where asked JSON and a chart). The command itself,
its flags and its other mode are ``_bench.py``'s."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchwire.cli._datasets import no_batch_error

if TYPE_CHECKING:
    from batchwire.bench import RunResult
    from batchwire.client import Mixture

__all__ = ["RUNS", "compare"]

RUNS = (
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
# The mixture run's two datasets, and how it mixes them.
_MIXED = ("first", "second")
# The presets' sizes in their runs: DINO's 224 and 96 pixel views, SSD's 320 (the detection
# run's pictures are --photos generated COCO pictures).
_MULTICROP = {"global_size": 224.0, "local_size": 96.0}
_DETECTION = {"size": 320.0}
_SEGMENTATION = {"size": 320.0}
# A server as its runs know it: (address, pid); a dataset it serves, under "<run>-dataset",
# as (name, 0).
Servers = dict[str, tuple[str, int]]


def compare(args: argparse.Namespace) -> int:
    """Runs (a)..(e), the diagnostic and the stand-ins alternated on the same data and
    cores, medians reported."""
    from batchwire.bench import (
        IMAGE_BYTES,
        NO_DECODE_TOML,
        SMALL_PHOTO,
        LocalServer,
        bench_dataset,
        raw_server,
        transport_server,
    )
    from batchwire.server.data import Manifest

    wanted = [name.strip() for name in args.runs.split(",") if name.strip()]
    if not wanted or set(wanted) - set(RUNS):
        print(f"error: --runs takes names from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    show = not args.no_progress
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos, progress=show)
    num_samples = Manifest.load(data_dir / dataset).num_samples
    if num_samples < args.batch_size:
        print(no_batch_error(dataset, num_samples, args.batch_size), file=sys.stderr)
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
        _start_stand_in_servers(stack, wanted, work, data_dir, dataset, servers)
        data = _start_preset_servers(stack, wanted, work, args.photos, show, servers)
        setup = _Setup.of(args, data_dir / dataset, small_dir / small, data)
        runs = _runs(setup, servers, transport, raw)
        chosen = [run for name in RUNS if name in wanted for run in _PAIRS.get(name, (name,))]
        results = _alternate({run: runs[run] for run in chosen}, args.repeats)
    _report(args, results)
    return 0


def _start_stand_in_servers(
    stack: contextlib.ExitStack,
    wanted: list[str],
    work: pathlib.Path,
    data_dir: pathlib.Path,
    dataset: str,
    servers: Servers,
) -> None:
    """The servers of the socket and mixture stand-ins, where they are ``wanted``, added to
    ``servers``."""
    from batchwire.bench import NO_DECODE_TOML, LocalServer

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


def _start_preset_servers(
    stack: contextlib.ExitStack,
    wanted: list[str],
    work: pathlib.Path,
    photos: int,
    show: bool,
    servers: Servers,
) -> _PresetData:
    """The datasets and servers of the detection, segmentation and captions runs, where they
    are ``wanted``: the servers added to ``servers``, what DALI's own pipelines read
    returned."""
    from batchwire.bench import NO_DECODE_TOML, LocalServer, bench_captions, bench_coco, bench_masks

    coco = None
    if "detection" in wanted:
        coco, coco_dir, coco_name = bench_coco(photos, progress=show)
        coco_server = stack.enter_context(LocalServer(coco_dir, work, pipelines=NO_DECODE_TOML))
        servers["detection"] = (coco_server.address, coco_server.pid)
        servers["detection-dataset"] = (coco_name, 0)
    masks = None
    if "segmentation" in wanted:
        masks, masks_dir, masks_name = bench_masks(photos, progress=show)
        masks_server = stack.enter_context(LocalServer(masks_dir, work))
        servers["segmentation"] = (masks_server.address, masks_server.pid)
        servers["segmentation-dataset"] = (masks_name, 0)
    shards = None
    if "captions" in wanted:
        shards, captions_dir, captions_name = bench_captions(photos, progress=show)
        captions_server = stack.enter_context(
            LocalServer(captions_dir, work, pipelines=NO_DECODE_TOML)
        )
        servers["captions"] = (captions_server.address, captions_server.pid)
        servers["captions-dataset"] = (captions_name, 0)
    return _PresetData(coco=coco, masks=masks, shards=shards)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PresetData:
    """What DALI's own pipelines of the presets read, where their runs are asked for: the
    COCO file of the detection run's pictures, the folder of the segmentation run's pictures
    and masks, the folder of the captions run's WebDataset shards."""

    coco: pathlib.Path | None = None
    masks: pathlib.Path | None = None
    shards: pathlib.Path | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Setup:
    """What every run is given: the batch, the images of a run and of a stand-in's, the
    dataset's folder and the small stand-in's, the presets' data, the (c) run's workers."""

    batch: int
    images: int
    standin: int
    dataset_dir: pathlib.Path
    small_dir: pathlib.Path
    data: _PresetData
    workers: int

    @classmethod
    def of(
        cls,
        args: argparse.Namespace,
        dataset_dir: pathlib.Path,
        small_dir: pathlib.Path,
        data: _PresetData,
    ) -> _Setup:
        return cls(
            batch=args.batch_size,
            images=args.images,
            standin=args.standin_images or 8 * args.images,
            dataset_dir=dataset_dir,
            small_dir=small_dir,
            data=data,
            workers=args.workers,
        )

    def remote(
        self,
        name: str,
        at: tuple[str, int],
        data: str | Mixture,
        pipeline: str,
        count: int,
        **kw: Any,
    ) -> RunResult:
        """A RemoteLoader's run of ``count`` images on the server ``at`` (address, pid)."""
        from batchwire.bench import run_remote

        return run_remote(name, [at[0]], [at[1]], data, pipeline, self.batch, count, **kw)


def _per_message(batch_size: int) -> int:
    """Images per gRPC message of run (e): as many as one message of (b) carries."""
    from batchwire.bench import IMAGE_BYTES
    from batchwire.server import ServerConfig

    return round(min(batch_size * IMAGE_BYTES, ServerConfig.max_message_bytes) / IMAGE_BYTES)


def _runs(
    setup: _Setup, servers: Servers, transport: tuple[str, int], raw: tuple[str, int]
) -> dict[str, Callable[[], RunResult]]:
    """Each run as a function that measures one run of it; servers as (address, pid)."""
    return {
        **_main_runs(setup, servers, transport, raw),
        **_stand_in_runs(setup, servers),
        **_preset_runs(setup, servers),
    }


def _main_runs(
    setup: _Setup, servers: Servers, transport: tuple[str, int], raw: tuple[str, int]
) -> dict[str, Callable[[], RunResult]]:
    """Runs (a)..(e), and the engine in this process."""
    from batchwire.bench import IMAGE_BYTES, run_dali, run_inprocess, run_pil, run_raw

    s = setup
    dataset = s.dataset_dir.name
    per_message = _per_message(s.batch)
    return {
        "dali": lambda: run_dali("dali", s.dataset_dir, "train", s.batch, s.images),
        "remote": lambda: s.remote("remote", servers[""], dataset, "train", s.images),
        "pil": lambda: run_pil(s.dataset_dir, s.batch, s.images, s.workers),
        "transport": lambda: s.remote("transport", transport, dataset, "transport", s.images),
        "raw": lambda: run_raw(raw[0], raw[1], per_message * IMAGE_BYTES, per_message, s.images),
        "engine": lambda: run_inprocess(
            s.dataset_dir.parent, dataset, s.batch, s.images, name="engine"
        ),
    }


def _stand_in_runs(setup: _Setup, servers: Servers) -> dict[str, Callable[[], RunResult]]:
    """The stand-ins: nodecode, socket, small, and the mixture's four."""
    from batchwire.bench import SMALL_SIZE, run_dali
    from batchwire.client import Mixture

    s = setup
    dataset, small, count = s.dataset_dir.name, s.small_dir.name, s.standin
    small_params = {"size": float(SMALL_SIZE)}
    mixture = Mixture(dict.fromkeys(_MIXED, 0.5))
    stratified = Mixture(dict.fromkeys(_MIXED, 0.5), batching="stratified")
    per_source = Mixture(dict.fromkeys(_MIXED, 0.5), batching="per_source")
    return {
        "dali-nodecode": lambda: run_dali(
            "dali-nodecode", s.dataset_dir, "nodecode", s.batch, count
        ),
        "remote-nodecode": lambda: s.remote(
            "remote-nodecode", servers[""], dataset, "nodecode", count
        ),
        "remote-socket": lambda: s.remote(
            "remote-socket", servers["socket"], dataset, "nodecode", count
        ),
        "dali-small": lambda: run_dali(
            "dali-small", s.small_dir, "train", s.batch, count, params=small_params
        ),
        "remote-small": lambda: s.remote(
            "remote-small", servers["small"], small, "train", count, params=small_params
        ),
        "remote-one": lambda: s.remote(
            "remote-one", servers["mixture"], _MIXED[0], "nodecode", count
        ),
        "remote-mixture": lambda: s.remote(
            "remote-mixture", servers["mixture"], mixture, "nodecode", count
        ),
        "remote-stratified": lambda: s.remote(
            "remote-stratified", servers["mixture"], stratified, "nodecode", count
        ),
        "remote-per-source": lambda: s.remote(
            "remote-per-source", servers["mixture"], per_source, "nodecode", count
        ),
    }


def _preset_runs(setup: _Setup, servers: Servers) -> dict[str, Callable[[], RunResult]]:
    """The presets of several outputs, each DALI's own pipeline and the server's."""
    from batchwire.bench import run_dali

    s = setup
    dataset, data = s.dataset_dir.name, s.data

    def dali(preset: str, params: dict[str, float] | None = None, **read: Any) -> RunResult:
        return run_dali(
            f"dali-{preset}", s.dataset_dir, preset, s.batch, s.images, params=params, **read
        )

    def remote(preset: str, params: dict[str, float] | None = None) -> RunResult:
        at, named = servers[preset], servers[f"{preset}-dataset"][0]
        return s.remote(f"remote-{preset}", at, named, preset, s.images, params=params)

    return {
        "dali-multicrop": lambda: dali("multicrop", _MULTICROP),
        "remote-multicrop": lambda: s.remote(
            "remote-multicrop", servers[""], dataset, "multicrop", s.images, params=_MULTICROP
        ),
        "dali-detection": lambda: dali("detection", _DETECTION, coco=data.coco),
        "remote-detection": lambda: remote("detection", _DETECTION),
        "dali-segmentation": lambda: dali("segmentation", _SEGMENTATION, masks=data.masks),
        "remote-segmentation": lambda: remote("segmentation", _SEGMENTATION),
        "dali-captions": lambda: dali("captions", webdataset=data.shards),
        "remote-captions": lambda: remote("captions"),
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


def _report(args: argparse.Namespace, results: list[RunResult]) -> None:
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
