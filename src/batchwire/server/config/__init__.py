"""The server's settings: ``ServerConfig`` (every setting declared once, with its flag,
environment variable and config-file key), and the config file (``[server]`` and
``[pipelines]`` tables) merged with them. Loads neither DALI nor LMDB, nor grpc, so that a
thin client's command line builds its flags from it.
"""

from __future__ import annotations

from batchwire.server.config._file import load_file, pipelines_from_config, resolve
from batchwire.server.config._settings import (
    ConfigError,
    ServerConfig,
    Setting,
    boolean,
    device_ids,
    settings,
)

__all__ = [
    "ConfigError",
    "ServerConfig",
    "Setting",
    "boolean",
    "device_ids",
    "load_file",
    "pipelines_from_config",
    "resolve",
    "settings",
]
