"""batchwire's server: DALI pipelines over LMDB datasets, streamed over gRPC.

Needs the ``server`` extra (``pip install "batchwire[server]"``): DALI, LMDB, uvloop.

    from batchwire.server import BatchwireServer, ServerConfig

    server = BatchwireServer(ServerConfig(data_dir="/data", port=0))
    server.start()
    server.wait_serving(timeout=60)
    ...
    server.stop(grace=10)
"""

from __future__ import annotations

from batchwire.server._config import ConfigError, ServerConfig
from batchwire.server._server import BatchwireServer, ServerError

__all__ = ["BatchwireServer", "ConfigError", "ServerConfig", "ServerError"]
