"""`docker compose up`, run for real: README's offline image on a real Docker Engine.

As an operator would: deploy/Dockerfile built with no network from a local Debian image and
a wheelhouse; ``docker compose -f deploy/compose.yaml -f deploy/compose.cpu.yaml up -d``
(plus an override that puts the service on the host's network, so that no Docker network
is made); Docker's own health status; a RemoteLoader on the host trains an epoch; and
``docker compose stop`` in the middle of a stream. Then the same with compose.secure.yaml.

Runs as root where ``dockerd`` and Compose v2 are installed (``deploy/debian-host.sh
install-docker``; CI does), and skips with the reason elsewhere; ``BATCHWIRE_DOCKER_TESTS=0``
skips it on purpose. It reports each step's time on the terminal.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from certs import make_authority
from conftest import class_of
from dockerhost import (
    CACHE,
    IMAGE,
    Engine,
    Unavailable,
    build,
    cache_bytes,
    compose_files,
    prepare_offline_build,
    wait_healthy,
)

from batchwire.client import AuthenticationError, RemoteLoader, UnavailableError
from batchwire.server.data import Manifest, ingest, write_image_folders

PORT = 50051  # compose.yaml's ports, on the host's network
METRICS_PORT = 9405
UID = 10001  # the image's batchwire user
TOKEN = "compose-test-token"
PER_CLASS = 300  # 4 classes: 1,200 samples, 60 batches of 20
BATCH = 20
SIZE = 96  # 20 x 3 x 96 x 96 float32: 2.2 MB a batch, so a slow trainer holds the stream
PARAMS = {"size": SIZE}
# A cold run builds the base image, the wheelhouse and the image within its first test.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

# Every service on the host's network, nothing published: Compose makes no network.
HOST_NETWORK = """\
services:
  batchwire:
    network_mode: host
    ports: !reset []
  prometheus:
    network_mode: host
    ports: !reset []
"""


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    if os.environ.get("BATCHWIRE_DOCKER_TESTS", "1") == "0":
        pytest.skip("BATCHWIRE_DOCKER_TESTS=0")
    plugins = request.config.pluginmanager
    terminal = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")

    def report(line: str) -> None:
        """A line on the terminal, also under pytest's capture (CI's log shows the run)."""
        if terminal is None:
            return
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            terminal.write_line(f"[docker] {line}")

    engine = Engine(CACHE, report)
    try:
        engine.start()
    except Unavailable as why:
        engine.stop()
        pytest.skip(f"no Docker Engine: {why}")
    try:
        yield engine
    finally:
        engine.stop()
        report("engine stopped, its containers removed")
        report(
            f"kept for the next run: {cache_bytes() / 1e9:.1f} GB in {CACHE} "
            f"(rm -rf {CACHE} removes it)"
        )


@pytest.fixture(scope="module")
def wheelhouse(engine: Engine) -> pathlib.Path:
    return prepare_offline_build(engine, torch.__version__.split("+")[0])


@pytest.fixture(scope="module")
def image(engine: Engine, wheelhouse: pathlib.Path) -> str:
    done = build(engine, wheelhouse, IMAGE)
    assert done.returncode == 0, f"docker build failed:\n{done.stderr[-4000:]}"
    return IMAGE


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A dataset the container's user (uid 10001) can read, as README asks of operators."""
    root = tmp_path_factory.mktemp("compose-data")
    write_image_folders(root / "images", per_class=PER_CLASS, size=64, seed=3)
    ingest(root / "images", root / "datasets", name="shapes", shard_size=400)
    for path in [root / "datasets", *(root / "datasets").rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root / "datasets"


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Stack:
    """``docker compose -f ... up -d`` of the deploy files, with the host-network override."""

    def __init__(self, engine: Engine, override: pathlib.Path, env: dict[str, str]) -> None:
        self.engine = engine
        self.override = override
        self.env = env
        self.files: list[str] = []

    def compose(self, *args: str, timeout: float = 180) -> str:
        done = self.engine.docker("compose", *self.files, *args, env=self.env, timeout=timeout)
        return done.stdout

    def up(self, *names: str) -> str:
        """``up -d`` and Docker's health status healthy; the container's id."""
        self.files = compose_files(*names, override=self.override)
        started = time.monotonic()
        self.compose("up", "-d")
        container = self.compose("ps", "-a", "-q", "batchwire").strip()
        healthy = wait_healthy(self.engine, container, timeout=180)
        self.engine.report(
            f"{' + '.join(names)}: healthy {time.monotonic() - started:.0f} s after up -d"
            f" (health checks for {healthy:.0f} s)"
        )
        # The host's network only: Compose made no network of its own.
        networks = self.engine.docker("network", "ls", "--format", "{{.Name}}").stdout.split()
        assert set(networks) <= {"host", "none"}, networks
        return container

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "batchwire")


