"""Train on every rank of a DDP job from one batchwire server: each rank its own share.

    torchrun --nproc-per-node 2 examples/ddp_train.py --address localhost:50051 --dataset pets

``RemoteLoader`` takes ``rank`` and ``world_size`` from ``torch.distributed``, so each rank
streams a disjoint share of every epoch, and all ranks get the same number of batches.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from batchwire.client import RemoteLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else "cpu"
    loader = RemoteLoader(
        args.address,
        dataset=args.dataset,
        pipeline="train",
        batch_size=args.batch_size,
        drop_last=True,
        seed=0,
        device=device,
        params={"size": 128},
    )
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=4),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, len(loader.classes)),
    ).to(device)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with loader:
        for epoch in range(args.epochs):
            samples = 0
            for images, labels in loader:  # this rank's share of the epoch
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                samples += len(labels)
            print(f"rank {rank}/{loader.world_size} epoch {epoch}: {samples} samples")
    dist.barrier()  # every rank done before the group goes
    # Free the DDP model (and its last collectives) while Python runs: left to the
    # interpreter's exit, a gloo thread can abort the process (pytorch/pytorch#190489).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
