"""The runs ``batchwire bench --compare`` measures side by side, on the same data and cores.

(a) ``inprocess``  the server's DALI pipeline run in this process, no gRPC
(b) ``remote``     a local ``batchwire serve`` process streaming to ``RemoteLoader``
(c) ``pil``        a torch DataLoader over the same LMDB, PIL decode + random-resized-crop
                   + flip (source document 001's recipe), ``num_workers`` = cores
(d) ``transport``  batchwire's streaming path (batch encoding, parts, grpc.aio, RemoteLoader)
                   with batches already in memory: no LMDB, no decoding
(e) ``raw``        the gRPC ceiling: messages of the same sizes, identity serializers

Each run reports images, seconds, CPU seconds on the trainer side (this process, plus
DataLoader workers) and on the server, and peak RSS on each side.

Also what every measurement shares (the research modes of ``python -m benchmarks``, run
from a checkout, too): the dataset of generated photos cached in
``~/.cache/batchwire/bench``, and a description of this machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import multiprocessing
import os
import pathlib
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

from batchwire.cli._bench_probe import CpuClock, RssSampler

__all__ = [
    "LocalServer",
    "RunResult",
    "bench_dataset",
    "cache_dir",
    "machine",
    "progress",
    "run_inprocess",
    "run_pil",
    "run_raw",
    "run_remote",
    "transport_server",
]

IMAGE_BYTES = 3 * 224 * 224  # one uint8 NCHW sample of the train pipeline
# What the transport (d) and raw (e) servers hold in memory and cycle through: far
# more than a CPU cache, as a real stream's data is.
IN_MEMORY_BYTES = 1024 * IMAGE_BYTES


def cache_dir() -> pathlib.Path:
    """Where generated datasets are kept: ``$BATCHWIRE_CACHE/bench``, by default
    ``~/.cache/batchwire/bench`` (``$XDG_CACHE_HOME`` respected)."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return (
        pathlib.Path(os.environ.get("BATCHWIRE_CACHE", pathlib.Path(base) / "batchwire")) / "bench"
    )


