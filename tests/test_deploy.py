"""The deploy files agree with the code: flags, paths, ports, probes, grace periods.

Compose itself says what the compose files mean (``docker compose config``: merged,
interpolated, normalized; no engine needed), and those tests skip where no Docker
Compose v2 is installed. kustomize says what ``kubectl apply -k deploy/k8s`` sends
(``kubectl kustomize``), and ``kubernetes-validate`` holds those objects to the
Kubernetes API's schemas; those tests skip without kubectl. The Dockerfile and
prometheus.yml, which no such command reads, are parsed (``deployfiles``; promtool checks
prometheus.yml in ``test_alerts.py``). Every command line in them goes through the real
argument parser and the real settings resolution (flags > BATCHWIRE_* environment > config
file) of ``batchwire serve``. ``test_ops.py`` runs the container's command line for real.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import tomllib
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from conftest import Compose
from deployfiles import (
    DEPLOY,
    K8S,
    KUSTOMIZE_MISSING,
    ROOT,
    Dockerfile,
    duration_seconds,
    kustomize,
    kustomize_command,
)

from batchwire.cli import build_parser
from batchwire.cli._serve import resolve_config
from batchwire.server import ServerConfig, load_file, settings

CONFIG_KEYS = {"server", "pipelines"}
# compose.yaml's one required variable: the host folder of the datasets.
DATA = {"BATCHWIRE_DATA": "/srv/datasets"}
# Every interface of the container or pod, where published ports, probes and trainers arrive.
EVERY_INTERFACE = "[::]"


@pytest.fixture(scope="module")
def image() -> Dockerfile:
    return Dockerfile.read()


@pytest.fixture(scope="module")
def service(docker_compose: Compose) -> dict[str, Any]:
    return docker_compose("compose.yaml", environ=DATA)["services"]["batchwire"]


def serve_args(words: list[str]) -> argparse.Namespace:
    """``words`` as `batchwire serve` parses them (argparse exits on an unknown flag)."""
    return build_parser().parse_args(["serve", *words])


def batchwire(words: list[str]) -> argparse.Namespace:
    """A `batchwire ...` command line (exec form) as the CLI parses it."""
    assert words[0] == "batchwire", words
    return build_parser().parse_args(words[1:])


def entrypoint_args(image: Dockerfile, arguments: list[str]) -> argparse.Namespace:
    entrypoint = image.exec_form("ENTRYPOINT")
    assert entrypoint[:2] == ["batchwire", "serve"]
    return serve_args([*entrypoint[2:], *arguments])


def known_environment_variables() -> set[str]:
    """Every BATCHWIRE_* variable the code reads: the server settings' and the names in
    the CLI's and client's source."""
    names = {setting.variable for setting in settings()}
    for directory in ("cli", "client"):
        for path in (ROOT / "src" / "batchwire" / directory).glob("*.py"):
            names.update(re.findall(r"BATCHWIRE_[A-Z_]+[A-Z]", path.read_text()))
    return names


def compose_config(image: Dockerfile, service: dict[str, Any]) -> tuple[argparse.Namespace, Any]:
    """The settings the compose service runs with: image ENV < compose environment < command."""
    args = entrypoint_args(image, service["command"])
    environ = {**image.env, **service.get("environment", {})}
    return args, resolve_config(args, environ)


def gpu_reservations(service: dict[str, Any]) -> list[Any]:
    """The devices the service reserves (Compose may leave empty mappings out)."""
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations") or {}
    return reservations.get("devices", [])


# -- Dockerfile ------------------------------------------------------------------------


def test_image_is_cuda_12_runs_batchwire_serve_as_a_non_root_user(image: Dockerfile) -> None:
    assert image.base.startswith("nvidia/cuda:12."), image.base
    assert "runtime" in image.base
    assert image.exec_form("ENTRYPOINT") == ["batchwire", "serve"]
    (user,) = image.values("USER")
    assert user == "batchwire"
    uid = re.search(r"useradd .*--uid (\d+) .*batchwire", " ".join(image.values("RUN")))
    assert uid and int(uid.group(1)) >= 1000
    exposed = {int(p) for rest in image.values("EXPOSE") for p in rest.split()}
    assert exposed == {50051, 50100, 9405}  # gRPC, worker 0's bulk port, metrics


def test_image_installs_the_server_extra_before_copying_the_source(image: Dockerfile) -> None:
    steps = image.all_instructions
    server_extra = next(i for i, (w, r) in enumerate(steps) if w == "RUN" and '".[server]"' in r)
    copy_source = next(i for i, (w, r) in enumerate(steps) if w == "COPY" and r.startswith(". "))
    assert server_extra < copy_source, (
        "dependencies must be a layer of their own, before the source"
    )
    copied = [r for w, r in steps[:server_extra] if w == "COPY"]
    assert all("pyproject.toml" in r or r.split()[0] == "proto" for r in copied), copied
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", "**/node_modules"} <= set(ignore)


def test_image_environment_alone_configures_a_server_on_data(image: Dockerfile) -> None:
    env = image.env
    assert env["BATCHWIRE_DATA_DIR"] == "/data"
    unknown = {k for k in env if k.startswith("BATCHWIRE_")} - known_environment_variables()
    assert not unknown, f"the image sets variables no code reads: {unknown}"
    args = entrypoint_args(image, [])
    config = resolve_config(args, env)
    assert str(config.data_dir) == "/data"
    # Not the server's default, localhost, which only the container itself reaches.
    assert config.host == EVERY_INTERFACE
    # The healthcheck dials the port the server listens on without any flag.
    health = batchwire(image.healthcheck)
    assert health.func.__module__ == "batchwire.cli._health"
    assert health.address == f"localhost:{config.port}"
    # No port variable: a --config file must be able to set the ports.
    assert "BATCHWIRE_PORT" not in env and "BATCHWIRE_METRICS_PORT" not in env


# -- compose ---------------------------------------------------------------------------


def test_compose_reserves_a_gpu_and_mounts_data_read_only(service: dict[str, Any]) -> None:
    (device,) = gpu_reservations(service)
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    (volume,) = service["volumes"]
    assert volume["type"] == "bind" and volume["target"] == "/data"
    assert volume["read_only"] is True
    assert service["restart"] in ("always", "unless-stopped", "on-failure")


def test_compose_command_ports_and_healthcheck_agree_with_the_code(
    image: Dockerfile, service: dict[str, Any]
) -> None:
    args, config = compose_config(image, service)
    assert str(config.data_dir) == "/data"
    assert config.host == EVERY_INTERFACE, "the published ports must reach the server"
    assert config.metrics_port is not None, "compose must serve /metrics"
    published = {(p["target"], p["published"], p["protocol"]) for p in service["ports"]}
    bulk = {(config.bulk_port + i, str(config.bulk_port + i), "tcp") for i in range(4)}
    assert published == {
        (config.port, str(config.port), "tcp"),
        (config.metrics_port, str(config.metrics_port), "tcp"),
        *bulk,  # one bulk port a worker: a GPU's default of up to 4
    }
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "batchwire", "health"]
    health = batchwire(test[1:])
    assert health.address == f"localhost:{config.port}"
    assert duration_seconds(service["stop_grace_period"]) > args.grace, (
        "Docker must wait longer than the server drains"
    )
    unknown = set(service["environment"]) - known_environment_variables()
    assert not unknown, f"compose sets variables no code reads: {unknown}"


def test_compose_cpu_override_drops_the_gpu_and_runs_on_the_cpu(
    image: Dockerfile, service: dict[str, Any], docker_compose: Compose
) -> None:
    cpu = docker_compose("compose.yaml", "compose.cpu.yaml", environ=DATA)["services"]["batchwire"]
    assert gpu_reservations(cpu) == []
    _, config = compose_config(image, cpu)
    assert config.device == "cpu"
    assert config.devices == ()
    # Everything else is the GPU service's: its ports (not published twice), and its
    # environment, merged with the override's variable by variable.
    assert cpu["command"] == service["command"] and cpu["volumes"] == service["volumes"]
    assert cpu["ports"] == service["ports"]
    assert cpu["environment"] == {**service["environment"], "BATCHWIRE_DEVICE": "cpu"}
    # The shell's variables reach the merged service, but cannot undo the override.
    environ = {**DATA, "BATCHWIRE_DEVICE": "gpu", "BATCHWIRE_LOG_FORMAT": "json"}
    cpu = docker_compose("compose.yaml", "compose.cpu.yaml", environ=environ)
    _, config = compose_config(image, cpu["services"]["batchwire"])
    assert config.device == "cpu"
    assert cpu["services"]["batchwire"]["environment"]["BATCHWIRE_LOG_FORMAT"] == "json"


def test_compose_needs_the_data_folder_and_says_which_variable_names_it(
    docker_compose: Compose,
) -> None:
    """``${BATCHWIRE_DATA:?...}``: unset or empty, compose stops before anything starts,
    naming the variable and what to set it to, rather than mounting a folder that is not
    there (a checkout has none); in every combination of the files."""
    for names in (("compose.yaml",), ("compose.yaml", "compose.cpu.yaml", "compose.secure.yaml")):
        for environ in ({}, {"BATCHWIRE_DATA": ""}):
            with pytest.raises(RuntimeError, match="BATCHWIRE_DATA") as failed:
                docker_compose(*names, environ=environ)
            assert "set BATCHWIRE_DATA to the folder of your datasets" in str(failed.value)


def test_compose_variables_set_empty_take_their_defaults(
    image: Dockerfile, docker_compose: Compose, tmp_path: pathlib.Path
) -> None:
    """``${VAR:-default}``: an exported but empty variable (``BATCHWIRE_DEVICE=``) gets the
    default, as an unset one does, rather than an empty device or secrets folder."""
    names = ("compose.yaml", "compose.secure.yaml")
    variables = ("BATCHWIRE_DEVICE", "BATCHWIRE_SECRETS", "BATCHWIRE_TLS_NAME")
    empty = docker_compose(*names, environ={**DATA, **dict.fromkeys(variables, "")})
    assert empty == docker_compose(*names, environ=DATA)
    _, config = compose_config(image, empty["services"]["batchwire"])
    assert config.device == "auto"
    secrets = {pathlib.Path(s["file"]).parent for s in empty["secrets"].values()}
    assert secrets == {pathlib.Path("/etc/batchwire")}
    assert empty["services"]["batchwire"]["healthcheck"]["test"][-2:] == ["--tls-name", "localhost"]
    # Set, they are used.
    environ = {"BATCHWIRE_DATA": str(tmp_path), "BATCHWIRE_DEVICE": "gpu"}
    chosen = docker_compose("compose.yaml", environ=environ)["services"]["batchwire"]
    (volume,) = chosen["volumes"]
    assert volume["source"] == str(tmp_path)
    _, config = compose_config(image, chosen)
    assert config.device == "gpu"


def test_compose_secure_override_mounts_every_file_it_names_as_a_secret(
    service: dict[str, Any], docker_compose: Compose, tmp_path: pathlib.Path
) -> None:
    # Compose reads the model without the secret files (an empty directory here).
    environ = {**DATA, "BATCHWIRE_SECRETS": str(tmp_path)}
    document = docker_compose("compose.yaml", "compose.secure.yaml", environ=environ)
    secure = document["services"]["batchwire"]
    args = serve_args(secure["command"])
    health = batchwire(secure["healthcheck"]["test"][1:])
    files = [args.tls_cert, args.tls_key, args.token_file, health.tls_ca]
    assert all(f is not None for f in files)
    assert args.health_open, "the healthcheck sends no token"
    mounted = {s["target"]: s["source"] for s in secure["secrets"]}
    for path in files:
        assert path.parent == pathlib.PurePosixPath("/run/secrets"), path
        assert str(path) in mounted, f"{path} is not mounted"
        host = pathlib.Path(document["secrets"][mounted[str(path)]]["file"])
        assert host.parent == tmp_path, f"secret {path.name} is not from $BATCHWIRE_SECRETS"
    # The files the header (and README) name, all of them used.
    hosts = {pathlib.Path(secret["file"]).name for secret in document["secrets"].values()}
    assert hosts == {"server.pem", "server.key", "ca.pem", "tokens"}
    assert set(mounted.values()) == set(document["secrets"])
    # Everything but the security flags is the plain service's command.
    assert secure["command"][: len(service["command"])] == service["command"]


def test_compose_prometheus_scrapes_the_metrics_port(
    image: Dockerfile, service: dict[str, Any], docker_compose: Compose
) -> None:
    plain = docker_compose("compose.yaml", environ=DATA)["services"]
    assert "prometheus" not in plain, "Prometheus only starts when asked for"
    document = docker_compose("compose.yaml", environ=DATA, profiles=["metrics"])
    prometheus = document["services"]["prometheus"]
    assert prometheus["profiles"] == ["metrics"]
    mounts = {m["target"]: pathlib.Path(m["source"]) for m in prometheus["volumes"]}
    assert all(m["read_only"] is True for m in prometheus["volumes"])
    config = pathlib.PurePosixPath("/etc/prometheus/prometheus.yml")
    scrape = yaml.safe_load(mounts[str(config)].read_text())
    # The alerting rules are mounted where the config names them (relative to itself).
    (rules,) = scrape["rule_files"]
    assert mounts[str(config.parent / rules)] == DEPLOY / "prometheus" / "alerts.yml"
    assert len(mounts) == 2
    (job,) = scrape["scrape_configs"]
    _, config = compose_config(image, service)
    assert job["static_configs"][0]["targets"] == [f"batchwire:{config.metrics_port}"]


def test_compose_overrides_combine_as_the_readme_documents(
    image: Dockerfile, docker_compose: Compose
) -> None:
    """``-f compose.yaml -f compose.cpu.yaml -f compose.secure.yaml --profile metrics``."""
    files = ("compose.yaml", "compose.cpu.yaml", "compose.secure.yaml")
    document = docker_compose(*files, environ=DATA, profiles=["metrics"])
    assert set(document["services"]) == {"batchwire", "prometheus"}
    service = document["services"]["batchwire"]
    assert gpu_reservations(service) == []
    args, config = compose_config(image, service)
    assert config.device == "cpu"
    assert args.tls_cert and args.tls_key and args.token_file
    assert {s["source"] for s in service["secrets"]} == set(document["secrets"])
    assert "--tls-ca" in service["healthcheck"]["test"]


# -- Kubernetes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k deploy/k8s`` sends (``kubectl kustomize``)."""
    if kustomize_command() is None:
        pytest.skip(KUSTOMIZE_MISSING)
    return kustomize()


