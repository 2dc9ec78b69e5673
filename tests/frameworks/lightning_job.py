"""A Lightning DDP job over RemoteLoader, one process per rank under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node=2 lightning_job.py \
        --target localhost:PORT --out DIR --batch-size 16 --seed 7 [--wrap stateful --workers 2]

The loaders are made in the DataModule's ``__init__``, before Lightning initializes
torch.distributed. ``train_dataloader``/``val_dataloader`` return them as they are
(``--wrap none``) or wrapped in a torch ``DataLoader`` or torchdata ``StatefulDataLoader``
with ``--workers`` workers. Every rank records the ids of each batch it trains or validates
on (recording.py); ``--checkpoint-every`` and ``--kill-at-step`` make the run that a second
one (``--resume CHECKPOINT``) continues, on as many devices as torchrun starts processes
(``--elastic-batch-size``: with another batch size too).
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torch.utils.data
from lightning.pytorch.callbacks import ModelCheckpoint
from recording import Recorder, die_together
from torchdata.stateful_dataloader import StatefulDataLoader

from batchwire.cli._datasets import batched, dataset_or_mixture
from batchwire.client import RemoteLoader
from batchwire.common.batchings import BATCHINGS


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True, help="the server, host:port")
    parser.add_argument(
        "--dataset",
        type=dataset_or_mixture,
        default="shapes",
        help="a dataset, or a mixture NAME=WEIGHT,NAME=WEIGHT (default shapes)",
    )
    parser.add_argument("--batching", choices=BATCHINGS, default="random", help="a mixture's")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="records, checkpoints")
    parser.add_argument("--records", default="first", help="names this run's records")
    parser.add_argument("--wrap", choices=("none", "dataloader", "stateful"), default="none")
    parser.add_argument("--workers", type=int, default=0, help="num_workers of --wrap")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="train steps; 0: none")
    parser.add_argument("--kill-at-step", type=int, default=0, help="global step; 0: never")
    parser.add_argument("--resume", type=pathlib.Path, help="a checkpoint to fit from")
    parser.add_argument("--elastic-batch-size", action="store_true", help="see RemoteLoader")
    parser.add_argument(
        "--train-pipeline",
        choices=("train", "multicrop"),
        default="train",
        help="multicrop: the training steps get DINO's views (a list of tensors)",
    )
    return parser.parse_args()


class RemoteData(pl.LightningDataModule):
    """Train (shuffled) and val (in id order) loaders over the test's ``shapes`` dataset
    (or ``--dataset``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        common: dict[str, Any] = {
            "dataset": batched(args.dataset, args.batching),
            "batch_size": args.batch_size,
            "seed": args.seed,
            "params": {"size": 32},
            "return_ids": True,
        }
        # Made here, before torch.distributed exists: rank and world size must still come
        # from it when iteration starts.
        views = {"params": {"global_size": 32, "local_size": 16}}
        self.train = RemoteLoader(
            args.target,
            pipeline=args.train_pipeline,
            shuffle=True,
            drop_last=True,  # full batches to train on; validation sees every sample
            elastic_batch_size=args.elastic_batch_size,
            **{**common, **(views if args.train_pipeline == "multicrop" else {})},
        )
        self.val = RemoteLoader(args.target, pipeline="val", shuffle=False, **common)
        self.wrap = args.wrap
        self.workers = args.workers

    def _wrapped(self, loader: RemoteLoader) -> Any:
        if self.wrap == "dataloader":
            return torch.utils.data.DataLoader(loader, batch_size=None, num_workers=self.workers)
        if self.wrap == "stateful":
            return StatefulDataLoader(loader, batch_size=None, num_workers=self.workers)
        return loader

    def train_dataloader(self) -> Any:
        return self._wrapped(self.train)

    def val_dataloader(self) -> Any:
        return self._wrapped(self.val)


class Probe(pl.LightningModule):
    """One weight on the mean pixel: enough for DDP to all-reduce gradients every step."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.head = torch.nn.Linear(1, 1)
        self.recorder = recorder

    def _loss(self, batch: Any) -> torch.Tensor:
        images, labels, _ = batch
        if isinstance(images, list):  # multicrop's views: a feature of each, averaged
            images = torch.stack([view.flatten(1).float().mean(1) for view in images], 1)
        features = images.flatten(1).float().mean(1, keepdim=True)
        return F.mse_loss(self.head(features).squeeze(1), labels.float())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.recorder.batch("train", self.current_epoch, self.global_step, batch[2])
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        kind = "sanity" if self.trainer.sanity_checking else "val"
        self.recorder.batch(kind, self.current_epoch, self.global_step, batch[2])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class KillAtStep(pl.Callback):
    """Both ranks die after the batch that makes ``global_step`` reach ``step``.

    Callbacks run before ModelCheckpoint, so a checkpoint due at this very step is not
    written: pick a step that is not a multiple of ``every_n_train_steps``."""

    def __init__(self, step: int, recorder: Recorder) -> None:
        self.step = step
        self.recorder = recorder

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step == self.step:
            die_together(self.recorder, epoch=trainer.current_epoch, step=trainer.global_step)


def main() -> None:
    args = parse_args()
    recorder = Recorder(args.out, args.records)
    data = RemoteData(args)
    callbacks: list[pl.Callback] = []
    if args.checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.out / "checkpoints",
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
            )
        )
    if args.kill_at_step:
        callbacks.append(KillAtStep(args.kill_at_step, recorder))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),  # torchrun's --nproc-per-node
        strategy="ddp",
        max_epochs=args.epochs,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.checkpoint_every),
        callbacks=callbacks,
        default_root_dir=args.out / "lightning",
    )
    trainer.fit(Probe(recorder), datamodule=data, ckpt_path=args.resume)
    recorder.event("finished", epoch=trainer.current_epoch, step=trainer.global_step)


if __name__ == "__main__":
    main()
