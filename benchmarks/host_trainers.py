"""``python -m benchmarks --host-trainers 1,8``: one ``batchwire serve`` and K trainer
processes on the same host (a GPU host's own trainers), next to DALI's own pipeline in one
process on that host.

DALI's own pipeline (``run_dali``: its caffe reader, the served pipeline's graph, its
PyTorch iterator) runs first, at the server's ``hw_decoder_load`` and, on a GPU, at DALI's
default 0.65 too. Then, for each server setting (its defaults; ``--no-shared-memory``, which
serves the trainers as it would serve another host's, their images on bulk connections;
``--workers 1``; ``--workers 2``; or those ``--host-servers`` names, e.g. ``--host-servers
workers2,no-bulk``, ``no-bulk`` keeping the images in the call's messages) and
each K, K processes of ``batchwire bench --address`` stream for ``--duration`` seconds
(default 20) at once: their images/s summed, against DALI's best, with the server's CPU per
image and cores busy (its process tree) over the same window, the slowest and fastest
trainer's rate, and each worker's share of the batches sent (how evenly the workers share
the trainers). A count given twice runs twice (``--host-trainers 4,4,4``). Made for a GPU
host (``--pipeline train``); on the CPU it runs the same path with CPU pipelines.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchwire.bench import LocalServer

__all__ = ["SERVERS", "run_host_trainers"]

DURATION = 20.0
_RATE = re.compile(r"(\d+) images in ([\d.]+)s: (\d+) images/s")
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
}


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
        f"{'run':<52} {'images/s':>9} {'/ DALI best':>11} {'CPU-ms/img':>10} {'cores':>6} "
        "trainers (slowest-fastest)  workers' shares of the batches"
    )
    for load in loads:
        dali = run_dali(
            "dali", data_dir / dataset, args.pipeline, args.batch_size, args.images,
            device=args.device, hw_decoder_load=load,
        )  # fmt: skip
        best = max(best, dali.images_per_second)
        name = "DALI's own in-process" + (f" (hw_decoder_load {load})" if gpu else "")
        per_image = 1000 * dali.trainer_cpu / dali.images
        print(f"{name:<52} {dali.images_per_second:9.0f} {'':>11} {per_image:10.3f} {'':>6}")
    for label, settings in (SERVERS[name] for name in chosen):
        with LocalServer(
            data_dir, device=args.device, settings=settings, metrics=True, pipelines=NO_DECODE_TOML
        ) as server:
            assert server.metrics_port is not None  # metrics=True
            probe = ServerProbe(server.pid, server.metrics_port)
            for count in counts:
                before = probe.batches_by_worker()
                rates, cpu_ms, cores = _trainers(server, dataset, args, count, seconds)
                after = probe.batches_by_worker()
                sent = {w: after[w] - before.get(w, 0.0) for w in sorted(after, key=int)}
                shares = "/".join(f"{n / max(sum(sent.values()), 1):.2f}" for n in sent.values())
                rate = sum(rates)
                name = f"{label} -> {count} trainer{'s' if count > 1 else ''}"
                print(
                    f"{name:<52} {rate:9.0f} {rate / best:11.2f} {cpu_ms:10.3f} {cores:6.2f} "
                    f"{min(rates):.0f}-{max(rates):.0f} (x{min(rates) / max(rates):.2f})  "
                    f"{shares}"
                )
    return 0


def _trainers(
    server: LocalServer, dataset: str, args: argparse.Namespace, count: int, seconds: float
) -> tuple[list[float], float, float]:
    """``count`` trainer processes streaming from ``server`` at once for ``seconds``: each
    one's images/s (unequal where the kernel spreads connections unevenly over workers),
    the server's CPU-ms per image and its cores busy."""
    from batchwire.bench import process_cpu_seconds, process_tree

    address, pid = server.address, server.pid
    command = [
        sys.executable, "-m", "batchwire.cli", "bench", "--address", address,
        "--dataset", dataset, "--pipeline", args.pipeline,
        "--batch-size", str(args.batch_size), "--duration", str(seconds), "--no-progress",
    ]  # fmt: skip
    trainers = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    tree = process_tree(pid)
    before, started = sum(process_cpu_seconds(p) for p in tree), time.monotonic()
    outputs = [t.communicate(timeout=seconds + 300) for t in trainers]
    window = time.monotonic() - started
    server_cpu = sum(process_cpu_seconds(p) for p in tree) - before
    images = 0
    rates: list[float] = []
    for trainer, (out, err) in zip(trainers, outputs, strict=True):
        found = _RATE.search(out)
        if trainer.returncode != 0 or found is None:
            raise RuntimeError(f"a trainer failed (status {trainer.returncode}): {err[-2000:]}")
        images += int(found.group(1))
        rates.append(float(found.group(3)))
    return rates, 1000 * server_cpu / max(images, 1), server_cpu / window
