"""Server configuration: a frozen object built from a file, flags and the environment.

A config file is TOML (``.toml``) or YAML (``.yaml``/``.yml``)::

    [server]
    port = 50051
    device = "auto"          # auto | cpu | gpu
    devices = [0, 1]         # GPU ids to use (default: every visible GPU)
    metrics_port = 9405      # Prometheus /metrics (default: off)
    max_batch_size = 1024
    max_streams = 64
    tls_cert = "/etc/batchwire/server.pem"     # PEM; TLS needs both cert and key
    tls_key = "/etc/batchwire/server.key"
    tls_client_ca = "/etc/batchwire/ca.pem"    # mutual TLS: client certs signed by this CA
    token_file = "/etc/batchwire/tokens"       # one bearer token per line
    health_open = true                         # health reachable without a token
    preprocess_batch_size = 64     # Preprocess RPC: images per DALI batch,
    preprocess_max_delay_ms = 5    # gathered for at most this long,
    preprocess_max_queued = 1024   # with at most this many waiting
    max_request_bytes = 67108864   # largest request message (encoded images)

    [pipelines.train]        # a preset with other defaults
    preset = "train"
    size = 176

    [pipelines.val]
    preset = "val"

    [pipelines.small]        # a custom graph (see docs), never chosen by clients' code
    function = "my_module:build"   # or "pipelines.py:build", relative to this file
    params = { size = { default = 128, low = 32, high = 512, integer = true } }

Without a ``[pipelines]`` table the server offers the ``train`` and ``val`` presets.
Precedence: flags > environment (``BATCHWIRE_*``) > file > defaults; only the CLI
entry point reads flags and the environment.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any

from batchwire.server.core._pipelines import (
    PRESETS,
    Param,
    ParamError,
    PipelineSpec,
    load_function,
)

__all__ = ["ConfigError", "ServerConfig", "load_file", "pipelines_from_config"]


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and what to do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything ``batchwire serve`` needs. ``port=0`` picks a free port."""

    data_dir: pathlib.Path
    host: str = "[::]"
    port: int = 50051
    device: str = "auto"
    devices: tuple[int, ...] = ()
    num_threads: int = 0
    prefetch: int = 2
    # Worker processes that read each stream's records (LMDB, Datum parse, format
    # screen) through DALI's parallel external_source; 0 reads them in the thread
    # that feeds the pipeline. See README "Reading records in parallel".
    read_workers: int = 0
    max_batch_size: int = 1024
    max_streams: int = 64
    max_idle_pipelines: int = 8
    # Pipelines each device runs for every stream (server/_scheduler.py): they do not
    # grow with the streams.
    pipelines_per_device: int = 2
    # Prometheus /metrics on this port (same host as gRPC); None: off, 0: any free port.
    metrics_port: int | None = None
    # Preprocess RPC (inference): images of concurrent requests share DALI
    # batches of up to preprocess_batch_size, gathered for at most
    # preprocess_max_delay_ms; at most preprocess_max_queued images wait.
    # max_request_bytes bounds any request message (gRPC's receive limit).
    preprocess_batch_size: int = 64
    preprocess_max_delay_ms: float = 5.0
    preprocess_max_queued: int = 1024
    max_request_bytes: int = 64 * 1024 * 1024
    # Larger batches travel as several messages: gRPC Python moves 8-16 MB
    # messages fastest on loopback and slows sharply at 32 MB.
    max_message_bytes: int = 8 * 1024 * 1024
    # Security (see batchwire.server.serving._security): PEM files and a token file, read
    # and checked when the server is built.
    tls_cert: pathlib.Path | None = None
    tls_key: pathlib.Path | None = None
    tls_client_ca: pathlib.Path | None = None
    token_file: pathlib.Path | None = None
    health_open: bool = False
    pipelines: Mapping[str, PipelineSpec] = dataclasses.field(default_factory=lambda: dict(PRESETS))

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", pathlib.Path(self.data_dir))
        for name in ("tls_cert", "tls_key", "tls_client_ca", "token_file"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str | os.PathLike):
                    raise ConfigError(f"{name} must be a file path, got {value!r}")
                object.__setattr__(self, name, pathlib.Path(value))
        checks = (
            (0 <= self.port <= 65535, "port must be in [0, 65535] (0: any free port)"),
            (self.device in ("auto", "cpu", "gpu"), "device must be auto, cpu or gpu"),
            (self.num_threads >= 0, "num_threads must be >= 0 (0: one per core)"),
            (1 <= self.prefetch <= 16, "prefetch must be in [1, 16]"),
            (0 <= self.read_workers <= 64, "read_workers must be in [0, 64] (0: read inline)"),
            (1 <= self.max_batch_size <= 65536, "max_batch_size must be in [1, 65536]"),
            (1 <= self.max_streams <= 4096, "max_streams must be in [1, 4096]"),
            (0 <= self.max_idle_pipelines <= 256, "max_idle_pipelines must be in [0, 256]"),
            (1 <= self.pipelines_per_device <= 64, "pipelines_per_device must be in [1, 64]"),
            (
                self.metrics_port is None or 0 <= self.metrics_port <= 65535,
                "metrics_port must be in [0, 65535] (0: any free port; leave it out for none)",
            ),
            (
                all(isinstance(i, int) and i >= 0 for i in self.devices)
                and len(set(self.devices)) == len(self.devices),
                f"devices must be distinct GPU ids >= 0 (e.g. --devices 0,1), got {self.devices}",
            ),
            (
                not self.devices or self.device != "cpu",
                "devices picks GPUs: it cannot be combined with device = cpu "
                "(use --device auto or gpu, or leave --devices out)",
            ),
            (
                1 <= self.preprocess_batch_size <= 4096,
                "preprocess_batch_size must be in [1, 4096]",
            ),
            (
                0 <= self.preprocess_max_delay_ms <= 1000,
                "preprocess_max_delay_ms must be in [0, 1000]",
            ),
            (
                1 <= self.preprocess_max_queued <= 1 << 20,
                "preprocess_max_queued must be in [1, 1048576]",
            ),
            (
                64 * 1024 <= self.max_request_bytes <= 1024**3,
                "max_request_bytes must be in [65536, 1073741824]",
            ),
            (
                64 * 1024 <= self.max_message_bytes <= 1024**3,
                "max_message_bytes must be in [65536, 1073741824]",
            ),
            (bool(self.pipelines), "at least one pipeline must be configured"),
            (
                (self.tls_cert is None) == (self.tls_key is None),
                "tls_cert and tls_key go together (--tls-cert FILE --tls-key FILE): "
                f"got only {'tls_cert' if self.tls_key is None else 'tls_key'}",
            ),
            (
                self.tls_client_ca is None or self.tls_cert is not None,
                "tls_client_ca (--tls-client-ca) needs TLS: give --tls-cert and --tls-key too",
            ),
            (isinstance(self.health_open, bool), "health_open must be true or false"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


_SERVER_KEYS = {f.name for f in dataclasses.fields(ServerConfig)} - {"pipelines"}


def load_file(path: pathlib.Path | str) -> dict[str, Any]:
    """Read a TOML or YAML config file into plain data."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {path} must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigError(f"config file {path} does not parse: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError without importing yaml at module level
        raise ConfigError(f"config file {path} does not parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table/mapping at the top level")
    unknown = set(data) - {"server", "pipelines"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown sections {sorted(unknown)}")
    server = data.get("server", {})
    if not isinstance(server, dict):
        raise ConfigError(f"config file {path}: [server] must be a table")
    bad = set(server) - _SERVER_KEYS
    if bad:
        raise ConfigError(
            f"config file {path}: unknown [server] keys {sorted(bad)} (known: {sorted(_SERVER_KEYS)})"
        )
    return data


def pipelines_from_config(
    table: Mapping[str, Any] | None, base_dir: pathlib.Path | None = None
) -> dict[str, PipelineSpec]:
    """PipelineSpecs from a config's ``[pipelines]`` table (presets when absent).

    ``base_dir`` (the config file's directory) anchors relative ``file.py:function``
    references of custom pipelines.
    """
    if not table:
        return dict(PRESETS)
    specs: dict[str, PipelineSpec] = {}
    for name, entry in table.items():
        if not isinstance(entry, Mapping):
            raise ConfigError(f"[pipelines.{name}] must be a table")
        entry = dict(entry)
        try:
            if "preset" in entry:
                preset = PRESETS.get(str(entry.pop("preset")))
                if preset is None:
                    raise ConfigError(
                        f"[pipelines.{name}]: preset must be one of {sorted(PRESETS)}"
                    )
                spec = dataclasses.replace(preset.with_defaults(entry), name=name)
            elif "function" in entry:
                spec = _custom(name, entry, base_dir)
            else:
                raise ConfigError(f"[pipelines.{name}] needs either preset = ... or function = ...")
        except ParamError as exc:
            raise ConfigError(f"[pipelines.{name}]: {exc}") from exc
        specs[name] = spec
    return specs


def _custom(name: str, entry: dict[str, Any], base_dir: pathlib.Path | None = None) -> PipelineSpec:
    function = load_function(str(entry.pop("function")), base_dir)
    params: dict[str, Param] = {}
    for pname, decl in dict(entry.pop("params", {})).items():
        if not isinstance(decl, Mapping) or "default" not in decl:
            raise ConfigError(f"[pipelines.{name}] parameter {pname!r} needs default, low and high")
        default = float(decl["default"])
        params[pname] = Param(
            default=default,
            low=float(decl.get("low", default)),
            high=float(decl.get("high", default)),
            integer=bool(decl.get("integer", False)),
            help=str(decl.get("help", "")),
        )
    kwargs: dict[str, Any] = {}
    for key in ("mean", "std"):
        if key in entry:
            kwargs[key] = tuple(float(v) for v in entry.pop(key))
    description = str(entry.pop("description", ""))
    if entry:
        raise ConfigError(f"[pipelines.{name}]: unknown keys {sorted(entry)}")
    spec = PipelineSpec(
        name=name, function=function, params=params, description=description, **kwargs
    )
    spec.resolve()
    return spec
