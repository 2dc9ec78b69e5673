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

from typing import TYPE_CHECKING, Any

from batchwire.client._mixture import Mixture
from batchwire.client._transport import (
    AuthenticationError,
    BadImagesError,
    BatchwireError,
    ChannelSecurity,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    StatusCode,
    UnavailableError,
    check_health,
    list_datasets,
)
from batchwire.common import __version__

if TYPE_CHECKING:
    from batchwire.client._delivery import LoaderOptions
    from batchwire.client._loader import RemoteLoader
    from batchwire.client._preprocessor import ImageError, Preprocessed, Preprocessor

__all__ = [
    "AuthenticationError",
    "BadImagesError",
    "BatchwireError",
    "ChannelSecurity",
    "ImageError",
    "InvalidArgumentError",
    "LoaderOptions",
    "Mixture",
    "NotFoundError",
    "Preprocessed",
    "Preprocessor",
    "RemoteLoader",
    "ResourceExhaustedError",
    "StatusCode",
    "UnavailableError",
    "__version__",
    "check_health",
    "list_datasets",
]


def __getattr__(name: str) -> Any:
    # RemoteLoader (and torch, ~1.5 s to import) loads on first use, so
    # `batchwire health`, which needs only the channel and credentials, stays a
    # fast probe.
    if name == "RemoteLoader":
        from batchwire.client._loader import RemoteLoader

        return RemoteLoader
    if name == "LoaderOptions":
        from batchwire.client._delivery import LoaderOptions

        return LoaderOptions
    if name in ("ImageError", "Preprocessed", "Preprocessor"):
        from batchwire.client import _preprocessor

        return getattr(_preprocessor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
