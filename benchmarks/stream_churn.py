"""Open and cancel hundreds of streams against a real server; report its RSS and threads.

    python -m benchmarks.stream_churn --streams 300 --concurrency 8

Starts `batchwire serve` as a child process over a small generated dataset (or
--data-dir), warms it up at full concurrency, then runs rounds of streams that
each read one batch and cancel, printing the server's resident memory and
thread count (from /proc) after each round. Flat numbers across rounds mean
cancelled streams free what they used: the server keeps slots_per_device
(config, default 2) pipelines per device for all streams and at most
max_streams + 4 stream threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import re
import tempfile
import time

import grpc
from tqdm import tqdm

from batchwire.bench import LocalServer
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc


def proc_status(pid: int) -> tuple[float, int]:
    """(RSS in MiB, threads) of a process, from /proc."""
    text = pathlib.Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024  # type: ignore[union-attr]
    threads = int(re.search(r"Threads:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
    return rss, threads


def one_stream(address: str, batch_size: int) -> str:
    with grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", -1)]
    ) as channel:
        request = pb.StreamBatchesRequest(dataset="shapes", pipeline="train", batch_size=batch_size)
        call = pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=120)
        try:
            next(call)
            return "ok"
        except grpc.RpcError as exc:
            return exc.code().name  # type: ignore[no-any-return]
        finally:
            call.cancel()


def churn(
    address: str, streams: int, concurrency: int, batch_size: int, desc: str
) -> dict[str, int]:
    """Open and cancel ``streams`` streams, ``concurrency`` at a time; outcome counts."""
    outcomes: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one_stream, address, batch_size) for _ in range(streams)]
        done = concurrent.futures.as_completed(futures)
        # disable=None: no bar where stderr is not a terminal (a log file, CI)
        for future in tqdm(done, total=streams, desc=desc, disable=None):
            outcomes[future.result()] = outcomes.get(future.result(), 0) + 1
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --streams streams")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--data-dir", type=pathlib.Path, help="datasets (default: a generated one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batchwire-churn-") as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            from batchwire.server.data import ingest, write_image_folders

            write_image_folders(pathlib.Path(tmp) / "images", per_class=64, size=96)
            ingest(pathlib.Path(tmp) / "images", pathlib.Path(tmp) / "data", name="shapes")
            data_dir = pathlib.Path(tmp) / "data"
        with LocalServer(data_dir, pathlib.Path(tmp), max_streams=args.concurrency * 2) as server:
            address = server.address
            # Warm up at full concurrency: the server's pipeline pool and stream
            # threads grow to what this load needs, and that is the baseline.
            warm = churn(
                address, args.concurrency * 4, args.concurrency, args.batch_size, "warm-up"
            )
            rounds = []
            for round_ in range(args.rounds):
                started = time.perf_counter()
                outcomes = churn(
                    address, args.streams, args.concurrency, args.batch_size, f"round {round_ + 1}"
                )
                rounds.append((time.perf_counter() - started, outcomes, proc_status(server.pid)))
            names: dict[str, int] = {}
            for comm in pathlib.Path(f"/proc/{server.pid}/task").glob("*/comm"):
                name = re.sub(r"\d+", "N", comm.read_text().strip())
                names[name] = names.get(name, 0) + 1
    print(f"warm-up ({args.concurrency * 4} streams): {warm}")
    print(f"{'':>8} {'streams':>8} {'seconds':>8} {'RSS MiB':>8} {'threads':>8}  outcomes")
    for n, (seconds, outcomes, (rss, threads)) in enumerate(rounds, 1):
        print(f"round {n:<2} {args.streams:8d} {seconds:8.1f} {rss:8.0f} {threads:8d}  {outcomes}")
    print("server threads by name:", dict(sorted(names.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
