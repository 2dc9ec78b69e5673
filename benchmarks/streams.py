"""``python -m benchmarks --streams K[,K...]``: one server under K concurrent streams.

The clients are raw asyncio gRPC streams in this process (one event loop, no decoding), so
that what is measured is the server: K streams of one DDP-like job open at once, each on an
epoch of its own (a stream that ends starts the next epoch). Each is a ``PullBatches`` call
that asks for batches as ``RemoteLoader`` does: ``CREDIT`` at first, then one more for
each batch received. Reported per K:

- aggregate images/s over the second half of the run (the first half is warm-up); where a
  stream's first batch comes later than half-time (a slow host, a long pipeline build), the
  counted half starts at that batch instead, and the run is longer by as much (at most
  half again), so that no warm-up is counted;
- the server's threads and resident memory at their peak;
- the time to each stream's first batch, p50/p99/max, from the moment all were opened (a
  stream that got none in the whole run counts as "starved" and as infinitely late);
- the spread of the streams' rates over the second half, as min/median and max/median
  (starved streams included, at rate 0);
- streams that ended with an error ("refused");
- the device the server runs its pipelines on, as it reports (``--device``: auto, cpu, gpu);
- over the second half, per image the server sent: its CPU ms, and where its time went in
  ms, summed over its threads and streams (so they overlap, and need not add up to the
  wall time): ``read`` (the record path: LMDB, parse, screen), ``pipeline`` (DALI's own
  run), ``encode`` (the message build), ``send`` (batches waiting in gRPC writes: sending
  and flow control). See :mod:`benchmarks._server_probe`;
- where a GPU is visible, the server's GPU memory at its peak, and the growth over what it
  held before the streams opened, per stream; "-" (null in JSON) without one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import pathlib
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._server_probe import Counters, ServerProbe, gpu_memory_mib

__all__ = [
    "CREDIT",
    "PeakSampler",
    "StreamsResult",
    "StreamsRun",
    "measure_streams",
    "run_streams",
    "run_streams_async",
    "table",
]

CREDIT = 4  # batches a stream asks for ahead, as RemoteLoader's default (prefetch + 2)


@dataclasses.dataclass
class StreamsResult:
    streams: int
    seconds: float
    images_per_s: float
    threads: int
    rss_mib: float
    first_p50: float
    first_p99: float
    first_max: float
    spread_min: float  # slowest stream's rate / median rate
    spread_max: float  # fastest stream's rate / median rate
    starved: int  # streams that got no batch in the whole run
    refused: int  # streams that ended with an error (RESOURCE_EXHAUSTED, ...)
    device: str  # where the server ran its pipelines: cpu or gpu
    cpu_ms_per_image: float  # the server process's CPU time, per image sent
    read_ms_per_image: float  # the server's time in each stage per image sent, summed
    pipeline_ms_per_image: float  # over its threads and streams
    encode_ms_per_image: float
    send_ms_per_image: float
    gpu_mib: float | None  # the server's GPU memory at its peak; None without a GPU
    gpu_mib_per_stream: float | None  # (peak - before the streams opened) / streams


def _proc_status(pid: int) -> tuple[int, float]:
    """(threads, resident MiB) of ``pid``."""
    threads, rss = 0, 0.0
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    except OSError:
        pass
    return threads, rss


class PeakSampler:
    """Peak threads, RSS and (with ``gpu_mib``, what it held at the start) GPU memory of
    a process while the ``with`` block runs."""

    def __init__(self, pid: int, gpu_mib: float | None, interval: float = 0.25) -> None:
        self._pid = pid
        self._interval = interval
        self._stop = threading.Event()
        self.threads, self.rss_mib = _proc_status(pid)
        self.gpu_mib = gpu_mib
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            threads, rss = _proc_status(self._pid)
            self.threads, self.rss_mib = max(self.threads, threads), max(self.rss_mib, rss)
            if self.gpu_mib is not None:
                self.gpu_mib = max(self.gpu_mib, gpu_memory_mib(self._pid) or 0.0)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _requests(share: Any, wanted: asyncio.Queue[list[int] | None]) -> Any:
    """A PullBatches request stream: the share, then the batches put on ``wanted``, until
    None (half-close)."""
    from batchwire.v1 import batchwire_pb2

    yield batchwire_pb2.PullRequest(stream=share)
    while (batches := await wanted.get()) is not None:
        yield batchwire_pb2.PullRequest(batches=batches)


class StreamsRun:
    """K streams of one run: its clock, what each stream asks for, and the tallies."""

    def __init__(
        self, stub: Any, requests: Sequence[dict[str, Any]], started: float, seconds: float
    ) -> None:
        streams = len(requests)
        self.stub = stub
        self.requests = requests
        self.num_samples = 0  # set once the dataset is described
        self.started = started
        # The counted half: from half-time, or from the last stream's first batch if later
        # (no later than the nominal end: a starved stream holds nothing up), for seconds/2.
        self.half = started + seconds / 2
        self.end = started + seconds * 1.5  # the latest it can be; set when the half starts
        self.length = seconds / 2
        self.counting = False
        self.warm = asyncio.Event()  # every stream has had its first batch
        self.firsts: list[float | None] = [None] * streams
        self.counted = [0] * streams  # images in the second half
        self.batches = [0] * streams  # batches in the whole run
        self.refused = 0
        self.window: list[Counters] = []  # the server's, at the second half's start and end

    async def watch(self, probe: ServerProbe) -> None:
        """Start the counted half, reading the server's counters then and as it ends."""
        await asyncio.sleep(max(0.0, self.half - time.perf_counter()))
        nominal_end = self.started + 2 * self.length
        with contextlib.suppress(TimeoutError):  # a stream starved: it counts as such
            await asyncio.wait_for(
                self.warm.wait(), timeout=max(0.0, nominal_end - time.perf_counter())
            )
        self.window.append(await asyncio.to_thread(probe.counters))
        self.half = time.perf_counter()
        self.end = self.half + self.length
        self.counting = True
        await asyncio.sleep(max(0.0, self.end - time.perf_counter()))
        self.window.append(await asyncio.to_thread(probe.counters))

    async def stream(self, index: int) -> None:
        """Epochs of stream ``index``, each a PullBatches call, until the run ends."""
        epoch = index * 1000
        while time.perf_counter() < self.end and await self._epoch(index, epoch):
            epoch += 1

    async def _epoch(self, index: int, epoch: int) -> bool:
        """One epoch; False when the run ended during it or the stream failed."""
        import grpc

        from batchwire.v1 import batchwire_pb2

        wanted: asyncio.Queue[list[int] | None] = asyncio.Queue()
        request = self.requests[index]
        share = batchwire_pb2.StreamBatchesRequest(**request, seed=index, epoch=epoch)
        num_batches = self.num_samples // request["batch_size"]  # drop_last, the default
        asked = min(CREDIT, num_batches)
        wanted.put_nowait(list(range(asked)))
        received = 0
        timeout = max(1.0, self.end - time.perf_counter() + 30)
        call = self.stub.PullBatches(_requests(share, wanted), timeout=timeout)
        try:
            async for batch in call:
                now = time.perf_counter()
                if self.firsts[index] is None:
                    self.firsts[index] = now - self.started
                    if all(first is not None for first in self.firsts):
                        self.warm.set()
                if self.counting and now < self.end:
                    self.counted[index] += len(batch.ids)
                if now >= self.end:
                    call.cancel()
                    return False
                if batch.part + 1 < (batch.parts or 1):
                    continue  # more parts of this batch to come
                received += 1
                self.batches[index] += 1
                if asked < num_batches:
                    wanted.put_nowait([asked])
                    asked += 1
                elif received == num_batches:
                    wanted.put_nowait(None)  # half-close: the epoch is done
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                self.refused += 1
            return False
        return True


