"""Config files: TOML (``.toml``) or YAML (``.yaml``/``.yml``), with a ``[server]`` table
of settings (any :class:`~batchwire.server.ServerConfig` field, by name) and a
``[pipelines]`` table::

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
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any

from batchwire.server.config._settings import ConfigError, ServerConfig, settings
from batchwire.server.pipelines import (
    PRESETS,
    Input,
    Output,
    Param,
    ParamError,
    PipelineSpec,
    load_function,
)

__all__ = ["load_file", "pipelines_from_config", "resolve"]


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
    known = {setting.name for setting in settings()}
    bad = sorted(set(server) - known)
    if bad:
        raise ConfigError(f"config file {path}: {'; '.join(_unknown(key, known) for key in bad)}")
    return data


def _unknown(key: str, known: set[str]) -> str:
    """What to say of an unknown ``[server]`` key: the known one it is closest to, or
    where the flags that are not file keys go."""
    if key in ("log_level", "log_format"):
        return (
            f"{key} is not a [server] key: logging starts before the file is read; give "
            f"--{key.replace('_', '-')} or BATCHWIRE_{key.upper()}"
        )
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else "`batchwire serve --help` lists them"
    return f"unknown [server] key {key!r}: {hint}"


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
    # Named outputs: a name each, or a table with name, kind and layout (Output).
    outputs = []
    for decl in entry.pop("outputs", ()):
        fields = {"name": decl} if isinstance(decl, str) else decl
        if not isinstance(fields, Mapping) or set(fields) - {"name", "kind", "layout"}:
            raise ConfigError(
                f"[pipelines.{name}] an output is a name or a table of name, kind and layout, "
                f"not {decl!r}"
            )
        outputs.append(Output(**{k: str(v) for k, v in fields.items()}))
    if outputs:
        kwargs.update(outputs=tuple(outputs), form=str(entry.pop("form", "named")))
    # Dataset fields it takes: a table each, of name and kind (Input).
    inputs = []
    for decl in entry.pop("inputs", ()):
        if not isinstance(decl, Mapping) or set(decl) != {"name", "kind"}:
            raise ConfigError(
                f"[pipelines.{name}] an input is a table of name and kind, not {decl!r}"
            )
        inputs.append(Input(name=str(decl["name"]), kind=str(decl["kind"])))
    if inputs:
        kwargs["inputs"] = tuple(inputs)
    if entry:
        raise ConfigError(f"[pipelines.{name}]: unknown keys {sorted(entry)}")
    spec = PipelineSpec(
        name=name, function=function, params=params, description=description, **kwargs
    )
    spec.resolve()
    return spec


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
