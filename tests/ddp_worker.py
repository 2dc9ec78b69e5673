"""A DDP rank for test_lifecycle, run in spawned processes: imports only the client."""

from __future__ import annotations

import json
import pathlib

import torch.distributed as dist

from batchwire.client import InvalidArgumentError, RemoteLoader


def stream_rank(rank: int, world: int, init_file: str, address: str, out_dir: str) -> None:
    """Stream one epoch with rank/world left to torch.distributed, which is initialized
    only after the loaders are built (as in a LightningModule's __init__)."""
    options = {
        "dataset": "shapes",
        "pipeline": "val",
        "batch_size": 20,
        "return_ids": True,
        "params": {"size": 32},
        "seed": 11,
    }
    loader = RemoteLoader(address, **options)  # type: ignore[arg-type]
    single = RemoteLoader(address, rank=0, world_size=1, **options)  # type: ignore[arg-type]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result: dict[str, object] = {"share": (loader.rank, loader.world_size)}
        with loader:
            result["ids"] = [int(i) for _, _, batch in loader for i in batch]
        try:
            next(iter(single))
            result["explicit"] = "streamed"
        except InvalidArgumentError as exc:
            result["explicit"] = str(exc)
        # Rank 0 alone, e.g. to evaluate on one process: a group of one streams everything.
        alone = dist.new_group([0])
        if rank == 0:
            solo = RemoteLoader(address, process_group=alone, **options)  # type: ignore[arg-type]
            result["solo"] = [int(i) for _, _, batch in solo for i in batch]
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