@pytest.fixture(scope="module")
def k8s_object(k8s: list[dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def find(kind: str) -> dict[str, Any]:
        (found,) = [d for d in k8s if d["kind"] == kind]
        return found

    return find


@pytest.fixture(scope="module")
def deployment(k8s_object: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    return k8s_object("Deployment")


@pytest.fixture(scope="module")
def pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    return container


@pytest.fixture(scope="module")
def k8s_config(
    image: Dockerfile,
    container: dict[str, Any],
    k8s_object: Callable[[str], dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[argparse.Namespace, ServerConfig]:
    """The pod's settings: image ENV < container env < ConfigMap file < args, resolved by
    the code, with the ConfigMap's file where the pod mounts it."""
    configmap = k8s_object("ConfigMap")
    args = entrypoint_args(image, container["args"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert str(args.config.parent) == mounts["config"], "--config must be in the ConfigMap mount"
    local = tmp_path_factory.mktemp("configmap") / args.config.name
    local.write_text(configmap["data"][args.config.name])
    assert set(load_file(local)) <= CONFIG_KEYS
    args.config = local
    environ = {**image.env, **{e["name"]: e["value"] for e in container.get("env", [])}}
    return args, resolve_config(args, environ)


def test_kustomization_applies_every_manifest_in_its_namespace(
    k8s: list[dict[str, Any]], k8s_object: Callable[[str], dict[str, Any]]
) -> None:
    kinds = sorted(d["kind"] for d in k8s)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Namespace",
        "PodDisruptionBudget",
        "Service",
    ]
    # Every object of every file in deploy/k8s is applied.
    applied = {(d["kind"], d["metadata"]["name"]) for d in k8s}
    for path in set(K8S.glob("*.yaml")) - {K8S / "kustomization.yaml"}:
        for document in filter(None, yaml.safe_load_all(path.read_text())):
            assert (document["kind"], document["metadata"]["name"]) in applied, path.name
    namespace = k8s_object("Namespace")["metadata"]["name"]
    namespaced = [d for d in k8s if d["kind"] != "Namespace"]
    assert all(d["metadata"]["namespace"] == namespace for d in namespaced)
    # The image: compose's name, tagged with the package's version.
    (container,) = k8s_object("Deployment")["spec"]["template"]["spec"]["containers"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"] == f"batchwire:{version}"


@pytest.mark.parametrize("version", ["oldest", "latest"])
def test_manifests_are_valid_kubernetes_objects(k8s: list[dict[str, Any]], version: str) -> None:
    """Against the oldest and the newest API schemas kubernetes-validate ships (README asks
    for Kubernetes 1.24 or newer; the oldest schemas stand in for it). Strict: a misspelt or
    misplaced field fails, as a wrong type does."""
    validator = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed"
    )
    versions = validator.utils.all_versions()
    oldest = min(versions, key=lambda v: tuple(int(n) for n in v.split(".")))
    wanted = validator.latest_version() if version == "latest" else oldest
    for document in k8s:
        try:
            validator.validate(document, wanted, strict=True)
        except validator.ValidationError as exc:
            pytest.fail(f"{document['kind']} {document['metadata']['name']}: {exc.message}")


def test_deployment_requests_a_gpu_and_mounts_data_read_only(
    pod: dict[str, Any],
    container: dict[str, Any],
    k8s_config: tuple[Any, ServerConfig],
    k8s_object: Callable[[str], dict[str, Any]],
) -> None:
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    _, config = k8s_config
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config.data_dir)]
    assert data["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == data["name"]]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    configmap = k8s_object("ConfigMap")["metadata"]["name"]
    assert {"name": configmap} in [v.get("configMap") for v in pod["volumes"]]
    # The image's non-root user.
    useradd = re.search(r"--uid (\d+)", " ".join(Dockerfile.read().values("RUN")))
    assert useradd and pod["securityContext"]["runAsUser"] == int(useradd.group(1))
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_probes_are_grpc_health_checks_on_the_serving_port(
    container: dict[str, Any], k8s_config: tuple[Any, ServerConfig]
) -> None:
    _, config = k8s_config
    assert config.host == EVERY_INTERFACE, "the kubelet probes the pod's address"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == config.port, probe
        assert container[probe]["grpc"].get("service", "") == "", probe
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": config.port,
        "metrics": config.metrics_port,
        "bulk": config.bulk_port,
    }
    # The exec probe the comments offer for TLS uses real flags too.
    for line in (K8S / "deployment.yaml").read_text().splitlines():
        if line.strip().startswith("#") and "exec:" in line:
            command = yaml.safe_load(line.strip().lstrip("#").strip())["exec"]["command"]
            probe = batchwire(command)
            assert probe.address == f"localhost:{config.port}" and probe.tls_ca


def test_termination_grace_outlasts_the_drain(
    pod: dict[str, Any], container: dict[str, Any], k8s_config: tuple[Any, ServerConfig]
) -> None:
    args, _ = k8s_config
    assert pod["terminationGracePeriodSeconds"] > args.grace
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > args.grace, (
        "a draining server reports NOT_SERVING: liveness must not restart it first"
    )
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "room for warm-up"


def test_headless_service_and_disruption_budget_select_the_pods(
    deployment: dict[str, Any],
    k8s_config: tuple[Any, ServerConfig],
    k8s_object: Callable[[str], dict[str, Any]],
) -> None:
    _, config = k8s_config
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = k8s_object("Service")
    assert service["spec"]["clusterIP"] == "None", "headless: DNS returns every pod"
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == config.port and ports["grpc"]["targetPort"] == "grpc"
    pdb = k8s_object("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    # The name trainers dial: the Service's name in its namespace.
    namespace = k8s_object("Namespace")["metadata"]["name"]
    name = f"dns:///{service['metadata']['name']}.{namespace}.svc.cluster.local:{config.port}"
    assert name in (ROOT / "docs" / "deployment.md").read_text()


# -- README ----------------------------------------------------------------------------


def test_the_docs_document_every_serve_flag_and_logging_option() -> None:
    readme = "\n".join(
        path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {
        option
        for action in [*parser._actions, *serve._actions]
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    missing = sorted(f for f in flags if f not in readme)
    assert not missing, f"the docs do not mention {missing}"
    # The settings tables name variables without their BATCHWIRE_ prefix.
    variables = [setting.variable for setting in settings()]
    variables += [
        "BATCHWIRE_CONFIG",
        "BATCHWIRE_LOG_LEVEL",
        "BATCHWIRE_LOG_FORMAT",
    ]
    missing = [
        v for v in variables if v not in readme and f"`{v.removeprefix('BATCHWIRE_')}" not in readme
    ]
    assert not missing, f"the docs do not mention {missing}"
    for path in ("deploy/compose.cpu.yaml", "deploy/compose.secure.yaml", "deploy/k8s"):
        assert path in readme and (ROOT / path).exists()
