"""``python -m benchmarks --host-trainers 1,8``: one ``batchwire serve`` and K trainer
processes on the same host (a GPU host's own trainers), next to DALI's own pipeline in one
process on that host.

DALI's own pipeline (``run_dali``: its caffe reader, the served pipeline's graph, its
PyTorch iterator) runs first, at the server's ``hw_decoder_load`` and, on a GPU, at DALI's
default 0.65 too. Then, for each server setting (its defaults; ``--no-shared-memory``, which
serves the trainers as it would serve another host's, their images on bulk connections;
``--workers 1``; ``--workers 2``; or those ``--host-servers`` names, e.g. ``--host-servers
workers2,no-bulk``, ``no-bulk`` keeping the images in the call's messages, ``gpu-block``
and ``gpu-yield`` the workers' ways of waiting for the GPU, ``--gpu-wait``) and
each K, K trainer processes (``benchmarks._trainer``: a ``RemoteLoader`` as ``batchwire bench
--address`` runs it) stream at once. Once every one has its first batch (and a second
more), a window of ``--duration`` seconds (default 20) opens, after which they stop: the
images the server sent in that window a second (not the sum of each trainer's own rate,
which counts a trainer that started early, 16 of them importing torch on 2 cores taking
tens of seconds, at its rate alone), against DALI's best and against the rate of the most
trainers of the same server setting (``/ most``), with the server's CPU per image and cores
busy (its process tree) over the same window, the slowest and fastest trainer's own rate,
and each worker's share of the batches sent in the window (how evenly the workers share the
trainers). A count given twice runs twice (``--host-trainers 4,4,4``). Made for a GPU host
(``--pipeline train``); on the CPU it runs the same path with CPU pipelines.

``--pipeline wait`` is the waiting pipeline (:mod:`batchwire.bench._wait`: a 20 ms wait a
batch, the CPU idle as a GPU leaves it): whether few streams keep every pipeline busy, and
the server's own CPU per image, without a GPU; DALI's own pipeline is not run for it (its
rate is one wait after another), e.g. ``--host-trainers 1,2,4,8,16 --pipeline wait
--host-servers workers4 --batch-size 64``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import select
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchwire.bench import LocalServer
    from benchmarks._server_probe import ServerProbe

__all__ = ["DEFAULT_SERVERS", "SERVERS", "run_host_trainers"]

DURATION = 20.0
_RATE = re.compile(r"(\d+) images in ([\d.]+)s")
_CHECKOUT = pathlib.Path(__file__).resolve().parents[1]  # where ``benchmarks`` imports from
# The server settings compared, by the name --host-servers gives them: (row label, settings).
SERVERS: dict[str, tuple[str, dict[str, object]]] = {
    "defaults": ("serve (defaults)", {}),
    # A trainer on another host's path: images on the bulk connection, or in the messages.
    "no-shared-memory": ("serve --no-shared-memory", {"shared_memory": False}),
    "no-bulk": (
        "serve --no-shared-memory --no-bulk",
        {"shared_memory": False, "bulk": False},
    ),
    "workers1": ("serve --workers 1", {"workers": 1}),
    "workers2": ("serve --workers 2", {"workers": 2}),
    "workers4": ("serve --workers 4", {"workers": 4}),
    # How the workers' threads wait for the GPU (CUDA's own way spins).
    "gpu-block": ("serve --gpu-wait block", {"gpu_wait": "block"}),
    "gpu-yield": ("serve --gpu-wait yield", {"gpu_wait": "yield"}),
}
# What --host-servers compares unless told.
DEFAULT_SERVERS = ("defaults", "no-shared-memory", "no-bulk", "workers1", "workers2")
# Of the pipeline: the waiting stand-in, for which DALI's own pipeline is not run.
WAIT_PIPELINE = "wait"
_SETTLE_S = 1.0  # once every trainer streams, before the window opens
_SCRAPE_TRIES = 5
_START_TIMEOUT_S = 300.0  # for every trainer to stream (16 importing torch on 2 cores: ~30 s)


def run_host_trainers(args: argparse.Namespace) -> int:
    from batchwire.bench import NO_DECODE_TOML, LocalServer, bench_dataset, run_dali
    from batchwire.server import ServerConfig
    from batchwire.server.engine import visible_gpu_count
    from benchmarks._server_probe import ServerProbe

    counts = [int(k) for k in args.host_trainers.split(",")]
    if not counts or min(counts) < 1:
        print("error: --host-trainers takes counts >= 1, e.g. 1,8", file=sys.stderr)
        return 2
    chosen = args.host_servers.split(",")
    unknown = sorted(set(chosen) - set(SERVERS))
    if unknown:
        print(
            f"error: --host-servers: unknown {', '.join(unknown)}; choose from {','.join(SERVERS)}",
            file=sys.stderr,
        )
        return 2
    seconds = args.duration or DURATION
    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    gpu = args.device == "gpu" or (args.device == "auto" and visible_gpu_count() > 0)
    loads = (ServerConfig.hw_decoder_load, 0.65) if gpu else (None,)
    best = 0.0
    print(
        f"{'run':<52} {'images/s':>9} {'/ DALI best':>11} {'/ most':>6} {'CPU-ms/img':>10} "
        f"{'cores':>6} trainers (slowest-fastest)  workers' shares of the batches"
    )
    for load in loads if args.pipeline != WAIT_PIPELINE else ():
        dali = run_dali(
            "dali", data_dir / dataset, args.pipeline, args.batch_size, args.images,
            device=args.device, hw_decoder_load=load,
        )  # fmt: skip
        best = max(best, dali.images_per_second)
        name = "DALI's own in-process" + (f" (hw_decoder_load {load})" if gpu else "")
        per_image = 1000 * dali.trainer_cpu / dali.images
        print(
            f"{name:<52} {dali.images_per_second:9.0f} {'':>11} {'':>6} {per_image:10.3f} {'':>6}"
        )
    for label, settings in (SERVERS[name] for name in chosen):
        with LocalServer(
            data_dir, device=args.device, settings=settings, metrics=True, pipelines=NO_DECODE_TOML
        ) as server:
            assert server.metrics_port is not None  # metrics=True
            probe = ServerProbe(server.pid, server.metrics_port)
            rows = []
            for count in counts:
                rows.append((count, _trainers(server, probe, dataset, args, count, seconds)))
            most = max(rows, key=lambda row: row[0])[1].rate
            for count, run in rows:
                shares = "/".join(f"{n / max(sum(run.sent), 1):.2f}" for n in run.sent)
                name = f"{label} -> {count} trainer{'s' if count > 1 else ''}"
                against = f"{run.rate / best:11.2f}" if best else f"{'-':>11}"
                rates = run.trainer_rates
                print(
                    f"{name:<52} {run.rate:9.0f} {against} {run.rate / most:6.2f} "
                    f"{run.cpu_ms:10.3f} {run.cores:6.2f} "
                    f"{min(rates):.0f}-{max(rates):.0f} (x{min(rates) / max(rates):.2f})  "
                    f"{shares}",
                    flush=True,
                )
    return 0


@dataclasses.dataclass(frozen=True)
class _Run:
    """K trainers streaming at once from one server, over the window in which all stream."""

    rate: float  # images/s the server sent
    cpu_ms: float  # the server's CPU-ms per image (its process tree)
    cores: float  # the server's cores busy
    trainer_rates: list[float]  # each trainer's own images/s over its whole run
    sent: list[float]  # batches each worker sent in the window


def _trainers(
    server: LocalServer,
    probe: ServerProbe,
    dataset: str,
    args: argparse.Namespace,
    count: int,
    seconds: float,
) -> _Run:
    """``count`` trainer processes (``benchmarks._trainer``) streaming from ``server`` at
    once: the window of ``seconds`` opens once every one has its first batch, and they are
    stopped once it closes."""
    from batchwire.bench import process_tree

    command = [
        sys.executable, "-m", "benchmarks._trainer",
        server.address, dataset, args.pipeline, str(args.batch_size),
    ]  # fmt: skip
    tree = process_tree(server.pid)
    trainers = [
        subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=_CHECKOUT,
        )
        for _ in range(count)
    ]
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        for trainer in trainers:  # each says when its first batch arrived
            assert trainer.stdout is not None and trainer.stderr is not None
            ready, _, _ = select.select([trainer.stdout], [], [], deadline - time.monotonic())
            if not ready or trainer.stdout.readline().strip() != "streaming":
                trainer.kill()
                trainer.wait()
                raise RuntimeError(
                    f"a trainer did not stream within {_START_TIMEOUT_S:.0f}s (status "
                    f"{trainer.returncode}): {trainer.stderr.read()[-2000:]}"
                )
        time.sleep(_SETTLE_S)
        before, cpu_before, opened = _Totals.read(probe), _cpu(tree), time.monotonic()
        time.sleep(seconds)
        after, cpu_after, window = _Totals.read(probe), _cpu(tree), time.monotonic() - opened
        outputs = [t.communicate("stop\n", timeout=300) for t in trainers]
    finally:
        for trainer in trainers:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
    rates: list[float] = []
    for trainer, (out, err) in zip(trainers, outputs, strict=True):
        found = _RATE.search(out)
        if trainer.returncode != 0 or found is None:
            raise RuntimeError(f"a trainer failed (status {trainer.returncode}): {err[-2000:]}")
        rates.append(int(found.group(1)) / float(found.group(2)))
    images = after.samples - before.samples
    server_cpu = cpu_after - cpu_before
    return _Run(
        rate=images / window,
        cpu_ms=1000 * server_cpu / max(images, 1),
        cores=server_cpu / window,
        trainer_rates=rates,
        sent=[n - before.sent.get(w, 0.0) for w, n in sorted(after.sent.items(), key=_worker)],
    )


def _cpu(pids: list[int]) -> float:
    """CPU seconds of the server's processes (``process_tree`` of it, taken once)."""
    from batchwire.bench import process_cpu_seconds

    return sum(process_cpu_seconds(pid) for pid in pids)


def _worker(item: tuple[str, float]) -> int:
    return int(item[0])


@dataclasses.dataclass(frozen=True)
class _Totals:
    """What a server's ``/metrics`` says at one moment (one scrape)."""

    samples: float  # samples sent, every stream of every worker
    sent: dict[str, float]  # batches sent, by worker ("0": a lone server)

    @classmethod
    def read(cls, probe: ServerProbe) -> _Totals:
        """One scrape in which every worker answered (a unit leaves out the series of a
        worker whose own scrape timed out, on a busy host): a few tries."""
        for _ in range(_SCRAPE_TRIES - 1):
            samples = probe.scrape()
            if not any(s.name == "batchwire_worker_scrape_errors" and s.value for s in samples):
                return cls._of(samples)
        return cls._of(probe.scrape())

    @classmethod
    def _of(cls, scraped: list[Any]) -> _Totals:
        samples = 0.0
        sent: dict[str, float] = {}
        for sample in scraped:
            if sample.name == "batchwire_samples_sent_total":
                samples += sample.value
            elif sample.name == "batchwire_batches_sent_total":
                worker = sample.labels.get("worker", "0")
                sent[worker] = sent.get(worker, 0.0) + sample.value
        return cls(samples, sent)
