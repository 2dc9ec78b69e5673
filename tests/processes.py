"""`batchwire serve` as a real process on a free port, for tests that kill or signal it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The `batchwire` command of the Python running the tests.
PYTHON_BATCHWIRE = [sys.executable, "-m", "batchwire.cli"]


@dataclasses.dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    address: str
    log: pathlib.Path
    start_line: str = ""  # what it printed first: "batchwire serving DIR with N workers on ..."


def wait_until_serving(address: str, timeout: float) -> None:
    """Follow the health service's Watch stream (the server already listens) to SERVING."""
    with grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout
        )
        for reply in watch:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
    raise AssertionError(f"{address} ended the health stream before SERVING")


@contextlib.contextmanager
def serve_process(
    data_dir: pathlib.Path,
    log: pathlib.Path,
    *args: str,
    launcher: Sequence[str] = (),
    threads: bool = True,
) -> Iterator[ServeProcess]:
    """Start `batchwire serve` on localhost:0 (under ``launcher``, e.g. taskset, and with
    one DALI thread unless ``threads`` is false), wait for SERVING, kill it on exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    command = [
        *launcher,
        *PYTHON_BATCHWIRE,
        "serve",
        "--data-dir",
        str(data_dir),
        "--host",
        "localhost",
        "--port",
        "0",
        "--device",
        "cpu",
        *(("--num-threads", "1") if threads else ()),
        *args,
    ]
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r"on localhost:(\d+)", line)
        assert match, f"unexpected first line {line!r}; log: {log.read_text()[-2000:]}"
        address = f"localhost:{match.group(1)}"
        wait_until_serving(address, timeout=120)
        yield ServeProcess(process, address, log, line.strip())
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()
