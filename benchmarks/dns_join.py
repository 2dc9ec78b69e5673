"""How soon a server that joins a ``dns:///`` name mid-epoch gets batches from a loader.

    python -m benchmarks.dns_join [--resolve-every 5] [--data-dir DIR --dataset NAME]

Serves a dataset (default: ``batchwire bench``'s generated photos, built by any bench run)
from 127.0.0.1:P, streams it through a loader on ``dns:///fleet.test:P``, and after a few
batches starts a second server on 127.0.0.2:P and adds that address to the name. The name
is answered by a stand-in for DNS in this process (``socket.getaddrinfo``), as a
Kubernetes headless Service answers when a pod becomes ready. Prints the seconds from the
new server being SERVING and in the name to its first batch sent.
"""

from __future__ import annotations

import argparse
import pathlib
import socket
import time
from typing import Any

from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer, ServerConfig

NAME = "fleet.test"


def serve(data_dir: pathlib.Path, host: str, port: int) -> BatchwireServer:
    config = ServerConfig(data_dir=data_dir, host=host, port=port, device="cpu", num_threads=1)
    server = BatchwireServer(config)
    server.start()
    if not server.wait_serving(120):
        raise SystemExit(f"the server on {host}:{port} did not become SERVING")
    return server


def samples_sent(server: BatchwireServer) -> float:
    return sum(
        sample.value
        for metric in server.metrics.registry.collect()
        if metric.name == "batchwire_samples_sent"
        for sample in metric.samples
        if sample.name == "batchwire_samples_sent_total"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolve-every", type=float, default=5.0)
    parser.add_argument(
        "--data-dir",
        type=pathlib.Path,
        default=pathlib.Path.home() / ".cache/batchwire/bench/datasets",
    )
    parser.add_argument("--dataset", default="photos-4096")
    args = parser.parse_args()

    first = serve(args.data_dir, "127.0.0.1", 0)
    answer = ["127.0.0.1"]
    resolve = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *rest: Any, **options: Any) -> Any:
        if host != NAME:
            return resolve(host, port, *rest, **options)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, int(port))) for ip in answer]

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
    joined: BatchwireServer | None = None
    loader = RemoteLoader(
        f"dns:///{NAME}:{first.port}",
        dataset=args.dataset,
        pipeline="val",
        batch_size=32,
        params={"size": 64},
        normalize=False,
        resolve_every=args.resolve_every,
    )
    try:
        for n, _ in enumerate(loader):
            if n == 5:
                joined = serve(args.data_dir, "127.0.0.2", first.port)
                answer.append("127.0.0.2")
                since = time.monotonic()
            if joined is not None and samples_sent(joined) > 0:
                print(
                    f"the joined server sent its first batch {time.monotonic() - since:.1f} s "
                    f"after it was SERVING and in the name (resolve_every={args.resolve_every:g})"
                )
                break
        else:
            print("the epoch ended before the joined server sent a batch")
    finally:
        loader.close()
        first.stop(1.0)
        if joined is not None:
            joined.stop(1.0)


if __name__ == "__main__":
    main()
