"""A plain DDP loop over RemoteLoader, one process per rank under torchrun, that
checkpoints rank 0's loader state and resumes from it on however many ranks it runs on.

    python -m torch.distributed.run --standalone --nproc-per-node=2 elastic_job.py \
        --target localhost:PORT --out DIR --batch-size 16 --seed 7 \
        --checkpoint-every 5 --kill-at-step 7
    python -m torch.distributed.run --standalone --nproc-per-node=3 elastic_job.py \
        --target localhost:PORT --out DIR --batch-size 16 --seed 7 \
        --records resumed --resume DIR/checkpoint.pt

Each step all-reduces the batch's size (the collective a DDP step is), so the ranks move in
lockstep. Every rank records the ids of each batch (recording.py); ``step`` is the global
step before the batch, counted on from the checkpoint's.
"""

from __future__ import annotations

import argparse
import os
import pathlib

import torch
import torch.distributed as dist
from recording import Recorder, die_together

from batchwire.client import RemoteLoader


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True, help="the server, host:port")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="records, checkpoint")
    parser.add_argument("--records", default="first", help="names this run's records")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: never")
    parser.add_argument("--kill-at-step", type=int, default=0, help="global step; 0: never")
    parser.add_argument("--resume", type=pathlib.Path, help="a checkpoint to resume from")
    return parser.parse_args()


def save(path: pathlib.Path, step: int, loader: RemoteLoader) -> None:
    """Rank 0's checkpoint, written whole or not at all."""
    partial = path.with_suffix(".partial")
    torch.save({"step": step, "loader": loader.state_dict()}, partial)
    os.replace(partial, path)


def main() -> None:
    args = parse_args()
    recorder = Recorder(args.out, args.records)
    dist.init_process_group("gloo")
    loader = RemoteLoader(
        args.target,
        dataset="shapes",
        pipeline="val",
        batch_size=args.batch_size,
        seed=args.seed,
        drop_last=False,
        params={"size": 32},
        return_ids=True,
    )
    step = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        step = checkpoint["step"]
        loader.load_state_dict(checkpoint["loader"])
    loader.set_epoch(0)  # keeps a loaded position in epoch 0
    for _, _, ids in loader:
        recorder.batch("train", 0, step, ids)
        dist.all_reduce(torch.tensor([len(ids)]))
        step += 1
        if args.checkpoint_every and step % args.checkpoint_every == 0 and dist.get_rank() == 0:
            save(args.out / "checkpoint.pt", step, loader)
        dist.barrier()  # the checkpoint is on disk before any rank goes on
        if step == args.kill_at_step:
            die_together(recorder, epoch=0, step=step)
    recorder.event("finished", epoch=0, step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
