"""What one rank of a framework job saw, for tests/test_frameworks.py to check.

Each batch is appended to ``{run}-rank{rank}.jsonl`` as it is seen (one JSON object a line:
``kind``, ``epoch``, ``step``, ``ids``), so a job that is killed keeps its record up to the
kill. Events (``finished``, ``killed``, ``error``) are small JSON files next to it.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

KILLED_EXIT = 17  # the exit status of a rank that die_together() ended


class Recorder:
    """Appends this rank's batches to ``out/{run}-rank{rank}.jsonl``; the rank is torchrun's."""

    def __init__(self, out: pathlib.Path, run: str) -> None:
        self.rank = int(os.environ["RANK"])  # set by torchrun before torch.distributed is
        self.out = out
        self.run = run
        self.path = out / f"{run}-rank{self.rank}.jsonl"

    def batch(self, kind: str, epoch: int, step: int, ids: torch.Tensor | Iterable[int]) -> None:
        line = {"kind": kind, "epoch": epoch, "step": step, "ids": [int(i) for i in ids]}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def event(self, name: str, **fields: Any) -> None:
        path = self.out / f"{self.run}-rank{self.rank}-{name}.json"
        path.write_text(json.dumps(fields))


def die_together(recorder: Recorder, **fields: Any) -> None:
    """End both ranks here, as a crash would: no cleanup, no exception handlers.

    The barrier comes after the event is written, so both ranks' ``killed`` events are on
    disk before either exits (torchrun stops the other rank as soon as one exits)."""
    recorder.event("killed", **fields)
    dist.barrier()
    os._exit(KILLED_EXIT)
