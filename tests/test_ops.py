"""What ops run, run for real: the container's command line as a process, checked by a
health client in another language (Node's @grpc/grpc-js); JSON logs; the TLS compose
variant; the choice of GPUs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from certs import make_authority
from conftest import Compose
from deployfiles import ROOT, Dockerfile, duration_seconds
from processes import PYTHON_BATCHWIRE, serve_process, wait_until_serving

from batchwire.cli import build_parser, main
from batchwire.cli._logs import JsonFormatter, choose
from batchwire.cli._serve import resolve_config
from batchwire.client import AuthenticationError, RemoteLoader
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer, ConfigError
from batchwire.server.engine import DeviceError, DevicePlan
from batchwire.server.serving._messages import Lane

NODE = ROOT / "tests" / "node"


# -- the container's command line, run as a process ------------------------------------


@dataclasses.dataclass
class Container:
    """`batchwire serve` started with the image's entrypoint, environment and compose's
    command, only /data and the ports changed."""

    process: subprocess.Popen[str]
    port: int
    metrics_port: int
    grace: float
    stop_grace_period: float
    healthcheck: list[str]
    log: pathlib.Path


def localized(words: list[str], data_dir: pathlib.Path, ports: dict[str, str]) -> list[str]:
    """Replace /data with ``data_dir`` and each port with ``ports[port]``."""
    out = []
    for word in words:
        if word == "/data":
            word = str(data_dir)
        elif word in ports:
            word = ports[word]
        else:
            for port, local in ports.items():
                word = word.replace(f"localhost:{port}", f"localhost:{local}")
        out.append(word)
    return out


@pytest.fixture(scope="module")
def container(
    data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, docker_compose: Compose
) -> Iterator[Container]:
    image = Dockerfile.read()
    data = {"BATCHWIRE_DATA": str(data_dir)}
    service = docker_compose("compose.yaml", environ=data)["services"]["batchwire"]
    args = build_parser().parse_args([*image.exec_form("ENTRYPOINT")[1:], *service["command"]])
    # Port 0: "any free port"; the process prints the ports it got.
    ports = {str(args.port): "0", str(args.metrics_port): "0"}
    entrypoint = image.exec_form("ENTRYPOINT")
    assert entrypoint[0] == "batchwire"
    command = [*PYTHON_BATCHWIRE, *entrypoint[1:], *localized(service["command"], data_dir, ports)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    for key, value in {**image.env, **service["environment"]}.items():
        environ[key] = localized([value], data_dir, ports)[0]
    log = tmp_path_factory.mktemp("container") / "serve.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=environ
        )
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r" on \S+:(\d+); metrics on port (\d+)$", line.strip())
        assert match, f"unexpected first line {line!r}; log: {log.read_text()[-2000:]}"
        port, metrics_port = int(match.group(1)), int(match.group(2))
        wait_until_serving(f"localhost:{port}", timeout=120)
        yield Container(
            process=process,
            port=port,
            metrics_port=metrics_port,
            grace=args.grace,
            stop_grace_period=duration_seconds(service["stop_grace_period"]),
            healthcheck=localized(
                service["healthcheck"]["test"][1:], data_dir, {str(args.port): str(port)}
            ),
            log=log,
        )
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def node_modules() -> pathlib.Path:
    """tests/node/ with its locked dependencies installed, in a cache directory keyed
    by the lock file (skips when Node or npm is missing, or npm cannot reach its
    registry)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("Node.js and npm are needed for the non-Python gRPC health client")
    lock = (NODE / "package-lock.json").read_bytes()
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    directory = cache / "batchwire-tests" / f"node-{hashlib.sha256(lock).hexdigest()[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json", "health.js", "health.proto"):
        shutil.copyfile(NODE / name, directory / name)
    if not (directory / "node_modules" / "@grpc" / "grpc-js").is_dir():
        result = subprocess.run(
            [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=240,
        )
        offline = re.search(
            r"ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ETIMEDOUT|ENETUNREACH", result.stderr
        )
        if result.returncode != 0 and offline:
            pytest.skip(f"npm cannot reach its registry: {offline.group(0)}")
        assert result.returncode == 0, f"npm ci failed:\n{result.stderr[-3000:]}"
    return directory


def node_health(address: str, *services: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["node", str(node_modules() / "health.js"), address, *services],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_container_command_line_reports_serving_to_a_node_grpc_client(
    container: Container,
) -> None:
    checked = node_health(f"localhost:{container.port}", "", "batchwire.v1.Batchwire")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines() == ['"" SERVING', '"batchwire.v1.Batchwire" SERVING']
    # A service the server does not have is no false positive.
    unknown = node_health(f"localhost:{container.port}", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_the_compose_healthcheck_passes_and_metrics_are_served(container: Container) -> None:
    healthcheck = subprocess.run(
        [*PYTHON_BATCHWIRE, *container.healthcheck[1:]], capture_output=True, text=True, timeout=60
    )
    assert healthcheck.returncode == 0, healthcheck.stderr
    assert "SERVING" in healthcheck.stdout
    with RemoteLoader(
        f"localhost:{container.port}", dataset="shapes", batch_size=16, params={"size": 32}
    ) as loader:
        images, labels = next(iter(loader))
    assert tuple(images.shape) == (16, 3, 32, 32) and len(labels) == 16
    url = f"http://localhost:{container.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert "batchwire_serving 1.0" in text
    assert re.search(r'batchwire_samples_sent_total\{dataset="shapes",pipeline="train"\} \d', text)


def test_the_container_drains_on_sigterm_within_its_stop_grace_period(
    container: Container,
) -> None:
    started = time.monotonic()
    container.process.send_signal(signal.SIGTERM)
    assert container.process.wait(timeout=container.stop_grace_period) == 0
    assert time.monotonic() - started < container.stop_grace_period
    assert "SIGTERM received" in container.log.read_text()
    gone = subprocess.run(
        [*PYTHON_BATCHWIRE, *container.healthcheck[1:], "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 1 and "is `batchwire serve` running there?" in gone.stderr


# -- logs ------------------------------------------------------------------------------


def test_json_logs_have_one_object_per_line_with_stream_start_and_end(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with serve_process(data_dir, tmp_path / "serve.log", "--log-format", "json") as served:
        with RemoteLoader(
            served.address,
            dataset="shapes",
            pipeline="val",
            batch_size=20,
            rank=1,
            world_size=2,
            params={"size": 32},
        ) as loader:
            received = sum(len(labels) for _, labels in loader)
        assert received == 260

        def entries() -> list[dict[str, Any]]:
            lines = served.log.read_text().splitlines()
            return [json.loads(line) for line in lines if line.strip()]

        deadline = time.monotonic() + 60
        while not any(e.get("event") == "stream_end" for e in entries()):
            assert time.monotonic() < deadline, f"no stream_end line: {served.log.read_text()}"
            time.sleep(0.05)
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=30) == 0
    logged = entries()  # every line parses as JSON, or json.loads raised
    assert all({"time", "level", "logger", "message"} <= e.keys() for e in logged)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", e["time"]) for e in logged)
    (start,) = [e for e in logged if e.get("event") == "stream_start"]
    (end,) = [e for e in logged if e.get("event") == "stream_end"]
    for entry in (start, end):
        assert entry["dataset"] == "shapes" and entry["pipeline"] == "val"
        assert entry["rank"] == 1 and entry["world_size"] == 2
        assert re.match(r"ipv[46]:", entry["peer"]), entry["peer"]
        assert entry["level"] == "INFO" and entry["logger"] == "batchwire.server.serving._servicer"
    assert end["samples"] == 260 and end["batches"] == 13 and end["status"] == "OK"
    assert isinstance(end["duration_s"], float) and end["duration_s"] >= 0
    assert end["message"].startswith("stream end ")


@pytest.mark.parametrize("drop_last", [True, False])
def test_the_lanes_of_a_share_interleave_to_the_whole_share(drop_last: bool) -> None:
    # StreamBatches calls that split a share into lanes (batch k in lane k % lanes) get,
    # together, every batch of the share from the cursor on, each once, each lane in
    # order; the stream end status counts a lane's batches from the same list.
    for samples, batch, world, lanes in itertools.product(
        (0, 1, 7, 20), (1, 3, 8), (1, 3), (1, 2, 5)
    ):
        for rank in range(world):
            plan = Plan(
                num_samples=samples,
                batch_size=batch,
                rank=rank,
                world_size=world,
                drop_last=drop_last,
            )
            for start in range(plan.share_size + 1):
                resumed = dataclasses.replace(plan, start=start)
                whole = [b.index for b in resumed.batches()]
                per_lane = [list(Lane(lane, lanes).batches(resumed)) for lane in range(lanes)]
                assert sorted(i for got in per_lane for i in got) == whole, resumed
                for lane, got in enumerate(per_lane):
                    assert got == sorted(got) and all(i % lanes == lane for i in got)


def test_log_settings_come_from_flags_then_the_environment() -> None:
    assert choose(None, None, {}) == ("INFO", "plain")
    assert choose(None, None, {}, "WARNING") == ("WARNING", "plain")
    environ = {"BATCHWIRE_LOG_FORMAT": "JSON", "BATCHWIRE_LOG_LEVEL": "debug"}
    assert choose(None, None, environ) == ("DEBUG", "json")
    assert choose("ERROR", "plain", environ) == ("ERROR", "plain")
    # Before or after the command: a container's arguments follow `batchwire serve`.
    for argv in (
        ["--log-format", "json", "serve"],
        ["serve", "--log-format", "json"],
    ):
        assert build_parser().parse_args(argv).log_format == "json"
    assert build_parser().parse_args(["serve"]).log_format is None


def test_a_bad_log_setting_in_the_environment_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHWIRE_LOG_FORMAT", "xml")
    assert main(["health", "--address", "localhost:1"]) == 2
    assert "BATCHWIRE_LOG_FORMAT" in capsys.readouterr().err


def test_json_formatter_keeps_extra_fields_and_tracebacks() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.getLogger("x").makeRecord(
            "x",
            logging.ERROR,
            __file__,
            1,
            "stream failed: %s",
            ("shapes",),
            sys.exc_info(),
            extra={"peer": "ipv4:127.0.0.1:1", "ids": (1, 2), "path": pathlib.Path("/d")},
        )
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "stream failed: shapes" and entry["level"] == "ERROR"
    assert entry["peer"] == "ipv4:127.0.0.1:1" and entry["ids"] == [1, 2] and entry["path"] == "/d"
    assert "RuntimeError: boom" in entry["exception"]
    assert "\n" not in JsonFormatter().format(record)


# -- the TLS compose variant, with real certificates -----------------------------------


@pytest.mark.slow
def test_the_secure_compose_variant_serves_tls_and_its_healthcheck_passes(
    data_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    docker_compose: Compose,
) -> None:
    authority = make_authority(tmp_path, "ops")
    issued = authority.issue("server", hosts=("localhost",))
    secrets = {
        "batchwire_tls_cert": issued.cert,
        "batchwire_tls_key": issued.key,
        "batchwire_tls_ca": authority.cert,
        "batchwire_tokens": tmp_path / "tokens",
    }
    secrets["batchwire_tokens"].write_text("a-token-for-trainers\n")
    data = {"BATCHWIRE_DATA": str(data_dir)}
    document = docker_compose("compose.yaml", "compose.secure.yaml", environ=data)
    service = document["services"]["batchwire"]

    def mounted(words: list[str]) -> list[str]:
        return [
            str(secrets[w.removeprefix("/run/secrets/")]) if w.startswith("/run/secrets/") else w
            for w in words
        ]

    image = Dockerfile.read()
    args = build_parser().parse_args(
        [*image.exec_form("ENTRYPOINT")[1:], *localized(mounted(service["command"]), data_dir, {})]
    )
    args.port, args.host, args.metrics_port = 0, "localhost", 0
    environ = {**image.env, **service["environment"], "BATCHWIRE_DATA_DIR": str(data_dir)}
    config = resolve_config(args, environ)
    server = BatchwireServer(config)
    server.start()
    try:
        assert server.wait_serving(120)
        healthcheck = mounted(service["healthcheck"]["test"][1:])
        healthcheck = [w.replace("localhost:50051", server.target) for w in healthcheck]
        assert main(healthcheck[1:]) == 0
        assert "SERVING" in capsys.readouterr().out
        # Without the CA the same probe cannot trust the server.
        no_ca = healthcheck[: healthcheck.index("--tls-ca")]
        assert main([*no_ca[1:], "--timeout", "2"]) == 1
        # The data service itself still needs the token.
        with (
            pytest.raises(AuthenticationError, match="token"),
            RemoteLoader(server.target, dataset="shapes", tls_ca=authority.cert) as loader,
        ):
            next(iter(loader))
    finally:
        server.stop(grace=1.0)


# -- several GPUs ----------------------------------------------------------------------


def serve_config(*flags: str, environ: dict[str, str] | None = None) -> Any:
    args = build_parser().parse_args(["serve", "--data-dir", "/data", *flags])
    return resolve_config(args, environ or {})


def test_devices_flag_environment_and_config_file(tmp_path: pathlib.Path) -> None:
    assert serve_config("--devices", "0,1").devices == (0, 1)
    assert serve_config("--devices", "all").devices == ()
    assert serve_config().devices == ()
    assert serve_config(environ={"BATCHWIRE_DEVICES": "1, 0"}).devices == (1, 0)
    assert serve_config("--devices", "2", environ={"BATCHWIRE_DEVICES": "1"}).devices == (2,)
    config_file = tmp_path / "server.toml"
    config_file.write_text("[server]\ndevices = [3, 1]\n")
    assert serve_config("--config", str(config_file)).devices == (3, 1)


@pytest.mark.parametrize(
    ("value", "message"),
    [("0,0", "distinct"), ("one", "comma-separated"), ("-1", "distinct"), ("0,,1", "comma")],
)
def test_bad_devices_say_what_to_write(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", f"--devices={value}"])
    error = capsys.readouterr().err
    assert "--devices" in error and message in error
    with pytest.raises(ConfigError, match=f"BATCHWIRE_DEVICES.*{message}"):
        serve_config(environ={"BATCHWIRE_DEVICES": value})


def test_devices_cannot_be_combined_with_the_cpu() -> None:
    with pytest.raises(ConfigError, match="cannot be combined with device = cpu"):
        serve_config("--device", "cpu", "--devices", "0")


@pytest.mark.parametrize(
    ("mode", "devices", "gpus", "expected"),
    [
        ("auto", (), 4, (0, 1, 2, 3)),  # default: every visible GPU
        ("auto", (2, 0), 4, (2, 0)),  # streams go to GPU 2, then 0, then 2, ...
        ("gpu", (1,), 2, (1,)),
        ("auto", (0, 1), 0, (None,)),  # no GPU at all: the CPU
    ],
)
def test_device_plan_spreads_streams_over_the_chosen_gpus(
    mode: str, devices: tuple[int, ...], gpus: int, expected: tuple[int | None, ...]
) -> None:
    plan = DevicePlan.resolve(mode, devices, gpu_count=gpus)
    assert plan.device_ids == expected
    assert plan.kind == ("cpu" if expected == (None,) else "gpu")


def test_a_gpu_id_the_host_does_not_have_is_refused() -> None:
    with pytest.raises(DeviceError, match=r"GPU ids \[2\] are not visible \(this host sees 2"):
        DevicePlan.resolve("gpu", (0, 2), gpu_count=2)


def test_json_logs_carry_what_c_libraries_print_as_json_records() -> None:
    # libjpeg and libpng (inside DALI's decoders) print warnings straight to file
    # descriptors 1 and 2; in a JSON log they must be JSON lines too.
    code = """
import ctypes, time
from batchwire.cli import _logs
_logs.configure("INFO", "json")
libc = ctypes.CDLL(None)
libc.puts(b"libpng warning: iCCP: known incorrect sRGB profile")
libc.fflush(None)
libc.dprintf(2, b"Corrupt JPEG data: 12 extraneous bytes before marker 0xd9\\n")
print("batchwire serving data on [::]:50051", flush=True)
time.sleep(1.0)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == "batchwire serving data on [::]:50051\n"
    entries = [json.loads(line) for line in done.stderr.splitlines()]
    native = [e["message"] for e in entries if e["logger"] == "batchwire.native"]
    assert native == [
        "libpng warning: iCCP: known incorrect sRGB profile",
        "Corrupt JPEG data: 12 extraneous bytes before marker 0xd9",
    ]
