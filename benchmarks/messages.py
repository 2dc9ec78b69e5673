"""``python -m benchmarks --messages``: gRPC throughput by message size, and a large batch
sent in parts of several sizes vs whole.

First the raw gRPC ceiling (run (e) of ``batchwire bench --compare``) for messages of 1 to
32 MB: GB/s and the client's and the server's CPU seconds per GB, beside the same bytes over
a plain TCP connection (sent from the payload's memory, received into one buffer: the
kernel's copies only), the ceiling under gRPC's. Then batchwire's transport (run (d):
batches already in memory, no decoding) for a batch of at least 512 images, cut into parts
of 1 to 16 MiB or sent whole.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["run_messages"]

_MESSAGE_MB = (1, 4, 8, 16, 32)
_PARTS = (
    ("parts of 1 MiB", 2**20),
    ("parts of 2 MiB", 2 * 2**20),
    ("parts of 4 MiB", 4 * 2**20),
    ("parts of 8 MiB", 8 * 2**20),
    ("parts of 16 MiB", 16 * 2**20),
    ("whole", 2**30),
)


def run_messages(args: argparse.Namespace) -> int:
    """Both tables; ``--json`` writes their rows."""
    from batchwire.bench import machine, write_json

    rows = _raw_by_size()
    rows += _parts_vs_whole(max(args.batch_size, 512))
    if args.json:
        write_json(args.json, {"machine": machine(), "messages": rows})
    return 0


def _raw_by_size() -> list[dict[str, Any]]:
    from batchwire.bench import plain_server, raw_server, run_plain, run_raw

    print(
        f"{'message':>10} {'gRPC GB/s':>10} {'CPU-s/GB client':>16} {'server':>7}   "
        f"{'plain TCP GB/s':>14} {'CPU-s/GB client':>16} {'server':>7}"
    )
    rows: list[dict[str, Any]] = []
    for mb in _MESSAGE_MB:
        size = mb * 2**20
        count = max(8, 4 * 2**30 // size)
        with raw_server(size) as (address, pid):
            grpc_run = run_raw(address, pid, size, 1.0, count)
        with plain_server(size) as (address, pid):
            plain_run = run_plain(address, pid, size, count)
        row: dict[str, Any] = {"message_mb": mb}
        for name, result in (("grpc", grpc_run), ("plain", plain_run)):
            gigabytes = result.images * size / 1e9
            row[f"{name}_gb_per_s"] = gigabytes / result.seconds
            row[f"{name}_client_cpu_s_per_gb"] = result.trainer_cpu / gigabytes
            # Both runs measure the server's CPU.
            row[f"{name}_server_cpu_s_per_gb"] = (result.server_cpu or 0.0) / gigabytes
        rows.append(row)
        print(
            f"{mb:>7} MB {row['grpc_gb_per_s']:>10.2f} {row['grpc_client_cpu_s_per_gb']:>16.2f} "
            f"{row['grpc_server_cpu_s_per_gb']:>7.2f}   {row['plain_gb_per_s']:>14.2f} "
            f"{row['plain_client_cpu_s_per_gb']:>16.2f} {row['plain_server_cpu_s_per_gb']:>7.2f}"
        )
    return rows


def _parts_vs_whole(batch: int) -> list[dict[str, Any]]:
    from batchwire.bench import IMAGE_BYTES, run_remote, transport_server

    print(f"\nbatches of {batch} ({batch * IMAGE_BYTES / 2**20:.0f} MiB), transport only (d):")
    rows: list[dict[str, Any]] = []
    for label, limit in _PARTS:
        with transport_server("memory", 4096, max_message_bytes=limit) as (address, pid):
            result = run_remote(
                "transport", [address], [pid], "memory", "transport", batch, batch * 8
            )
        rate = result.images_per_second
        rows.append({"batch": batch, "messages": label, "images_per_s": rate})
        print(f"  {label:<16} {rate:8.0f} images/s ({rate * IMAGE_BYTES / 1e9:.2f} GB/s)")
    return rows
