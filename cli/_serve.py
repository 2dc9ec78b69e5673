"""``batchwire serve --data-dir DIR [--config FILE] [--port N]``: run the data server.

Settings come from flags, then ``BATCHWIRE_*`` environment variables, then the
config file, then defaults. SIGTERM or SIGINT drains the server: health goes
NOT_SERVING, new streams are refused, in-flight streams get ``--grace``
seconds, and the process exits. SIGHUP rescans ``--data-dir`` at once (as it is
every ``--rescan-interval`` seconds): datasets ingested, replaced or removed
since are served, or no longer, without a restart.

Security: ``--tls-cert``/``--tls-key`` serve TLS, ``--tls-client-ca`` requires
client certificates signed by that CA, ``--token-file`` requires a bearer token,
and ``--health-open`` leaves the health service open to probes without one.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

log = logging.getLogger("batchwire.serve")


HELP = "serve every dataset under a directory over gRPC"
DESCRIPTION = (
    "Serve every dataset directory under --data-dir by its name. Every "
    "setting is also an environment variable (in brackets) and a key of the config "
    "file's [server] table (its name with underscores)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from batchwire.server import boolean, settings

    parser.add_argument(
        "--config", type=pathlib.Path, help="TOML or YAML config file [BATCHWIRE_CONFIG]"
    )
    for setting in settings():
        help = f"{setting.help} [{setting.variable}]"
        if setting.parse is boolean:
            parser.add_argument(setting.flag, action="store_true", default=None, help=help)
            continue
        parser.add_argument(
            setting.flag,
            type=_flag_type(setting.parse),
            metavar=setting.metavar or ("N" if setting.parse in (int, float) else None),
            choices=setting.choices,
            help=help,
        )


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """Flags > environment > config file > defaults, as a ServerConfig."""
    from batchwire.server import resolve, settings

    flags = {s.name: getattr(args, s.name, None) for s in settings()}
    return resolve(flags, environ, args.config or environ.get("BATCHWIRE_CONFIG"))


def run(args: argparse.Namespace) -> int:
    from batchwire.server import BatchwireServer, ConfigError, ServerError
    from batchwire.server.core import DeviceError
    from batchwire.server.data import DatasetError
    from batchwire.server.serving import tune_for_large_buffers

    tune_for_large_buffers()
    try:
        config = resolve_config(args, dict(os.environ))
        server = BatchwireServer(config)
        server.start()
    except (ConfigError, ServerError, DatasetError, DeviceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    metrics = f"; metrics on port {server.metrics_port}" if server.metrics_port is not None else ""
    print(
        f"batchwire serving {config.data_dir} on {config.host}:{server.port}{metrics}", flush=True
    )
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    def on_hangup(signum: int, frame: object) -> None:
        # Only a wake-up for the server's rescan task: nothing here blocks or logs.
        server.request_rescan()

    signal.signal(signal.SIGHUP, on_hangup)
    while not stop.wait(1.0):
        if server.join(timeout=0):
            log.error("the server stopped unexpectedly")
            return 1
    log.info("%s received: draining for up to %.0fs", received[0], config.grace)
    server.stop(grace=config.grace)
    return 0