def bench_dataset(
    data_dir: pathlib.Path | None, dataset: str | None, photos: int
) -> tuple[pathlib.Path, str]:
    """The data directory and dataset name to measure on: ``data_dir``'s ``dataset``, or
    ``photos`` generated ImageNet-sized JPEGs, built once in :func:`cache_dir`."""
    if data_dir is not None:
        if not dataset:
            raise SystemExit("error: --data-dir needs --dataset NAME")
        return data_dir, dataset
    from tqdm import tqdm

    from batchwire.server.data import ingest, write_photo_folders

    name = f"photos-{photos}"
    root = cache_dir() / "datasets"
    if not (root / name / "manifest.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="batchwire-bench-", dir=root.parent) as tmp:
            source = pathlib.Path(tmp) / "images"
            with tqdm(total=photos, desc="generating photos", unit="img") as bar:
                write_photo_folders(source, count=photos, on_image=lambda: bar.update())
            ingest(source, root, name=name, overwrite=True, progress=True)
    return root, name


def machine() -> dict[str, Any]:
    """Cores, CPU model, visible GPUs and Python version, as results report them."""
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


def progress(total: int, desc: str) -> Any:
    """A transient progress bar counting images (``total`` 0: no end known)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", leave=False)


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

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds

    def per_1000(self, cpu: float | None) -> float | None:
        return None if cpu is None else cpu / self.images * 1000


def _transport_server(
    port_queue: Any, dataset: str, num_samples: int, size: int, limit: int
) -> None:
    """A server with batchwire's streaming path (batch encoding, parts, grpc.aio on uvloop)
    whose batches are already in memory: what is left when decoding costs nothing."""
    import asyncio

    import grpc
    import numpy as np

    from batchwire.common.sampler import Plan, PlannedBatch
    from batchwire.server.core import Batch
    from batchwire.server.serving import encode_parts, tune_for_large_buffers
    from batchwire.v1 import batchwire_pb2 as pb

    tune_for_large_buffers()  # as `batchwire serve` does

    images = np.random.default_rng(0).integers(
        0, 255, (IN_MEMORY_BYTES // (3 * size * size), 3, size, size), dtype=np.uint8
    )
    info = pb.DatasetInfo(
        name=dataset,
        num_samples=num_samples,
        pipelines=[pb.PipelineInfo(name="transport", mean=[0, 0, 0], std=[1, 1, 1])],
    )

    async def describe(request: Any, context: Any) -> Any:
        return info

    offset = 0

    def in_memory(plan: Plan, planned: PlannedBatch) -> Batch:
        nonlocal offset
        n = len(planned.ids)
        offset = 0 if offset + n > len(images) else offset  # cycle through all of them
        batch = Batch(
            index=planned.index,
            ids=planned.ids,
            images=images[offset : offset + n],
            labels=np.zeros(n, np.int64),
            cursor=planned.end,
            skipped_ids=(),
            normalized=False,
            num_batches=plan.num_batches,
            layout="NCHW",
        )
        offset += n
        return batch

    def plan_of(request: Any) -> Plan:
        return Plan(
            num_samples=num_samples,
            batch_size=request.batch_size,
            seed=request.seed,
            epoch=request.epoch,
            start=request.start,
            lanes=request.lanes or 1,
            lane=request.lane,
        )

    async def stream(request: Any, context: Any) -> Any:
        plan = plan_of(request)
        loop = asyncio.get_running_loop()
        for planned in plan.batches():
            batch = in_memory(plan, planned)
            encoded = await loop.run_in_executor(None, encode_parts, batch, limit)
            for message in encoded.messages:
                yield message

    async def pull(requests: Any, context: Any) -> None:
        loop = asyncio.get_running_loop()
        await context.send_initial_metadata(())
        plan: Plan | None = None
        async for message in requests:
            plan = plan or plan_of(message.stream)
            for index in message.batches:
                batch = in_memory(plan, plan.batch(index))
                encoded = await loop.run_in_executor(None, encode_parts, batch, limit)
                for part in encoded.messages:
                    await context.write(part)

    async def main() -> None:
        server = grpc.aio.server(
            options=[("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]
        )
        handlers = {
            "DescribeDataset": grpc.unary_unary_rpc_method_handler(
                describe,
                request_deserializer=pb.DescribeDatasetRequest.FromString,
                response_serializer=pb.DatasetInfo.SerializeToString,
            ),
            "StreamBatches": grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=pb.StreamBatchesRequest.FromString
            ),
            "PullBatches": grpc.stream_stream_rpc_method_handler(
                pull, request_deserializer=pb.PullRequest.FromString
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("batchwire.v1.Batchwire", handlers),)
        )
        port_queue.put(server.add_insecure_port("localhost:0"))
        await server.start()
        await server.wait_for_termination()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


@contextlib.contextmanager
def transport_server(
    dataset: str, num_samples: int, size: int = 224, max_message_bytes: int | None = None
) -> Iterator[tuple[str, int]]:
    """(address, pid) of a :func:`_transport_server` in a child process."""
    from batchwire.server import ServerConfig

    limit = max_message_bytes or ServerConfig.max_message_bytes
    with _child(_transport_server, dataset, num_samples, size, limit) as served:
        yield served


@contextlib.contextmanager
def _child(target: Callable[..., None], *args: Any) -> Iterator[tuple[str, int]]:
    context = multiprocessing.get_context("spawn")
    port_queue = context.Queue()
    process = context.Process(target=target, args=(port_queue, *args), daemon=True)
    process.start()
    try:
        port = port_queue.get(timeout=120)
        yield f"localhost:{port}", process.pid  # type: ignore[misc]
    finally:
        process.terminate()
        process.join(10)


# -- (a) in-process DALI ---------------------------------------------------------------


def run_inprocess(data_dir: pathlib.Path, dataset: str, batch_size: int, images: int) -> RunResult:
    from batchwire.common.stream import StreamSpec
    from batchwire.server import ServerConfig
    from batchwire.server.core import Engine

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
        return RunResult("inprocess", done, seconds, cpu.seconds(), None, rss.peaks[0], None, first)
    finally:
        engine.close()


# -- (b), (d) remote through RemoteLoader ----------------------------------------------


class LocalServer:
    """``batchwire serve`` in a child process on a free localhost port."""

    def __init__(
        self,
        data_dir: pathlib.Path,
        work: pathlib.Path,
        *,
        cpus: str | None = None,
        threads: int = 0,
        max_message_bytes: int | None = None,
        max_streams: int | None = None,
        read_workers: int = 0,
        port: int = 0,
    ) -> None:
        config = work / f"bench-server-{os.getpid()}-{id(self)}.toml"
        server = f"[server]\nnum_threads = {threads}\nread_workers = {read_workers}\n"
        if max_message_bytes is not None:
            server += f"max_message_bytes = {max_message_bytes}\n"
        if max_streams is not None:
            server += f"max_streams = {max_streams}\n"
        config.write_text(server + '\n[pipelines.train]\npreset = "train"\n')
        command = [
            sys.executable,
            "-m",
            "batchwire.cli",
            "--log-level",
            "WARNING",
            "serve",
            "--data-dir",
            str(data_dir),
            "--config",
            str(config),
            "--host",
            "localhost",
            "--port",
            str(port),
        ]
        if cpus is not None:
            command = ["taskset", "-c", cpus, *command]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r":(\d+)$", line.strip())
        if match is None:
            self.close()
            raise RuntimeError(f"batchwire serve did not start (it printed {line!r})")
        self.address = f"localhost:{match.group(1)}"
        _wait_serving(self.address, 180.0)

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _wait_serving(address: str, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=timeout
        )
        for reply in watch:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return
    raise RuntimeError(f"{address} stopped before it was SERVING")


def run_remote(
    name: str,
    addresses: list[str],
    server_pids: list[int],
    dataset: str,
    pipeline: str,
    batch_size: int,
    images: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    from batchwire.client import RemoteLoader

    loader = RemoteLoader(
        addresses,
        dataset=dataset,
        pipeline=pipeline,
        batch_size=batch_size,
        normalize=False,
        prefetch=2,
    )
    loader.set_epoch(random.randrange(1 << 20))
    server_clocks = [CpuClock(pid) for pid in server_pids]
    cpu = CpuClock()
    done, first = 0, None
    with RssSampler(os.getpid(), *server_pids) as rss:
        started = time.perf_counter()
        while done < images:
            for batch, _ in loader:
                done += len(batch)
                first = first or time.perf_counter() - started
                if progress is not None:
                    progress(len(batch))
                if done >= images:
                    break
        seconds = time.perf_counter() - started
    loader.close()
    server_cpu = sum(clock.seconds() for clock in server_clocks)
    return RunResult(
        name, done, seconds, cpu.seconds(), server_cpu, rss.peaks[0], sum(rss.peaks[1:]), first
    )


# -- (c) torch DataLoader with PIL over the same LMDB -----------------------------------


class LmdbPilDataset:
    """Source document 001's recipe: LMDB (readonly, lock=False, readahead=False) opened
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


# -- (e) raw gRPC ceiling --------------------------------------------------------------


def _raw_server(port_queue: Any, message_bytes: int) -> None:
    import grpc

    from batchwire.server.serving import tune_for_large_buffers

    tune_for_large_buffers()  # the same allocator settings as the batchwire servers

    # As many distinct bytes as the transport server's batches in memory, cycled: one
    # payload sent again and again would be read from the CPU's cache, which no
    # real stream enjoys.
    payloads = [
        os.urandom(message_bytes) for _ in range(max(1, -(-IN_MEMORY_BYTES // message_bytes)))
    ]

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        for i in range(int.from_bytes(request, "little")):
            yield payloads[i % len(payloads)]

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        options=[("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((handler,))
    port_queue.put(server.add_insecure_port("localhost:0"))
    server.start()
    server.wait_for_termination()


@contextlib.contextmanager
def raw_server(message_bytes: int) -> Iterator[tuple[str, int]]:
    """A plain gRPC server streaming ``message_bytes``-byte messages; (address, pid)."""
    with _child(_raw_server, message_bytes) as served:
        yield served


def run_raw(
    address: str, server_pid: int, message_bytes: int, images_per_message: float, images: int
) -> RunResult:
    import grpc

    messages = max(1, math.ceil(images / images_per_message))
    with grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", -1)]
    ) as channel:
        stream = channel.unary_stream("/bench.Raw/Stream")
        list(stream((1).to_bytes(4, "little")))  # connect
        server_cpu = CpuClock(server_pid)
        cpu = CpuClock()
        received = 0
        with RssSampler(os.getpid(), server_pid) as rss:
            started = time.perf_counter()
            for message in stream(messages.to_bytes(4, "little")):
                received += len(message)
            seconds = time.perf_counter() - started
    done = round(messages * images_per_message)
    return RunResult(
        "raw", done, seconds, cpu.seconds(), server_cpu.seconds(), rss.peaks[0], rss.peaks[1]
    )
