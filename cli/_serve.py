"""``batchwire serve --data-dir DIR [--config FILE] [--port N]``: run the data server.

Settings come from flags, then ``BATCHWIRE_*`` environment variables, then the
config file, then defaults. SIGTERM or SIGINT drains the server: health goes
NOT_SERVING, new streams are refused, in-flight streams get ``--grace``
seconds, and the process exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Any

__all__ = ["add_parser", "run"]

log = logging.getLogger("batchwire.serve")

# flag name -> (environment variable, type)
_SETTINGS: dict[str, tuple[str, type]] = {
    "data_dir": ("BATCHWIRE_DATA_DIR", pathlib.Path),
    "host": ("BATCHWIRE_HOST", str),
    "port": ("BATCHWIRE_PORT", int),
    "device": ("BATCHWIRE_DEVICE", str),
    "num_threads": ("BATCHWIRE_NUM_THREADS", int),
    "prefetch": ("BATCHWIRE_PREFETCH", int),
    "max_batch_size": ("BATCHWIRE_MAX_BATCH_SIZE", int),
    "max_streams": ("BATCHWIRE_MAX_STREAMS", int),
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve every dataset under a directory over gRPC",
        description="Serve every dataset directory under --data-dir by its name.",
    )
    parser.add_argument(
        "--data-dir", type=pathlib.Path, help="datasets live in DIR/NAME/ [BATCHWIRE_DATA_DIR]"
    )
    parser.add_argument(
        "--config", type=pathlib.Path, help="TOML or YAML config file [BATCHWIRE_CONFIG]"
    )
    parser.add_argument("--host", help="address to listen on (default [::], all) [BATCHWIRE_HOST]")
    parser.add_argument(
        "--port", type=int, help="gRPC port (default 50051; 0: any free) [BATCHWIRE_PORT]"
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "gpu"],
        help="where pipelines run (default auto) [BATCHWIRE_DEVICE]",
    )
    parser.add_argument(
        "--num-threads", type=int, help="DALI threads per pipeline (default: cores)"
    )
    parser.add_argument(
        "--prefetch", type=int, help="batches each pipeline computes ahead (default 2)"
    )
    parser.add_argument(
        "--max-batch-size", type=int, help="largest batch a client may ask for (default 1024)"
    )
    parser.add_argument(
        "--max-streams", type=int, help="concurrent streams before RESOURCE_EXHAUSTED (default 64)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=float(os.environ.get("BATCHWIRE_GRACE", 30)),
        help="seconds in-flight streams get on shutdown (default 30) [BATCHWIRE_GRACE]",
    )
    parser.set_defaults(func=run)
    return parser


def resolve_config(args: argparse.Namespace, environ: dict[str, str]) -> Any:
    """Flags > environment > config file > defaults, as a ServerConfig."""
    from batchwire.server._config import ConfigError, ServerConfig, load_file, pipelines_from_config

    config_path = args.config or environ.get("BATCHWIRE_CONFIG")
    file = load_file(config_path) if config_path else {}
    values: dict[str, Any] = dict(file.get("server", {}))
    for name, (variable, kind) in _SETTINGS.items():
        flag = getattr(args, name, None)
        if flag is not None:
            values[name] = flag
        elif variable in environ:
            try:
                values[name] = kind(environ[variable])
            except ValueError as exc:
                raise ConfigError(
                    f"{variable}={environ[variable]!r} is not a valid {kind.__name__}"
                ) from exc
    if "data_dir" not in values:
        raise ConfigError("no data directory: pass --data-dir DIR (or set BATCHWIRE_DATA_DIR)")
    if "devices" in values:
        values["devices"] = tuple(values["devices"])
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(
        pipelines=pipelines_from_config(file.get("pipelines")),
        **{k: v for k, v in values.items() if k in known},
    )


def run(args: argparse.Namespace) -> int:
    from batchwire.server import BatchwireServer, ConfigError, ServerError
    from batchwire.server._dataset import DatasetError
    from batchwire.server._devices import DeviceError

    try:
        config = resolve_config(args, dict(os.environ))
        server = BatchwireServer(config)
        server.start()
    except (ConfigError, ServerError, DatasetError, DeviceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"batchwire serving {config.data_dir} on {config.host}:{server.port}", flush=True)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    while not stop.wait(1.0):
        if server.join(timeout=0):
            log.error("the server stopped unexpectedly")
            return 1
    log.info("%s received: draining for up to %.0fs", received[0], args.grace)
    server.stop(grace=args.grace)
    return 0
