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
from collections.abc import Callable, Mapping
from typing import Any

from batchwire.server.core._pipelines import (
    PRESETS,
    Param,
    ParamError,
    PipelineSpec,
    load_function,
)

__all__ = [
    "ConfigError",
    "ServerConfig",
    "Setting",
    "load_file",
    "pipelines_from_config",
    "resolve",
    "settings",
]


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and what to do."""


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


def boolean(text: str) -> bool:
    """A truth value as text: 1/true/yes/on or 0/false/no/off."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _setting(
    default: Any,
    help: str,
    parse: Callable[[str], Any] = int,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A ServerConfig field that is a setting: a flag ``--name``, a variable
    ``BATCHWIRE_NAME`` and a file key ``name`` (see :func:`settings`)."""
    metadata = {"help": help, "parse": parse, "metavar": metavar, "choices": choices}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _path(text: str) -> pathlib.Path:
    return pathlib.Path(text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything ``batchwire serve`` needs. ``port=0`` picks a free port.

    Each field but ``pipelines`` is a setting, declared here once: ``batchwire serve``
    derives its flag, its environment variable and its config-file key from it.
    """

    data_dir: pathlib.Path = _setting(
        dataclasses.MISSING, "datasets live in DIR/NAME/", _path, metavar="DIR"
    )
    host: str = _setting("[::]", "address to listen on (default [::], all)", str)
    port: int = _setting(50051, "gRPC port (default 50051; 0: any free)")
    device: str = _setting(
        "auto", "where pipelines run (default auto)", str, choices=("auto", "cpu", "gpu")
    )
    devices: tuple[int, ...] = _setting(
        (),
        "GPU ids to run pipelines on, e.g. 0,1; new streams are spread over them "
        "(default all: every visible GPU)",
        device_ids,
        metavar="IDS",
    )
    num_threads: int = _setting(0, "DALI threads per pipeline (default 0: one per core)")
    prefetch: int = _setting(2, "batches each pipeline computes ahead (default 2)")
    read_workers: int = _setting(
        0,
        "processes per StreamBatches stream that read its records through DALI's parallel "
        "external_source (default 0: read in the thread feeding the pipeline)",
    )
    max_batch_size: int = _setting(1024, "largest batch a client may ask for (default 1024)")
    max_streams: int = _setting(64, "concurrent streams before RESOURCE_EXHAUSTED (default 64)")
    max_idle_pipelines: int = _setting(
        8, "built pipelines kept idle for Preprocess and read_workers streams (default 8)"
    )
    pipelines_per_device: int = _setting(
        2, "pipelines each device runs for all streams; they do not grow with streams (default 2)"
    )
    metrics_port: int | None = _setting(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics (default: off; 0: any free)",
        metavar="PORT",
    )
    preprocess_batch_size: int = _setting(
        64, "Preprocess RPC: images of concurrent requests per DALI batch (default 64)"
    )
    preprocess_max_delay_ms: float = _setting(
        5.0, "Preprocess RPC: how long a batch gathers images, in ms (default 5)", float
    )
    preprocess_max_queued: int = _setting(
        1024, "Preprocess RPC: images that may wait before RESOURCE_EXHAUSTED (default 1024)"
    )
    max_request_bytes: int = _setting(
        64 * 1024 * 1024, "largest request message, e.g. encoded images (default 64 MiB)"
    )
    # gRPC Python moves 8-16 MB messages fastest on loopback and slows sharply at 32 MB.
    max_message_bytes: int = _setting(
        8 * 1024 * 1024, "larger batches travel as several messages of this size (default 8 MiB)"
    )
    grace: float = _setting(
        30.0, "seconds in-flight streams get on SIGTERM or SIGINT (default 30)", float
    )
    tls_cert: pathlib.Path | None = _setting(
        None, "PEM certificate chain: serve TLS (needs tls_key)", _path, metavar="FILE"
    )
    tls_key: pathlib.Path | None = _setting(
        None, "PEM private key of tls_cert, unencrypted", _path, metavar="FILE"
    )
    tls_client_ca: pathlib.Path | None = _setting(
        None,
        "mutual TLS: require client certificates signed by this PEM CA",
        _path,
        metavar="FILE",
    )
    token_file: pathlib.Path | None = _setting(
        None,
        "require 'authorization: Bearer <token>' with a token from FILE (one per line, # comments)",
        _path,
        metavar="FILE",
    )
    health_open: bool = _setting(
        False, "with token_file: the health service needs no token (for probes)", boolean
    )
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
            (0 <= self.grace <= 24 * 3600, "grace must be in [0, 86400] seconds"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ServerConfig field as ``batchwire serve`` takes it."""

    name: str
    help: str
    parse: Callable[[str], Any]
    metavar: str | None
    choices: tuple[str, ...] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def variable(self) -> str:
        return "BATCHWIRE_" + self.name.upper()


def settings() -> list[Setting]:
    """Every setting, in declaration order."""
    return [
        Setting(
            f.name,
            f.metadata["help"],
            f.metadata["parse"],
            f.metadata["metavar"],
            f.metadata["choices"],
        )
        for f in dataclasses.fields(ServerConfig)
        if "help" in f.metadata
    ]


_SERVER_KEYS = {s.name for s in settings()}


def resolve(
    flags: Mapping[str, Any], environ: Mapping[str, str], config_path: pathlib.Path | str | None
) -> ServerConfig:
    """Flags (parsed values; None: not given) > environment > config file > defaults."""
    file = load_file(config_path) if config_path else {}
    values: dict[str, Any] = dict(file.get("server", {}))
    for setting in settings():
        flag = flags.get(setting.name)
        if flag is not None:
            values[setting.name] = flag
        elif setting.variable in environ:
            text = environ[setting.variable]
            try:
                values[setting.name] = setting.parse(text)
            except ValueError as exc:
                raise ConfigError(
                    f"{setting.variable}={text!r} is not valid for {setting.name} ({exc}); "
                    f"fix or unset it ({setting.help})"
                ) from exc
    if "data_dir" not in values:
        raise ConfigError("no data directory: pass --data-dir DIR (or set BATCHWIRE_DATA_DIR)")
    if "devices" in values:
        values["devices"] = tuple(values["devices"])
    try:
        return ServerConfig(
            pipelines=pipelines_from_config(
                # A custom pipeline's "file.py:function" is relative to the config file.
                file.get("pipelines"),
                base_dir=pathlib.Path(config_path).parent if config_path else None,
            ),
            **values,
        )
    except TypeError as exc:  # a file value of the wrong kind, e.g. port = "x"
        raise ConfigError(f"config file {config_path}: {exc}") from exc


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
