"""What client and server share: the order/sharding contract, stream parameters, the
tensor wire format and the names of the shared-memory files.

Pure NumPy and protobuf: no grpc, no DALI, no torch.
"""

from __future__ import annotations

from batchwire import __version__

__all__ = ["__version__"]
