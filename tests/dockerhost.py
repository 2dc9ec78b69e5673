"""A Docker Engine of the tests' own, and the image built on it offline, as an operator would.

The engine is Debian's ``dockerd`` (``deploy/debian-host.sh install-docker``) started as
root with its own data root, exec root, pid file and socket, host networking only
(``--bridge=none --iptables=false --ip-masq=false``: no Docker network, no traffic to any
address but loopback). What is slow to make is kept between runs in ``$BATCHWIRE_DOCKER_CACHE``
(default ``/var/cache/batchwire-tests``): the Debian root filesystem the base image is
imported from, the wheelhouse, and the engine's data root with its build cache: about 8 GB
after a run. A data root over ``MAX_DATA_ROOT_BYTES`` is started afresh, and the build cache
is pruned to 12 GB after each build; nothing else removes it (``rm -rf`` it while no test
run holds it, as README says).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from deployfiles import DEPLOY, ROOT

CACHE = pathlib.Path(os.environ.get("BATCHWIRE_DOCKER_CACHE", "/var/cache/batchwire-tests"))
BASE_IMAGE = "batchwire-base:bookworm"
IMAGE = "batchwire:latest"
# A data root past this size is started afresh (a cold build) rather than left to grow.
MAX_DATA_ROOT_BYTES = 30 * 1024**3


class Unavailable(Exception):
    """Why no engine can run here (the tests skip with this reason)."""


Report = Callable[[str], None]


def docker_cli() -> str:
    """Debian's client, which goes with its engine; else any ``docker`` on PATH."""
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise Unavailable("no docker client: deploy/debian-host.sh install-docker (as root)")


