"""``python -m benchmarks --messages``: gRPC throughput by message size, and a large batch
sent in parts of several sizes vs whole.

First the raw gRPC ceiling (run (e) of ``batchwire bench --compare``) for messages of 1 to
32 MB: GB/s and the client's CPU seconds per GB. Then batchwire's transport (run (d): batches
already in memory, no decoding) for a batch of at least 512 images, cut into parts of 1 to
16 MiB or sent whole.
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
    from batchwire.bench import raw_server, run_raw

    print(f"{'message':>10} {'GB/s':>7} {'client CPU-s/GB':>16}")
    rows: list[dict[str, Any]] = []
    for mb in _MESSAGE_MB:
        size = mb * 2**20
        with raw_server(size) as (address, pid):
            result = run_raw(address, pid, size, 1.0, max(8, 4 * 2**30 // size))
        gigabytes = result.images * size / 1e9
        rate, cpu = gigabytes / result.seconds, result.trainer_cpu / gigabytes
        rows.append({"message_mb": mb, "gb_per_s": rate, "cpu_s_per_gb": cpu})
        print(f"{mb:>8} MB {rate:7.2f} {cpu:16.2f}")
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
