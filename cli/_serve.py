"""``batchwire serve --data-dir DIR [--config FILE] [--port N]``: run the data server.

Settings come from flags, then ``BATCHWIRE_*`` environment variables, then the
config file, then defaults. SIGTERM or SIGINT drains the server: health goes
NOT_SERVING, new streams are refused, in-flight streams get ``--grace``
seconds, and the process exits.

Security: ``--tls-cert``/``--tls-key`` serve TLS, ``--tls-client-ca`` requires
client certificates signed by that CA, ``--token-file`` requires a bearer token,
and ``--health-open`` leaves the health service open to probes without one.
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
from collections.abc import Callable
from typing import Any

__all__ = ["add_parser", "run"]

log = logging.getLogger("batchwire.serve")


def device_ids(text: str) -> tuple[int, ...]:
    """``--devices``: GPU ids as ``0,1,...``; ``all`` (or nothing) is every visible GPU."""
    value = text.strip().lower()
    if value in ("", "all"):
        return ()
    try:
        ids = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"not a list of GPU ids: {text!r} (use comma-separated numbers like 0,1 or 'all')"
        ) from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"GPU ids must be distinct numbers >= 0, got {text!r}")
    return ids


def _device_ids_flag(text: str) -> tuple[int, ...]:
    try:
        return device_ids(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def boolean(text: str) -> bool:
    """An environment variable's truth value: 1/true/yes/on or 0/false/no/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


# flag name -> (environment variable, parser)
_SETTINGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "data_dir": ("BATCHWIRE_DATA_DIR", pathlib.Path),
    "host": ("BATCHWIRE_HOST", str),
    "port": ("BATCHWIRE_PORT", int),
    "device": ("BATCHWIRE_DEVICE", str),
    "num_threads": ("BATCHWIRE_NUM_THREADS", int),
    "prefetch": ("BATCHWIRE_PREFETCH", int),
    "read_workers": ("BATCHWIRE_READ_WORKERS", int),
    "max_batch_size": ("BATCHWIRE_MAX_BATCH_SIZE", int),
    "max_streams": ("BATCHWIRE_MAX_STREAMS", int),
    "devices": ("BATCHWIRE_DEVICES", device_ids),
    "metrics_port": ("BATCHWIRE_METRICS_PORT", int),
    "tls_cert": ("BATCHWIRE_TLS_CERT", pathlib.Path),
    "tls_key": ("BATCHWIRE_TLS_KEY", pathlib.Path),
    "tls_client_ca": ("BATCHWIRE_TLS_CLIENT_CA", pathlib.Path),
    "token_file": ("BATCHWIRE_TOKEN_FILE", pathlib.Path),
    "health_open": ("BATCHWIRE_HEALTH_OPEN", boolean),
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
        "--devices",
        type=_device_ids_flag,
        metavar="IDS",
        help="GPU ids to run pipelines on, e.g. 0,1; new streams are spread over them "
        "(default all: every visible GPU) [BATCHWIRE_DEVICES]",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off; 0: any free) "
        "[BATCHWIRE_METRICS_PORT]",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        help="DALI threads per pipeline (default: cores) [BATCHWIRE_NUM_THREADS]",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        help="batches each pipeline computes ahead (default 2) [BATCHWIRE_PREFETCH]",
    )
    parser.add_argument(
        "--read-workers",
        type=int,
        help="processes per stream that read records through DALI's parallel external_source "
        "(default 0: read in the pipeline's feeding thread) [BATCHWIRE_READ_WORKERS]",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        help="largest batch a client may ask for (default 1024) [BATCHWIRE_MAX_BATCH_SIZE]",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        help="concurrent streams before RESOURCE_EXHAUSTED (default 64) [BATCHWIRE_MAX_STREAMS]",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=float(os.environ.get("BATCHWIRE_GRACE", 30)),
        help="seconds in-flight streams get on shutdown (default 30) [BATCHWIRE_GRACE]",
    )
    security = parser.add_argument_group("security")
    security.add_argument(
        "--tls-cert",
        type=pathlib.Path,
        metavar="FILE",
        help="PEM certificate chain: serve TLS (needs --tls-key) [BATCHWIRE_TLS_CERT]",
    )
    security.add_argument(
        "--tls-key",
        type=pathlib.Path,
        metavar="FILE",
        help="PEM private key of --tls-cert, unencrypted [BATCHWIRE_TLS_KEY]",
    )
    security.add_argument(
        "--tls-client-ca",
        type=pathlib.Path,
        metavar="FILE",
        help="mutual TLS: require client certificates signed by this PEM CA "
        "[BATCHWIRE_TLS_CLIENT_CA]",
    )
    security.add_argument(
        "--token-file",
        type=pathlib.Path,
        metavar="FILE",
        help="require 'authorization: Bearer <token>' with a token from FILE (one per line, "
        "# comments) [BATCHWIRE_TOKEN_FILE]",
    )
    security.add_argument(
        "--health-open",
        action="store_true",
        default=None,
        help="with --token-file: the grpc.health.v1.Health service needs no token (for probes) "
        "[BATCHWIRE_HEALTH_OPEN=1]",
    )
    parser.set_defaults(func=run)
    return parser


def resolve_config(args: argparse.Namespace, environ: dict[str, str]) -> Any:
    """Flags > environment > config file > defaults, as a ServerConfig."""
    from batchwire.server import ConfigError, ServerConfig, load_file, pipelines_from_config

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
                    f"{variable}={environ[variable]!r} is not a valid "
                    f"{getattr(kind, '__name__', 'value')} ({exc})"
                ) from exc
    if "data_dir" not in values:
        raise ConfigError("no data directory: pass --data-dir DIR (or set BATCHWIRE_DATA_DIR)")
    if "devices" in values:
        values["devices"] = tuple(values["devices"])
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(
        pipelines=pipelines_from_config(
            # A custom pipeline's "file.py:function" is relative to the config file.
            file.get("pipelines"),
            base_dir=pathlib.Path(config_path).parent if config_path else None,
        ),
        **{k: v for k, v in values.items() if k in known},
    )


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
    while not stop.wait(1.0):
        if server.join(timeout=0):
            log.error("the server stopped unexpectedly")
            return 1
    log.info("%s received: draining for up to %.0fs", received[0], args.grace)
    server.stop(grace=args.grace)
    return 0
