"""``python -m benchmarks --duration SECONDS``: a long run from a local server, with the
server's and the client's resident memory sampled about 20 times from start to end."""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

__all__ = ["run_long"]

Sample = tuple[float, float, float]  # seconds since the start, server RSS, client RSS (MiB)


def run_long(args: argparse.Namespace) -> int:
    """Stream for ``--duration`` seconds; memory at start and end, and the growth."""
    from batchwire.bench import LocalServer, bench_dataset

    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    with (
        tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work,
        LocalServer(data_dir, pathlib.Path(work)) as server,
    ):
        images, samples = _stream(args, server.address, server.pid, dataset)
    print(f"{images} images in {args.duration:.0f}s ({images / args.duration:.0f} images/s)")
    print(f"{'t (s)':>8} {'server RSS MiB':>15} {'client RSS MiB':>15}")
    for t, server_rss, client_rss in samples:
        print(f"{t:8.0f} {server_rss:15.0f} {client_rss:15.0f}")
    if len(samples) >= 2:
        (_, s0, c0), (_, s1, c1) = samples[1], samples[-1]
        print(f"after warm-up to end: server {s1 - s0:+.0f} MiB, client {c1 - c0:+.0f} MiB")
    return 0


def _stream(
    args: argparse.Namespace, address: str, server_pid: int, dataset: str
) -> tuple[int, list[Sample]]:
    """(images received, memory samples) of epochs streamed for ``args.duration`` seconds."""
    from batchwire.bench import process_tree, progress, rss_mib
    from batchwire.client import RemoteLoader

    loader = RemoteLoader(
        address,
        dataset=dataset,
        pipeline=args.pipeline,
        batch_size=args.batch_size,
        normalize=False,
    )
    samples: list[Sample] = []
    started = time.monotonic()
    images = 0
    next_sample = started
    with progress(0, "streaming") as bar:
        while time.monotonic() - started < args.duration:
            for batch, _ in loader:
                images += len(batch)
                bar.update(len(batch))
                now = time.monotonic()
                if now >= next_sample:
                    server_rss = rss_mib(process_tree(server_pid))
                    samples.append((now - started, server_rss, rss_mib([os.getpid()])))
                    next_sample = now + max(1.0, args.duration / 20)
                if now - started >= args.duration:
                    break
    loader.close()
    return images, samples