@pytest.fixture
def stack(
    engine: Engine,
    image: str,
    datasets: pathlib.Path,
    tmp_path: pathlib.Path,
    request: pytest.FixtureRequest,
) -> Iterator[Stack]:
    """Compose's project; its logs kept in the cache folder, and ``down`` at the end."""
    busy = [port for port in (PORT, METRICS_PORT) if not port_free(port)]
    assert not busy, f"ports {busy} are taken on this host: the service needs them"
    override = tmp_path / "compose.host-network.yaml"
    override.write_text(HOST_NETWORK)
    stack = Stack(engine, override, {"BATCHWIRE_DATA": str(datasets)})
    try:
        yield stack
    finally:
        if stack.files:
            log = engine.cache / f"{request.node.name}.log"
            try:
                log.write_text(stack.logs())
                engine.report(f"the service's log: {log}")
            finally:
                stack.compose("down", "--remove-orphans", "--timeout", "40", timeout=120)


def epoch(loader: RemoteLoader, manifest: Manifest, pause: float = 0.0) -> list[int]:
    ids: list[int] = []
    for images, labels, batch_ids in loader:
        assert tuple(images.shape) == (len(batch_ids), 3, SIZE, SIZE)
        assert (labels.numpy() == class_of(manifest, batch_ids.numpy())).all()
        ids += batch_ids.tolist()
        time.sleep(pause)
    return ids


def test_compose_up_serves_an_exact_epoch_and_stops_cleanly(
    stack: Stack, datasets: pathlib.Path
) -> None:
    container = stack.up("compose.yaml", "compose.cpu.yaml")
    engine = stack.engine
    manifest = Manifest.load(datasets / "shapes")
    total = manifest.num_samples

    # The server runs as the image's user, and /data is read-only.
    assert stack.compose("exec", "-T", "batchwire", "id", "-u").strip() == str(UID)
    write = engine.docker("exec", container, "touch", "/data/shapes/x", check=False)
    assert write.returncode != 0 and "Read-only file system" in write.stderr, write
    mounts = {m["Destination"]: m for m in engine.inspect(container)["Mounts"]}
    assert mounts["/data"]["RW"] is False

    loader = RemoteLoader(
        f"localhost:{PORT}",
        dataset="shapes",
        batch_size=BATCH,
        return_ids=True,
        params=PARAMS,
        seed=11,
    )
    with loader:
        first = epoch(loader, manifest)
    assert sorted(first) == list(range(total)), "an epoch: every sample once"

    with urllib.request.urlopen(f"http://localhost:{METRICS_PORT}/metrics", timeout=10) as got:
        metrics = got.read().decode()
    assert "batchwire_serving 1.0" in metrics
    sent = re.search(
        r'batchwire_samples_sent_total\{dataset="shapes",pipeline="train"\} (\S+)', metrics
    )
    assert sent and float(sent.group(1)) >= total, metrics[-2000:]

    # `docker compose stop` while a stream is still sending: the server drains and exits 0,
    # and the loader resumes once the service is started again; the epoch is exact.
    received: list[int] = []
    errors: list[BaseException] = []
    reading = threading.Event()

    def train() -> None:
        try:
            with RemoteLoader(
                f"localhost:{PORT}",
                dataset="shapes",
                batch_size=BATCH,
                return_ids=True,
                params=PARAMS,
                seed=11,
                retry_timeout=240,
            ) as again:
                again.set_epoch(1)
                for _, _, ids in again:
                    received.extend(ids.tolist())
                    reading.set()
                    time.sleep(0.1)  # a trainer's step: the stream is still sending
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    assert reading.wait(120), "no batch before the stop"
    at_stop = len(received)
    stopped = time.monotonic()
    stack.compose("stop", timeout=120)
    stop_seconds = time.monotonic() - stopped
    state = engine.inspect(container)["State"]
    assert state["Status"] == "exited" and state["ExitCode"] == 0, state
    # The server's own account, as README's "Draining" says: the stream was still sending
    # when SIGTERM came, and it ended with UNAVAILABLE at its next batch.
    logs = stack.logs()
    after = logs[logs.index("SIGTERM received") :]
    ended = re.findall(r"stream end .* samples=(\d+) .*status=(\w+)", after)
    assert ended, f"no stream was in flight at the stop:\n{logs[-3000:]}"
    (sent, status), *_ = ended
    assert status == "UNAVAILABLE" and int(sent) < total, ended
    # The loader waits (retry_timeout) for the service to come back, and resumes.
    stack.compose("start")
    wait_healthy(engine, container, timeout=180)
    trainer.join(300)
    assert not trainer.is_alive() and not errors, errors
    engine.report(
        f"compose stop with {at_stop} of {total} samples read, {sent} sent: exit 0 after"
        f" {stop_seconds:.0f} s; the loader resumed after compose start"
    )
    assert sorted(received) == list(range(total)), "nothing lost, nothing twice"
    assert received != first, "epoch 1 is another order than epoch 0"


