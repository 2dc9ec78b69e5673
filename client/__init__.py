"""batchwire's client: stream preprocessed batches from batchwire servers into PyTorch.

    from batchwire.client import RemoteLoader, BatchwireError

    with RemoteLoader("gpu-host:50051", dataset="imagenet", pipeline="train",
                      batch_size=256, device="cuda") as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for images, labels in loader:
                ...

This package needs grpcio, protobuf, numpy and torch only: no DALI, LMDB or uvloop.
"""

from __future__ import annotations

from batchwire.client._exceptions import (
    AuthenticationError,
    BatchwireError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from batchwire.client._loader import RemoteLoader

__all__ = [
    "AuthenticationError",
    "BatchwireError",
    "InvalidArgumentError",
    "NotFoundError",
    "RemoteLoader",
    "ResourceExhaustedError",
    "UnavailableError",
]
