"""batchwire's server: DALI pipelines over LMDB datasets, streamed over gRPC.

Needs the ``server`` extra (``pip install "batchwire[server]"``): DALI, LMDB, uvloop.

    from batchwire.server import BatchwireServer, ServerConfig

    server = BatchwireServer(ServerConfig(data_dir="/data", port=0))
    server.start()
    server.wait_serving(timeout=60)
    ...
    server.stop(grace=10)

Its parts, by role:

- :mod:`batchwire.server.data`: datasets on disk, ingest (no grpc, no server);
- :mod:`batchwire.server.core`: DALI pipelines, the scheduler and the engine (no grpc);
- :mod:`batchwire.server.serving`: the gRPC server, its security and metrics.

``BatchwireServer`` and ``ServerError`` load on first use, so importing the data or
core parts never loads grpc; the settings (``ServerConfig``, ``settings``) load without
DALI or LMDB, so a thin client's ``batchwire`` command line builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchwire.common import __version__
from batchwire.server._config import (
    ConfigError,
    ServerConfig,
    Setting,
    boolean,
    device_ids,
    settings,
)

if TYPE_CHECKING:
    from batchwire.server._config_file import load_file, pipelines_from_config, resolve
    from batchwire.server.serving import BatchwireServer, ServerError

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
    if name in ("load_file", "pipelines_from_config", "resolve"):
        from batchwire.server import _config_file

        return getattr(_config_file, name)
    if name in ("BatchwireServer", "ServerError"):
        from batchwire.server import serving

        return getattr(serving, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
