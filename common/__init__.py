"""What client and server share: the order/sharding contract, stream parameters and the
tensor wire format.

Pure NumPy and protobuf: no grpc, no DALI, no torch.
"""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("batchwire")
except importlib.metadata.PackageNotFoundError:  # run from a tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
