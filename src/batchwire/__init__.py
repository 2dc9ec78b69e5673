"""batchwire: remote DALI data loading for deep-learning training.

A server (:mod:`batchwire.server`, the ``server`` extra) runs DALI pipelines over LMDB
datasets and streams the batches over gRPC; a trainer iterates
:class:`batchwire.client.RemoteLoader`. Its packages:

- :mod:`batchwire.client`: the loader, the ``Preprocessor``, health checks, exceptions;
- :mod:`batchwire.common`: what client and server share (order, stream parameters, formats);
- :mod:`batchwire.server`: the data server and its settings;
- :mod:`batchwire.cli`: the ``batchwire`` command;
- :mod:`batchwire.v1`: the protocol's generated protobuf and gRPC modules.

Importing ``batchwire`` loads none of them.
"""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("batchwire")
except importlib.metadata.PackageNotFoundError:  # run from a tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
