"""``batchwire serve --data-dir DIR [--config FILE] [--port N]``: run the data server.

Settings come from flags, then ``BATCHWIRE_*`` environment variables, then the
config file, then defaults. SIGTERM or SIGINT drains the server: health goes
NOT_SERVING, new streams are refused, in-flight streams get ``--grace``
seconds, and the process exits. SIGHUP rescans ``--data-dir`` at once (as it is
every ``--rescan-interval`` seconds): datasets ingested, replaced or removed
since are served, or no longer, without a restart.

``--workers N`` runs N server processes behind the port (see
``batchwire.server.workers``); the default is one per visible GPU, each on its
own GPU, and one on the CPU. This process then forwards SIGTERM and SIGINT to every
worker, and when a worker dies it stops the others and exits 1.

Security: ``--tls-cert``/``--tls-key`` serve TLS, ``--tls-client-ca`` requires
client certificates signed by that CA, ``--token-file`` requires a bearer token,
and ``--health-open`` leaves the health service open to probes without one.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from batchwire.cli import _logs
from batchwire.common.words import counted

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

log = logging.getLogger(__name__)


HELP = "serve every dataset under a directory over gRPC"
DESCRIPTION = (
    "Serve every dataset directory under --data-dir by its name. Every "
    "setting is also an environment variable (in brackets) and a key of the config "
    "file's [server] table (its name with underscores)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from batchwire.server import ServerConfig, boolean, settings

    parser.add_argument(
        "--config", type=pathlib.Path, help="TOML or YAML config file [BATCHWIRE_CONFIG]"
    )
    for setting in settings():
        # A deprecated setting is still taken (and warned about), not offered.
        help = argparse.SUPPRESS if setting.deprecated else f"{setting.help} [{setting.variable}]"
        if setting.parse is boolean:
            # A setting that is on by default is turned off with --no-NAME.
            on = getattr(ServerConfig, setting.name) is True
            action = argparse.BooleanOptionalAction if on else "store_true"
            parser.add_argument(setting.flag, action=action, default=None, help=help)
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


def _resolve_arguments(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[dict[str, Any], Mapping[str, str], Any]:
    """What ``batchwire.server.resolve`` takes: the flags given, the environment, the file."""
    from batchwire.server import settings

    flags = {s.name: getattr(args, s.name, None) for s in settings()}
    return flags, environ, args.config or environ.get("BATCHWIRE_CONFIG")


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """Flags > environment > config file > defaults, as a ServerConfig."""
    from batchwire.server import resolve

    return resolve(*_resolve_arguments(args, environ))


def _workers_text(count: int) -> str:
    return counted(count, "worker")


def _start_line(config: Any, workers: int, port: int, metrics_port: int | None) -> str:
    # Tests and `batchwire bench` read the port (and the metrics port) from it.
    metrics = f"; metrics on port {metrics_port}" if metrics_port is not None else ""
    return (
        f"batchwire serving {config.data_dir} with {_workers_text(workers)} "
        f"on {config.host}:{port}{metrics}"
    )


class _Signals:
    """SIGTERM and SIGINT, received: ``stop`` is set, ``received`` names the first.
    SIGHUP calls ``on_hangup`` (a rescan of the data directory)."""

    def __init__(self, on_hangup: Callable[[], None]) -> None:
        self.stop = threading.Event()
        self.received: list[str] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGHUP, lambda signum, frame: on_hangup())

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum).name)
        self.stop.set()


def run(args: argparse.Namespace) -> int:
    from batchwire.server import BatchwireServer, ConfigError, ServerError
    from batchwire.server.data import DatasetError
    from batchwire.server.engine import DeviceError, check_data_dir
    from batchwire.server.serving import tune_for_large_buffers
    from batchwire.server.workers import plan_workers

    tune_for_large_buffers()
    try:
        config = resolve_config(args, dict(os.environ))
        check_data_dir(config.data_dir)  # before anything starts (and logs)
        if len(plan_workers(config)) > 1:
            return _run_unit(args, config)
        server = BatchwireServer(config)
        server.start()
    except (ConfigError, ServerError, DatasetError, DeviceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_start_line(config, 1, server.port, server.metrics_port), flush=True)
    # SIGHUP is only a wake-up for the server's rescan task: nothing there blocks or logs.
    signals = _Signals(on_hangup=server.request_rescan)
    stop, received = signals.stop, signals.received
    while not stop.wait(1.0):
        if server.join(timeout=0):
            log.error("the server stopped unexpectedly")
            return 1
    log.info("%s received: draining for up to %.0fs", received[0], config.grace)
    server.stop(grace=config.grace)
    return 0


def _run_unit(args: argparse.Namespace, config: Any) -> int:
    """``--workers N`` (N > 1): the workers' parent until a signal or a worker's death."""
    from batchwire.server import resolve
    from batchwire.server.workers import WorkerUnit

    environ = dict(os.environ)
    # Each worker resolves the config itself, as this process did: a custom pipeline
    # loaded from a file cannot travel by pickle.
    source = functools.partial(resolve, *_resolve_arguments(args, environ))
    level, log_format = _logs.choose(
        getattr(args, "log_level", None),
        getattr(args, "log_format", None),
        environ,
        getattr(args, "default_log_level", "INFO"),
    )
    unit = WorkerUnit(
        config, source=source, setup=functools.partial(_logs.configure_worker, level, log_format)
    )
    signals = _Signals(on_hangup=unit.rescan)
    try:
        with _logs.real_output_for_children():
            unit.start()
    except BaseException:
        unit.stop(grace=0)
        raise
    print(_start_line(config, unit.workers, unit.port, unit.metrics_port), flush=True)
    while not signals.stop.wait(1.0):
        failure = unit.failed()
        if failure is not None:
            log.error("%s: stopping the other workers (restart the whole unit)", failure)
            unit.stop(grace=config.grace)
            return 1
    log.info(
        "%s received: draining %d workers for up to %.0fs",
        signals.received[0],
        unit.workers,
        config.grace,
    )
    return 0 if unit.stop(grace=config.grace) else 1