async def run_streams_async(
    address: str, probe: ServerProbe, requests: Sequence[dict[str, Any]], seconds: float
) -> StreamsRun:
    """A run of one stream per request, its tallies and the server's counters over the
    second half."""
    import grpc

    from batchwire.v1 import batchwire_pb2, batchwire_pb2_grpc

    started = time.perf_counter()
    options = [("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = batchwire_pb2_grpc.BatchwireStub(channel)
        run = StreamsRun(stub, requests, started, seconds)
        sources = requests[0].get("sources")
        if sources:  # a mixture's epoch: its sources' counts
            run.num_samples = sum(source.count for source in sources)
        else:
            info = await stub.DescribeDataset(
                batchwire_pb2.DescribeDatasetRequest(dataset=requests[0]["dataset"]), timeout=60
            )
            run.num_samples = info.num_samples
        watch = asyncio.create_task(run.watch(probe))
        tasks = [asyncio.create_task(run.stream(i)) for i in range(len(requests))]
        # A stream still waiting for a batch at the end is cancelled then, not waited for.
        _, late = await asyncio.wait(tasks, timeout=max(0.0, run.end - time.perf_counter()) + 1)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        await watch
    return run


def measure_streams(
    address: str,
    probe: ServerProbe,
    dataset: str,
    pipeline: str,
    batch_size: int,
    streams: int,
    seconds: float,
    params: dict[str, float] | None = None,
    sources: Sequence[Any] = (),
) -> StreamsResult:
    """``streams`` concurrent streams for ``seconds`` against the server at ``address``,
    whose process and ``/metrics`` ``probe`` reads: of ``dataset``, or of a mixture of
    ``sources`` (``batchwire_pb2.Source`` each; ``dataset`` then "")."""
    request: dict[str, Any] = {
        **({"sources": list(sources)} if sources else {"dataset": dataset}),
        "pipeline": pipeline,
        "batch_size": batch_size,
        "params": params or {},
    }
    gpu_before = gpu_memory_mib(probe.pid)
    with PeakSampler(probe.pid, gpu_before) as peak:
        run = asyncio.run(run_streams_async(address, probe, [request] * streams, seconds))
    window = seconds / 2
    rates = [images / window for images in run.counted]
    late = [first if first is not None else float("inf") for first in run.firsts]
    median = statistics.median(rates)
    cpu, stages = run.window[0].per_image_ms(run.window[1])
    return StreamsResult(
        streams=streams,
        seconds=seconds,
        images_per_s=sum(run.counted) / window,
        threads=peak.threads,
        rss_mib=peak.rss_mib,
        first_p50=_percentile(late, 0.5),
        first_p99=_percentile(late, 0.99),
        first_max=max(late),
        spread_min=min(rates) / median if median else 0.0,
        spread_max=max(rates) / median if median else 0.0,
        starved=sum(first is None for first in run.firsts),
        refused=run.refused,
        device=probe.device(),
        cpu_ms_per_image=cpu,
        read_ms_per_image=stages["read"],
        pipeline_ms_per_image=stages["pipeline"],
        encode_ms_per_image=stages["encode"],
        send_ms_per_image=stages["send"],
        gpu_mib=peak.gpu_mib,
        gpu_mib_per_stream=(
            None
            if gpu_before is None or peak.gpu_mib is None
            else (peak.gpu_mib - gpu_before) / streams
        ),
    )


def _seconds(value: float, width: int) -> str:
    text = "never" if value == float("inf") else f"{value:.2f}s"
    return f"{text:>{width}}"


def _mib(value: float | None, width: int) -> str:
    text = "-" if value is None else f"{value:.0f}"
    return f"{text:>{width}}"


def table(results: Sequence[StreamsResult]) -> str:
    """The clients' view, the ratios against the first K, then the server's per image."""
    lines = [
        f"{'streams':>7} {'images/s':>9} {'threads':>7} {'RSS MiB':>8} "
        f"{'first p50':>9} {'p99':>6} {'max':>6} {'rate min/med':>12} {'max/med':>7} "
        f"{'starved':>7} {'refused':>7}"
    ]
    for r in results:
        lines.append(
            f"{r.streams:>7} {r.images_per_s:>9.0f} {r.threads:>7} {r.rss_mib:>8.0f} "
            f"{_seconds(r.first_p50, 9)} {_seconds(r.first_p99, 6)} {_seconds(r.first_max, 6)} "
            f"{r.spread_min:>12.2f} {r.spread_max:>7.2f} {r.starved:>7} {r.refused:>7}"
        )
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            lines.append(
                f"K={r.streams} vs K={base.streams}: images/s "
                f"{r.images_per_s / base.images_per_s if base.images_per_s else 0:.2f}x, "
                f"threads {r.threads / base.threads if base.threads else 0:.2f}x, "
                f"RSS {r.rss_mib / base.rss_mib if base.rss_mib else 0:.2f}x"
            )
    return "\n".join([*lines, "", _server_table(results)])


def _server_table(results: Sequence[StreamsResult]) -> str:
    lines = [
        "the server, per image sent in the second half (ms; stages summed over its threads "
        "and streams):",
        f"{'streams':>7} {'device':>6} {'CPU ms':>7} {'read':>6} {'pipeline':>8} "
        f"{'encode':>6} {'send':>6} {'GPU MiB':>8} {'GPU MiB/stream':>14}",
    ]
    for r in results:
        lines.append(
            f"{r.streams:>7} {r.device:>6} {r.cpu_ms_per_image:>7.2f} "
            f"{r.read_ms_per_image:>6.2f} {r.pipeline_ms_per_image:>8.2f} "
            f"{r.encode_ms_per_image:>6.2f} {r.send_ms_per_image:>6.2f} "
            f"{_mib(r.gpu_mib, 8)} {_mib(r.gpu_mib_per_stream, 14)}"
        )
    return "\n".join(lines)


def run_streams(args: argparse.Namespace) -> int:
    """A server of its own for each K of ``--streams``, ``--duration`` seconds (20) each,
    on ``--device``."""
    from batchwire.bench import LocalServer, bench_dataset, machine, write_json

    try:
        counts = [int(k) for k in args.streams.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        print("error: --streams takes stream counts, e.g. 1,64,256", file=sys.stderr)
        return 2
    seconds = args.duration or 20.0
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    params = {"size": float(args.size)} if args.size else None
    results = []
    print(
        f"{dataset}, pipeline {args.pipeline}, batch {args.batch_size}"
        f"{f', size {args.size}' if args.size else ''}, device {args.device}: "
        f"{seconds:.0f} s a run, a new server each"
    )
    for count in counts:
        with LocalServer(
            data_dir, max_streams=max(64, count + 8), device=args.device, metrics=True
        ) as server:
            print(f"  {count} streams ...", flush=True)
            assert server.metrics_port is not None  # metrics=True
            probe = ServerProbe(server.pid, server.metrics_port)
            results.append(
                measure_streams(
                    server.address,
                    probe,
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
        run = {"dataset": dataset, "pipeline": args.pipeline, "batch_size": args.batch_size}
        run |= {"size": args.size, "device": args.device, "seconds": seconds}
        rows = [vars(r) for r in results]
        write_json(args.json, {"machine": machine(), "run": run, "streams": rows})
    return 0
