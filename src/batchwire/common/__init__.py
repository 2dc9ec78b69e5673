"""What client and server share: the order/sharding contract, stream parameters and the
tensor wire format.

Pure NumPy and protobuf: no grpc, no DALI, no torch.
"""

from __future__ import annotations

from batchwire import __version__

__all__ = ["__version__"]