def _tail(path: pathlib.Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def cache_bytes() -> int:
    """What the tests keep in ``CACHE`` between runs, in bytes (0 where it is absent)."""
    return _directory_bytes(CACHE) if CACHE.exists() else 0


def _directory_bytes(path: pathlib.Path) -> int:
    done = subprocess.run(
        ["du", "-sb", "--one-file-system", str(path)], capture_output=True, text=True
    )
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout else 0


def _stop_pid(pid: int, timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; waits for the process to be gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (containerd and its shims)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def _remove_run_dir(run_dir: pathlib.Path) -> None:
    """A stopped engine's exec root: what still runs from it (containerd's shims) is
    stopped, what dockerd left mounted there (its network namespace) unmounted."""
    for pid in _processes_mentioning(str(run_dir)):
        _stop_pid(pid, 5)
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted((p for p in points if p.startswith(f"{run_dir}/")), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=30)
    shutil.rmtree(run_dir, ignore_errors=True)


class Engine:
    """``dockerd`` on a socket of its own; ``stop()`` leaves nothing of it running."""

    def __init__(self, cache: pathlib.Path, report: Report) -> None:
        self.cache = cache
        self.report = report
        self.cli = docker_cli()
        self.data_root = cache / "engine"
        self.run_dir = pathlib.Path(tempfile.mkdtemp(prefix="bw-dockerd-", dir="/tmp"))
        self.socket = self.run_dir / "docker.sock"
        self.log = cache / "dockerd.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: Any = None

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "BATCHWIRE_"))}
        return {**env, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "1"}

    def start(self, timeout: float = 120) -> None:
        if sys.platform != "linux" or os.geteuid() != 0:
            raise Unavailable("the engine's tests run as root on Linux (they start dockerd)")
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise Unavailable("no dockerd: deploy/debian-host.sh install-docker (as root)")
        compose = subprocess.run(
            [self.cli, "compose", "version", "--short"], capture_output=True, text=True
        )
        if compose.returncode != 0 or not compose.stdout.startswith("2."):
            raise Unavailable("no Docker Compose v2: deploy/debian-host.sh install-docker")
        self.cache.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.cache / "lock", "w")  # noqa: SIM115 (held until stop)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Unavailable(f"another test run holds {self.cache}/lock") from None
        self._stop_leftover()
        if self.data_root.exists() and _directory_bytes(self.data_root) > MAX_DATA_ROOT_BYTES:
            self.report(f"{self.data_root} is over {MAX_DATA_ROOT_BYTES >> 30} GiB: a new one")
            shutil.rmtree(self.data_root)
        command = [
            dockerd,
            "--bridge=none",
            "--iptables=false",
            "--ip-masq=false",
            "--userland-proxy=false",
            f"--data-root={self.data_root}",
            f"--exec-root={self.run_dir / 'exec'}",
            f"--pidfile={self.run_dir / 'docker.pid'}",
            f"--host=unix://{self.socket}",
        ]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        (self.cache / "dockerd.pid").write_text(f"{self.process.pid} {self.run_dir}\n")
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise Unavailable(f"dockerd exited ({self.process.returncode}):\n{_tail(self.log)}")
            version = self.docker("version", "--format", "{{.Server.Version}}", check=False)
            if version.returncode == 0:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"dockerd did not answer in {timeout:.0f} s:\n{_tail(self.log)}")
            time.sleep(0.5)
        compose_version = compose.stdout.strip()
        self.report(f"Docker Engine {version.stdout.strip()}, Compose {compose_version}")

    def _stop_leftover(self) -> None:
        """The dockerd of a run that was killed before it could stop it (same data root)."""
        record = self.cache / "dockerd.pid"
        if not record.exists():
            return
        pid_text, _, run_dir = record.read_text().strip().partition(" ")
        with contextlib.suppress(OSError, ValueError):
            cmdline = pathlib.Path(f"/proc/{int(pid_text)}/cmdline").read_bytes()
            if b"dockerd" in cmdline and str(self.data_root).encode() in cmdline:
                self.report(f"stopping the dockerd a killed run left (pid {pid_text})")
                _stop_pid(int(pid_text), 30)
        if run_dir:
            _remove_run_dir(pathlib.Path(run_dir))
        record.unlink()

    def docker(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        cwd: pathlib.Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [self.cli, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
            cwd=cwd,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"docker {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
            )
        return done

    def inspect(self, name: str) -> dict[str, Any]:
        (found,) = json.loads(self.docker("inspect", name).stdout)
        return found  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Remove every container of this engine and stop it, containerd included."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(Exception):
                ids = self.docker("ps", "-aq", timeout=30).stdout.split()
                if ids:
                    self.docker("rm", "-f", *ids, timeout=60)
            _stop_pid(self.process.pid, 30)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
        _remove_run_dir(self.run_dir)
        with contextlib.suppress(FileNotFoundError):
            (self.cache / "dockerd.pid").unlink()
        if self._lock is not None:
            self._lock.close()
            self._lock = None


# -- the image ------------------------------------------------------------------------


def _timed(report: Report, what: str) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def timer() -> Iterator[None]:
        started = time.monotonic()
        yield
        report(f"{what}: {time.monotonic() - started:.0f} s")

    return timer()


def _build_context(into: pathlib.Path) -> pathlib.Path:
    """The checkout as git sees it (tracked and untracked files, not ignored ones): what an
    operator's clone holds, whatever else lies in this working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return into


def _link_tree(source: pathlib.Path, target: pathlib.Path) -> None:
    target.mkdir(parents=True)
    for path in source.iterdir():
        try:
            os.link(path, target / path.name)
        except OSError:
            shutil.copy2(path, target / path.name)


def prepare_offline_build(engine: Engine, torch_version: str) -> pathlib.Path:
    """What README's offline recipe makes before ``docker build``: the local Debian base
    image (debootstrap + ``docker import``) and a wheelhouse for its Python."""
    report = engine.report
    if engine.docker("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        with _timed(report, f"base image {BASE_IMAGE} (debootstrap + docker import)"):
            tarball = engine.cache / "rootfs-bookworm.tar"
            done = subprocess.run(
                [str(DEPLOY / "debian-host.sh"), "base-image", BASE_IMAGE, str(tarball)],
                capture_output=True,
                text=True,
                timeout=1200,
                env=engine.env,
            )
            assert done.returncode == 0, f"base image: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    python = engine.docker(
        *("run", "--rm", "--network", "none", "--entrypoint", "python3", BASE_IMAGE, "-c"),
        "import sys; print('%d.%d' % sys.version_info[:2])",
    )
    python_version = python.stdout.strip()
    wheelhouse = engine.cache / "wheelhouse"
    with _timed(report, f"wheelhouse for Python {python_version}: {wheelhouse}"):
        done = subprocess.run(
            [str(DEPLOY / "wheelhouse.sh"), python_version, "cpu", str(wheelhouse)],
            capture_output=True,
            text=True,
            timeout=1200,
            env={**os.environ, "PYTHON": sys.executable, "TORCH_VERSION": torch_version},
        )
        assert done.returncode == 0, f"wheelhouse: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return wheelhouse


def build(
    engine: Engine,
    wheelhouse: pathlib.Path,
    tag: str = IMAGE,
    change: Callable[[pathlib.Path], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``docker build`` of deploy/Dockerfile from the checkout with the wheelhouse in it
    (``change`` edits that copy first), with no network at all (``--network none``).
    The log is kept in the cache folder as TAG.log."""
    with tempfile.TemporaryDirectory(prefix="bw-context-") as directory:
        context = _build_context(pathlib.Path(directory))
        _link_tree(wheelhouse, context / "wheelhouse")
        if change is not None:
            change(context)
        log = engine.cache / f"{tag.replace(':', '-')}.log"
        with _timed(engine.report, f"docker build -t {tag} --network none (log: {log})"):
            done = engine.docker(
                *("build", "--network", "none", "--progress", "plain"),
                *("-f", "deploy/Dockerfile", "-t", tag),
                *("--build-arg", f"BASE_IMAGE={BASE_IMAGE}"),
                *("--build-arg", "WHEELHOUSE=wheelhouse"),
                ".",
                check=False,
                timeout=1800,
                cwd=context,
            )
            log.write_text(done.stdout + done.stderr)
    # Keep the cache from growing run after run: dangling images and old build cache go.
    engine.docker("image", "prune", "-f", check=False, timeout=300)
    engine.docker("builder", "prune", "-f", "--keep-storage", "12gb", check=False, timeout=300)
    return done


def compose_files(*names: str, override: pathlib.Path | None = None) -> list[str]:
    words = []
    for name in names:
        words += ["-f", str(DEPLOY / name)]
    if override is not None:
        words += ["-f", str(override)]
    return words


def wait_healthy(engine: Engine, container: str, timeout: float) -> float:
    """Seconds until Docker's own health status (the image's HEALTHCHECK) is healthy."""
    started = time.monotonic()
    while True:
        state = engine.inspect(container)["State"]
        health = state.get("Health", {}).get("Status")
        if health == "healthy":
            return time.monotonic() - started
        assert state["Status"] == "running", f"{container} is {state['Status']}: {state}"
        assert health != "unhealthy", f"{container} is unhealthy: {state['Health']['Log'][-1:]}"
        assert time.monotonic() - started < timeout, f"{container} not healthy in {timeout} s"
        time.sleep(1)
