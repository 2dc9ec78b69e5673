"""A DDP rank for test_lifecycle, run in spawned processes: imports only the client."""

from __future__ import annotations

import pathlib

import torch.distributed as dist

from batchwire.client import RemoteLoader


def stream_rank(rank: int, world: int, init_file: str, address: str, out_dir: str) -> None:
    """Join a gloo group, stream one epoch with rank/world left to torch.distributed."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with RemoteLoader(
            address,
            dataset="shapes",
            pipeline="val",
            batch_size=20,
            return_ids=True,
            params={"size": 32},
            seed=11,
        ) as loader:
            assert (loader.rank, loader.world_size) == (rank, world)
            ids = [int(i) for _, _, batch_ids in loader for i in batch_ids]
        pathlib.Path(out_dir, f"rank{rank}").write_text(" ".join(map(str, ids)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
