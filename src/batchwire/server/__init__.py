"""batchwire's server: DALI pipelines over LMDB datasets, streamed over gRPC.

Needs the ``server`` extra (``pip install "batchwire[server]"``): DALI, LMDB, uvloop.

    from batchwire.server import BatchwireServer, ServerConfig

    server = BatchwireServer(ServerConfig(data_dir="/data", port=0))
    server.start()
    server.wait_serving(timeout=60)
    ...
    server.stop(grace=10)

Its parts, by role:

- :mod:`batchwire.server.config`: the settings and the config file (no DALI, LMDB or grpc);
- :mod:`batchwire.server.data`: datasets on disk, ingest (no grpc, no server);
- :mod:`batchwire.server.pipelines`: what a named pipeline is, and the presets (no grpc);
- :mod:`batchwire.server.runners`: pipelines built and run, batch by batch (no grpc);
- :mod:`batchwire.server.scheduling`: the runners shared among the streams, fairly (no grpc);
- :mod:`batchwire.server.engine`: the engine: streams, preprocessing, the datasets it serves,
  the host's CPUs and GPUs (no grpc);
- :mod:`batchwire.server.errors`: what the parts raise, which serving maps to status codes;
- :mod:`batchwire.server.serving`: the gRPC server, its security and metrics;
- :mod:`batchwire.server.workers`: ``--workers N``, N server processes behind one port.

A package is used through what its ``__init__`` exports, never through another package's
private modules (tests/test_layout.py holds it).

``BatchwireServer`` loads on first use, so importing the data or engine parts never loads
grpc; the settings (``ServerConfig``, ``settings``) and ``ServerError`` load without DALI
or LMDB, so a thin client's ``batchwire`` command line builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchwire.common import __version__
from batchwire.server.config import (
    ConfigError,
    ServerConfig,
    Setting,
    boolean,
    device_ids,
    load_file,
    pipelines_from_config,
    resolve,
    settings,
)
from batchwire.server.errors import ServerError

if TYPE_CHECKING:
    from batchwire.server.serving import BatchwireServer

__all__ = [
    "BatchwireServer",
    "ConfigError",
    "ServerConfig",
    "ServerError",
    "Setting",
    "__version__",
    "boolean",
    "device_ids",
    "load_file",
    "pipelines_from_config",
    "resolve",
    "settings",
]


def __getattr__(name: str) -> Any:
    if name == "BatchwireServer":
        from batchwire.server.serving import BatchwireServer

        return BatchwireServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
