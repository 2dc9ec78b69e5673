"""How a loader delivers what it streams: its options, and received batches as tensors."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from batchwire.client._normalize import channel_stats
from batchwire.client._reader import Delivery
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["LoaderOptions", "Tensors"]

_TORCH_DTYPES = {
    np.dtype("u1"): torch.uint8,
    np.dtype("<f2"): torch.float16,
    np.dtype("<f4"): torch.float32,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """How a loader delivers what it streams (see :class:`RemoteLoader`)."""

    device: torch.device
    normalize: bool = True
    return_ids: bool = False
    prefetch: int = 2
    timeout: float = 300.0
    retry_timeout: float = 60.0
    resolve_every: float = 5.0

    def __post_init__(self) -> None:
        checks = (
            (self.prefetch >= 1, f"prefetch must be at least 1, got {self.prefetch}"),
            (self.retry_timeout >= 0, f"retry_timeout must be >= 0, got {self.retry_timeout}"),
            (self.resolve_every > 0, f"resolve_every must be positive, got {self.resolve_every}"),
            (self.timeout > 0, f"timeout must be positive, got {self.timeout}"),
            (
                self.device.type != "cuda" or torch.cuda.is_available(),
                f"device={str(self.device)!r} but torch sees no CUDA device; use device='cpu'",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class Tensors:
    """A pass's batches as the tensors the loop yields, normalized with the pipeline's
    mean and std (``info``) unless they come normalized or ``normalize`` is off."""

    def __init__(self, options: LoaderOptions, info: pb.PipelineInfo, layout: str) -> None:
        self.options = options
        self.mean, self.std = channel_stats(info.mean, info.std, layout, options.device)

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[object, np.ndarray]:
        """Where a batch's images are assembled, so that the one copy from the received
        bytes is also the last: pinned memory (torch's caching host allocator) when
        bound for a GPU; otherwise NumPy memory, which NumPy backs with huge pages:
        a fresh torch.empty of a batch costs page faults worth several times the copy."""
        if self.options.device.type == "cuda":
            tensor = torch.empty(shape, dtype=_TORCH_DTYPES[dtype], pin_memory=True)
            return tensor, tensor.numpy()
        array = np.empty(shape, dtype)
        return torch.from_numpy(array), array

    def convert(self, d: Delivery) -> Delivery:
        """Runs in the reader thread: labels to tensors, CPU images normalized early."""
        cuda, normalize = self.options.device.type == "cuda", self.options.normalize
        images: torch.Tensor = d.images  # type: ignore[assignment]
        labels = torch.from_numpy(d.labels)
        if cuda:
            labels = labels.pin_memory()
        elif normalize and not d.normalized:
            images = self._normalize(images)
        normalized = d.normalized or (normalize and not cuda)
        return dataclasses.replace(d, images=images, labels=labels, normalized=normalized)

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        """float32, less the mean, over the std; an empty batch (every sample skipped) only
        becomes float32, whatever its shape."""
        if not images.numel():
            return images.float()
        return images.float().sub_(self.mean).div_(self.std)

    def output(self, d: Delivery) -> tuple[torch.Tensor, ...]:
        """What the loop yields for a delivery: on the loader's device, normalized."""
        images: torch.Tensor = d.images  # type: ignore[assignment]
        labels: torch.Tensor = d.labels  # type: ignore[assignment]
        if self.options.device.type == "cuda":
            images = images.to(self.options.device, non_blocking=True)
            labels = labels.to(self.options.device, non_blocking=True)
            if self.options.normalize and not d.normalized:
                images = self._normalize(images)
        labels = labels.reshape(-1)
        if self.options.return_ids:
            return images, labels, torch.from_numpy(np.asarray(d.ids, dtype=np.int64))
        return images, labels