def test_compose_secure_enforces_tls_and_the_token(
    stack: Stack, datasets: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BATCHWIRE_TOKEN", raising=False)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    authority = make_authority(tmp_path, "compose-test")
    issued = authority.issue("server", hosts=("localhost",))
    (secrets / "server.pem").write_bytes(issued.cert.read_bytes())
    (secrets / "server.key").write_bytes(issued.key.read_bytes())
    (secrets / "ca.pem").write_bytes(authority.cert.read_bytes())
    (secrets / "tokens").write_text(f"{TOKEN}\n")
    for name in ("server.key", "tokens"):  # as compose.secure.yaml's header says
        os.chown(secrets / name, UID, -1)
        (secrets / name).chmod(0o400)
    secrets.chmod(0o755)
    stack.env["BATCHWIRE_SECRETS"] = str(secrets)
    stack.up("compose.yaml", "compose.cpu.yaml", "compose.secure.yaml")
    manifest = Manifest.load(datasets / "shapes")

    address = f"localhost:{PORT}"
    with (
        RemoteLoader(
            address,
            dataset="shapes",
            batch_size=BATCH,
            params=PARAMS,
            tls_ca=authority.cert,
            token=None,
        ) as refused,
        pytest.raises(AuthenticationError),
    ):
        next(iter(refused))
    with RemoteLoader(
        address,
        dataset="shapes",
        batch_size=BATCH,
        return_ids=True,
        params=PARAMS,
        tls_ca=authority.cert,
        token=TOKEN,
    ) as loader:
        ids = epoch(loader, manifest)
    assert sorted(ids) == list(range(manifest.num_samples))
    # Plain text is refused by the TLS port.
    with (
        RemoteLoader(
            address, dataset="shapes", batch_size=BATCH, params=PARAMS, token=TOKEN, retry_timeout=2
        ) as plain,
        pytest.raises(UnavailableError),
    ):
        next(iter(plain))
    stack.engine.report("compose.secure.yaml: no token refused, TLS + token an exact epoch")


def test_a_package_that_cannot_run_fails_the_build(
    engine: Engine, wheelhouse: pathlib.Path
) -> None:
    """The defect that once shipped: an empty ``__init__.py`` in the wheel. The build itself
    fails (its last step runs the entrypoint), not the container at start."""

    def empty_cli(context: pathlib.Path) -> None:
        (context / "src" / "batchwire" / "cli" / "__init__.py").write_text("")

    done = build(engine, wheelhouse, "batchwire:broken", change=empty_cli)
    assert done.returncode != 0, "a wheel with an empty batchwire/cli/__init__.py was built"
    output = done.stdout + done.stderr
    assert "cannot import name 'main' from 'batchwire.cli'" in output, output[-3000:]
    missing = engine.docker("image", "inspect", "batchwire:broken", check=False)
    assert missing.returncode != 0, "no image is tagged"
    engine.report("an empty batchwire/cli/__init__.py fails docker build at its last step")
