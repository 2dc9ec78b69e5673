"""``batchwire serve`` in a child process for the runs to stream from
(:class:`LocalServer`: on a free localhost port, with a config file of the settings a run
gives it, waited for until SERVING with :func:`wait_serving`), and the error of one that
exits before it listens (:class:`ServerStartError`)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping

__all__ = ["LocalServer", "ServerStartError", "wait_serving"]


class ServerStartError(RuntimeError):
    """``batchwire serve`` exited before it listened (its own message is on stderr)."""


class LocalServer:
    """``batchwire serve`` in a child process on a free localhost port.

    It serves the server's preset pipelines (train and val), or the config's ``[pipelines]``
    table ``pipelines`` where given, on ``device`` (auto, cpu or gpu); with ``metrics``,
    ``/metrics`` too, on the free port :attr:`metrics_port`. Its config file is written in
    ``work``, or in a temporary directory of its own, removed when it closes.
    """

    def __init__(
        self,
        data_dir: pathlib.Path,
        work: pathlib.Path | None = None,
        *,
        cpus: str | None = None,
        threads: int = 0,
        max_message_bytes: int | None = None,
        max_streams: int | None = None,
        read_ahead_reads: int | None = None,
        port: int = 0,
        device: str = "auto",
        metrics: bool = False,
        pipelines: str = "",
        settings: Mapping[str, object] | None = None,
    ) -> None:
        self._own_work = None
        if work is None:
            self._own_work = tempfile.TemporaryDirectory(prefix="batchwire-bench-")
            work = pathlib.Path(self._own_work.name)
        config = work / f"bench-server-{os.getpid()}-{id(self)}.toml"
        table: dict[str, object] = {
            "num_threads": threads,
            "device": device,
            "max_message_bytes": max_message_bytes,
            "max_streams": max_streams,
            "read_ahead_reads": read_ahead_reads,
            "metrics_port": 0 if metrics else None,  # any free port, printed at start
            **(settings or {}),  # any other [server] setting, e.g. workers
        }
        config.write_text(_server_table(table) + pipelines)
        command = _serve_command(data_dir, config, port, cpus)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        # "batchwire serving DIR on localhost:PORT[; metrics on port PORT]"
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r" on localhost:(\d+)(?:; metrics on port (\d+))?$", line.strip())
        if match is None:
            self.close()
            printed = f" (it printed {line.strip()!r})" if line.strip() else ""
            raise ServerStartError(
                f"batchwire serve exited with status {self.process.returncode} before it "
                f"listened: its error is above{printed}"
            )
        self.address = f"localhost:{match.group(1)}"
        self.metrics_port = int(match.group(2)) if match.group(2) else None
        wait_serving(self.address, 180.0)

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self._own_work is not None:
            self._own_work.cleanup()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _serve_command(
    data_dir: pathlib.Path, config: pathlib.Path, port: int, cpus: str | None
) -> list[str]:
    """``batchwire serve`` of ``data_dir`` with ``config`` on localhost, pinned to ``cpus``."""
    command = [
        sys.executable,
        "-m",
        "batchwire.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--data-dir",
        str(data_dir),
        "--config",
        str(config),
        "--host",
        "localhost",
        "--port",
        str(port),
    ]
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    return command


def _server_table(settings: dict[str, object]) -> str:
    """A config file's ``[server]`` table of the settings that are not None; no
    ``[pipelines]`` table, so the server serves its presets, train and val."""
    lines = ["[server]"]
    for name, value in settings.items():
        if value is not None:
            if isinstance(value, bool):
                lines.append(f"{name} = {str(value).lower()}")
            else:
                text = f'"{value}"' if isinstance(value, str) else value
                lines.append(f"{name} = {text}")
    return "\n".join(lines) + "\n"


def wait_serving(address: str, timeout: float) -> None:
    """Until the server at ``address`` (plaintext) says SERVING on the health service's
    Watch stream, for at most ``timeout`` seconds; RuntimeError if it stops before."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=timeout
        )
        for reply in watch:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return
    raise RuntimeError(f"{address} stopped before it was SERVING")
