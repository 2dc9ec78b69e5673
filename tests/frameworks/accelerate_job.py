"""An accelerate job over RemoteLoader, one process per rank under torchrun.

``--mode recipe`` follows the supported recipe: the loader is made after ``Accelerator()``
on ``accelerator.device``, registered with ``register_for_checkpointing`` and iterated
directly (never prepared). ``--save-after N`` saves the state after N batches of epoch
``--save-epoch``, ``--kill-after M`` ends both ranks after M batches of it, and a second run
with ``--resume`` loads the state and trains to the end.

``--mode prepare`` hands the loader to ``accelerator.prepare(DataLoader(loader,
batch_size=None))`` with accelerate's defaults and iterates it; each rank records what was
raised (the ``error`` event), or how many batches it got (``finished``).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.data
from accelerate import Accelerator
from recording import Recorder, die_together

from batchwire.cli._datasets import dataset_or_mixture
from batchwire.client import RemoteLoader

# A rank that raised waits this long for the other rank to raise too, so torchrun (which
# stops the others as soon as one rank exits) cannot cut the other rank's record short.
PEER_WAIT = datetime.timedelta(seconds=30)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True, help="the server, host:port")
    parser.add_argument(
        "--dataset",
        type=dataset_or_mixture,
        default="shapes",
        help="a dataset, or a mixture NAME=WEIGHT,NAME=WEIGHT (default shapes)",
    )
    parser.add_argument("--out", required=True, type=pathlib.Path, help="records, state")
    parser.add_argument("--records", default="first", help="names this run's records")
    parser.add_argument("--mode", choices=("recipe", "prepare"), default="recipe")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-epoch", type=int, default=1)
    parser.add_argument("--save-after", type=int, default=0, help="batches; 0: never")
    parser.add_argument("--kill-after", type=int, default=0, help="batches; 0: never")
    parser.add_argument("--resume", action="store_true", help="load the saved state first")
    return parser.parse_args()


class Progress:
    """The training loop's own position, checkpointed next to the loader's."""

    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0  # trained in ``epoch``

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]
        self.batches = state["batches"]


def make_loader(args: argparse.Namespace, accelerator: Accelerator) -> RemoteLoader:
    return RemoteLoader(
        args.target,
        dataset=args.dataset,
        pipeline="train",
        batch_size=args.batch_size,
        drop_last=True,  # full batches to train on
        seed=args.seed,
        params={"size": 32},
        return_ids=True,
        device=accelerator.device,
    )


def recipe(args: argparse.Namespace, recorder: Recorder) -> None:
    accelerator = Accelerator(cpu=True)
    loader = make_loader(args, accelerator)
    progress = Progress()
    accelerator.register_for_checkpointing(loader, progress)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    state_dir = args.out / "state"
    resumed_epoch = -1
    if args.resume:
        accelerator.load_state(str(state_dir))
        resumed_epoch = progress.epoch
    for epoch in range(progress.epoch, args.epochs):
        if epoch != resumed_epoch:
            loader.set_epoch(epoch)  # a resumed epoch continues from the loaded state instead
        for images, labels, ids in loader:
            recorder.batch("train", epoch, progress.batches, ids)
            features = images.flatten(1).float().mean(1, keepdim=True)
            loss = F.mse_loss(model(features).squeeze(1), labels.float())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.batches += 1
            if epoch == args.save_epoch and progress.batches == args.save_after:
                accelerator.save_state(str(state_dir))
                accelerator.wait_for_everyone()  # rank 0 has written it all
            if epoch == args.save_epoch and progress.batches == args.kill_after:
                die_together(recorder, epoch=epoch, batches=progress.batches)
        progress.epoch, progress.batches = epoch + 1, 0
    loader.close()
    # The DDP model and its last collectives are freed while Python runs, then the group:
    # left to the interpreter's exit, a gloo thread that frees a collective then aborts the
    # process ("terminate called without an active exception", pytorch/pytorch#190489).
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()
    recorder.event("finished", epoch=progress.epoch)


def prepare(args: argparse.Namespace, recorder: Recorder) -> None:
    accelerator = Accelerator(cpu=True)
    loader = make_loader(args, accelerator)
    batches = 0
    try:
        data: Any = accelerator.prepare(torch.utils.data.DataLoader(loader, batch_size=None))
        for _, _, ids in data:
            recorder.batch("train", 0, batches, ids)
            batches += 1
    except Exception as error:
        recorder.event("error", type=type(error).__name__, message=str(error), batches=batches)
        dist.monitored_barrier(timeout=PEER_WAIT)
        raise
    accelerator.end_training()
    recorder.event("finished", batches=batches)


def main() -> None:
    args = parse_args()
    recorder = Recorder(args.out, args.records)
    if args.mode == "recipe":
        recipe(args, recorder)
    else:
        prepare(args, recorder)


if __name__ == "__main__":
    main()
