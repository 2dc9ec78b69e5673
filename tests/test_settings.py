"""Every server setting is declared once (ServerConfig) and reaches the server three ways:
a flag, an environment variable and a config-file key, with the same meaning."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import subprocess

import pytest
from processes import PYTHON_BATCHWIRE

from batchwire.cli import _serve, build_parser
from batchwire.server import ConfigError, ServerConfig, settings

# A valid value other than the default for every setting, as text and as parsed.
EXAMPLES: dict[str, tuple[str, object]] = {
    "data_dir": ("/srv/data", pathlib.Path("/srv/data")),
    "host": ("127.0.0.1", "127.0.0.1"),
    "port": ("6000", 6000),
    "device": ("gpu", "gpu"),
    "devices": ("0,1", (0, 1)),
    "workers": ("2", 2),
    "num_threads": ("3", 3),
    "decoder_host_padding_mib": ("4", 4),
    "decoder_device_padding_mib": ("32", 32),
    "hw_decoder_load": ("0.75", 0.75),
    "gpu_wait": ("block", "block"),
    "prefetch": ("4", 4),
    "read_workers": ("2", 2),
    "read_ahead_reads": ("4", 4),
    "read_ahead_mib": ("512", 512),
    "max_batch_size": ("512", 512),
    "max_streams": ("300", 300),
    "max_idle_pipelines": ("6", 6),
    "slots_per_device": ("3", 3),
    "pipelines_per_device": ("3", 3),
    "metrics_port": ("9405", 9405),
    "worker_port": ("50100", 50100),
    "preprocess_batch_size": ("32", 32),
    "preprocess_max_delay_ms": ("2.5", 2.5),
    "preprocess_max_queued": ("100", 100),
    "max_request_bytes": ("1048576", 1048576),
    "max_message_bytes": ("4194304", 4194304),
    "grace": ("12.5", 12.5),
    "rescan_interval": ("0", 0.0),
    "tls_cert": ("/etc/c.pem", pathlib.Path("/etc/c.pem")),
    "tls_key": ("/etc/k.pem", pathlib.Path("/etc/k.pem")),
    "tls_client_ca": ("/etc/ca.pem", pathlib.Path("/etc/ca.pem")),
    "token_file": ("/etc/tokens", pathlib.Path("/etc/tokens")),
    "health_open": ("1", True),
    "shared_memory": ("0", False),
    "shared_memory_mib": ("64", 64),
    "shared_memory_socket_dir": ("/run/batchwire", pathlib.Path("/run/batchwire")),
    "bulk": ("0", False),
    "bulk_port": ("50200", 50200),
}


def _parser() -> argparse.ArgumentParser:
    return build_parser()


def test_every_field_of_the_config_is_a_setting_with_an_example() -> None:
    fields = {f.name for f in dataclasses.fields(ServerConfig)} - {"pipelines"}
    assert {s.name for s in settings()} == fields == set(EXAMPLES)


def _companions(name: str) -> dict[str, str]:
    """The other settings a config with ``name`` set needs to be valid, as text."""
    needed = {"data_dir": "/data"}
    if name in ("tls_client_ca", "health_open", "tls_cert", "tls_key"):
        needed |= {"tls_cert": "/c", "tls_key": "/k"}  # TLS, which these need or complete
    needed.pop(name, None)
    return needed


@pytest.mark.parametrize("setting", settings(), ids=lambda s: s.name)
def test_a_setting_means_the_same_as_a_flag_a_variable_and_a_file_key(
    setting, tmp_path: pathlib.Path
) -> None:
    text, value = EXAMPLES[setting.name]
    # Each route carries the setting and the others it needs.
    given = {**_companions(setting.name), setting.name: text}
    parser = _parser()
    flags = []
    for name, raw in given.items():
        flag = "--" + name.replace("_", "-")
        example = EXAMPLES[name][1]
        if isinstance(example, bool):  # a switch: --name, or --no-name for one on by default
            flags.append(flag if example else "--no-" + flag[2:])
        else:
            flags += [flag, raw]
    by_flag = _serve.resolve_config(parser.parse_args(["serve", *flags]), {})
    environ = {f"BATCHWIRE_{name.upper()}": raw for name, raw in given.items()}
    by_variable = _serve.resolve_config(parser.parse_args(["serve"]), environ)
    config_file = tmp_path / "server.toml"
    lines = [f"{name} = {_toml(name, raw)}" for name, raw in given.items()]
    config_file.write_text("[server]\n" + "\n".join(lines) + "\n")
    by_file = _serve.resolve_config(parser.parse_args(["serve", "--config", str(config_file)]), {})
    for config in (by_flag, by_variable, by_file):
        assert getattr(config, setting.name) == value, setting.name


def _toml(key: str, text: str) -> str:
    _, value = EXAMPLES[key]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, int | float):
        return text
    return f'"{text}"'


def test_a_bad_variable_is_an_error_that_names_it_and_help_still_works() -> None:
    with pytest.raises(ConfigError, match=r"BATCHWIRE_GRACE='abc' is not valid for grace"):
        _serve.resolve_config(
            _parser().parse_args(["serve"]), {"BATCHWIRE_DATA_DIR": "/d", "BATCHWIRE_GRACE": "abc"}
        )
    env = {"BATCHWIRE_GRACE": "abc", "PATH": "/usr/bin:/bin"}
    for argv in (["--help"], ["serve", "--help"]):
        done = subprocess.run(
            [*PYTHON_BATCHWIRE, *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_grace_is_a_config_file_key(tmp_path: pathlib.Path) -> None:
    config_file = tmp_path / "server.yaml"
    config_file.write_text("server:\n  data_dir: /d\n  grace: 7\n")
    args = _parser().parse_args(["serve", "--config", str(config_file)])
    assert _serve.resolve_config(args, {}).grace == 7


def test_an_unknown_config_key_names_the_one_meant(tmp_path: pathlib.Path) -> None:
    config_file = tmp_path / "server.toml"
    args = _parser().parse_args(["serve", "--config", str(config_file)])
    config_file.write_text('[server]\ndata_dir = "/d"\nmax_stream = 8\n')
    with pytest.raises(
        ConfigError, match=r"unknown \[server\] key 'max_stream': did you mean 'max_streams'\?"
    ):
        _serve.resolve_config(args, {})
    config_file.write_text('[server]\ndata_dir = "/d"\nlog_level = "DEBUG"\n')
    with pytest.raises(ConfigError, match="give --log-level or BATCHWIRE_LOG_LEVEL"):
        _serve.resolve_config(args, {})
    config_file.write_text('[server]\ndata_dir = "/d"\nzzzz = 1\n')
    with pytest.raises(ConfigError, match="`batchwire serve --help` lists them"):
        _serve.resolve_config(args, {})


def test_read_workers_is_ignored_with_a_warning() -> None:
    """The setting of the second record path, removed, still parses: it warns and does
    nothing, so that a config written for an earlier release still starts."""
    with pytest.warns(FutureWarning, match="read_workers .* is ignored"):
        config = ServerConfig(data_dir=pathlib.Path("/data"), read_workers=2)
    assert config.read_workers == 2
    server = pathlib.Path(__file__).parents[1] / "src" / "batchwire" / "server"
    readers = [p for p in server.rglob("*.py") if "read_workers" in p.read_text()]
    assert readers == [server / "config" / "_settings.py"], "only its declaration names it"
    # Taken on the command line still, but not offered in serve --help.
    parser = build_parser()
    args = parser.parse_args(["serve", "--data-dir", "/data", "--read-workers", "2"])
    assert args.read_workers == 2
    serve = next(
        action.choices["serve"]
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    assert "--read-workers" not in serve.format_help()
    assert "--read-ahead-reads" in serve.format_help()


def test_bulk_ports_past_the_last_port_are_refused_before_anything_listens() -> None:
    with pytest.raises(ConfigError, match="the last bulk port would be 65536: pick a lower"):
        ServerConfig(data_dir="/d", workers=4, bulk_port=65533)
    assert ServerConfig(data_dir="/d", workers=4, bulk_port=65532).bulk_port == 65532


def test_slots_per_device_is_also_taken_by_its_former_name(tmp_path: pathlib.Path) -> None:
    """``pipelines_per_device`` (flag, variable, file key) still sets the slots; given
    with ``slots_per_device`` saying otherwise, the config is refused, naming both."""
    parser = _parser()
    by_flag = _serve.resolve_config(
        parser.parse_args(["serve", "--data-dir", "/d", "--pipelines-per-device", "3"]), {}
    )
    environ = {"BATCHWIRE_DATA_DIR": "/d", "BATCHWIRE_PIPELINES_PER_DEVICE": "4"}
    by_variable = _serve.resolve_config(parser.parse_args(["serve"]), environ)
    config_file = tmp_path / "server.toml"
    config_file.write_text('[server]\ndata_dir = "/d"\npipelines_per_device = 5\n')
    by_file = _serve.resolve_config(parser.parse_args(["serve", "--config", str(config_file)]), {})
    assert [c.slots_per_device for c in (by_flag, by_variable, by_file)] == [3, 4, 5]
    assert (
        ServerConfig(data_dir="/d", slots_per_device=3, pipelines_per_device=3).slots_per_device
        == 3
    )
    with pytest.raises(ConfigError, match=r"slots_per_device \(3\) and pipelines_per_device \(4\)"):
        ServerConfig(data_dir="/d", slots_per_device=3, pipelines_per_device=4)
    assert "--pipelines-per-device" not in parser.format_help() + _serve_help(parser)


def _serve_help(parser: argparse.ArgumentParser) -> str:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"].format_help()
