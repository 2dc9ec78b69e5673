"""The deploy files agree with the code (no Docker engine runs here, so they are read)."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest
import yaml

from batchwire.cli import build_parser

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"


@pytest.fixture(scope="module")
def service() -> dict:  # type: ignore[type-arg]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return compose["services"]["batchwire"]


def test_compose_reserves_a_gpu_and_mounts_data_read_only(service: dict) -> None:  # type: ignore[type-arg]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    (volume,) = service["volumes"]
    assert volume["target"] == "/data" and volume["read_only"] is True


def test_compose_command_and_healthcheck_use_real_flags(service: dict) -> None:  # type: ignore[type-arg]
    parser = build_parser()
    args = parser.parse_args(["serve", *service["command"]])
    assert str(args.data_dir) == "/data"
    health = service["healthcheck"]["test"]
    assert health[:3] == ["CMD", "batchwire", "health"]
    health_args = parser.parse_args(health[2:])
    assert health_args.address == f"localhost:{args.port}"
    assert service["ports"] == [f"{args.port}:{args.port}"]
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > args.grace, "Docker must wait longer than the server drains"


def test_dockerfile_entrypoint_and_healthcheck_are_batchwire_commands() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["batchwire", "serve"]' in text
    assert re.search(
        r'HEALTHCHECK .*\n\s+CMD \["batchwire", "health", "--address", "localhost:50051"\]', text
    )
    assert "USER batchwire" in text
    assert "BATCHWIRE_DATA_DIR=/data" in text
    parser = build_parser()
    for line in re.findall(r"CMD (\[.*\])", text):
        words = yaml.safe_load(line)
        parser.parse_args(words[1:])


def test_dockerfile_environment_configures_the_server_without_flags() -> None:
    from batchwire.cli._serve import resolve_config

    text = (DEPLOY / "Dockerfile").read_text()
    block = re.search(r"ENV (BATCHWIRE_DATA_DIR=.*?)\n(?!\s)", text, re.S)
    assert block, "the Dockerfile sets BATCHWIRE_* in one ENV block"
    environ = dict(item.split("=", 1) for item in shlex.split(block.group(1).replace("\\\n", " ")))
    config = resolve_config(build_parser().parse_args(["serve"]), environ)
    assert str(config.data_dir) == "/data"
    assert config.port == 50051
