"""What a loader learns from the framework driving it: the rank and world size from
``torch.distributed``, whether it runs in a DataLoader worker, and accelerate's wrappers
that would silently train on part of the data."""

from __future__ import annotations

import sys
import types
from typing import Any

import torch.distributed
import torch.utils.data

from batchwire.client._transport import InvalidArgumentError

__all__ = ["distributed_rank_world", "refuse_accelerate_wrappers", "worker_id"]

_FRAMES = 12  # how far up the stack accelerate's wrapper can be from set_epoch / iteration


def distributed_rank_world(group: Any = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` in ``group`` (default: the world) if torch.distributed is
    initialized in this process, else None."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(group), dist.get_world_size(group)


def worker_id() -> int | None:
    """This DataLoader worker's id, or None outside DataLoader workers."""
    info = torch.utils.data.get_worker_info()
    return None if info is None else int(info.id)


def _refusal(wrapper: str) -> InvalidArgumentError:
    if wrapper == "DataLoaderDispatcher":
        what = (
            "accelerate's prepare() wrapped this RemoteLoader in DataLoaderDispatcher, which "
            "iterates it on rank 0 only and splits rank 0's batches across the ranks: the "
            "other ranks' shares would never be trained on."
        )
    else:
        what = (
            "accelerate's prepare() wrapped this RemoteLoader in IterableDatasetShard, which "
            "expects one sample at a time and cuts the stream again by rank."
        )
    return InvalidArgumentError(
        f"{what} RemoteLoader already gives each rank its own share: do not pass it (or a "
        "DataLoader over it) to accelerator.prepare(). Iterate it directly, built with "
        "device=accelerator.device, and call accelerator.register_for_checkpointing(loader) "
        "so that save_state()/load_state() resume it (README: Training frameworks)."
    )


def refuse_accelerate_wrappers() -> None:
    """Raise if one of accelerate's multi-process data wrappers is driving this call.

    Both call the dataset's ``set_epoch`` on every rank before iterating, so the
    refusal reaches every rank at once instead of leaving the others waiting.
    """
    module = sys.modules.get("accelerate.data_loader")
    if module is None:
        return
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            return
        # Only accelerate's own frames are looked into: reading a frame's f_locals leaves
        # a snapshot of its variables on it (before Python 3.13), which would keep the
        # caller's iterator, and the pass it streams, alive after the caller let it go.
        if frame.f_globals.get("__name__") == module.__name__:
            owner = frame.f_locals.get("self")
            for name in ("DataLoaderDispatcher", "IterableDatasetShard"):
                wrapper = getattr(module, name, None)
                if wrapper is not None and isinstance(owner, wrapper) and _processes(owner) > 1:
                    raise _refusal(name)
        frame = frame.f_back


def _processes(wrapper: Any) -> int:
    state = getattr(wrapper, "state", None)  # DataLoaderDispatcher
    return int(getattr(state, "num_processes", getattr(wrapper, "num_processes", 1)))
