"""`batchwire serve` as a real process on a free port, for tests that kill or signal it;
a trainer's code in a process of its own, for tests that fork DataLoader workers; and a
TCP forwarder, as a container's published port is."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pathlib
import queue
import re
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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

    @property
    def metrics_port(self) -> int:
        """The port of its ``/metrics`` (started with ``--metrics-port``), as it printed."""
        match = re.search(r"; metrics on port (\d+)$", self.start_line)
        assert match, self.start_line
        return int(match.group(1))


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


@dataclasses.dataclass(frozen=True)
class Target:
    """What the tests' loader helpers read of a server, where it listens: unlike a
    server, it can be handed to a trainer process."""

    target: str


def _report(results: Any, function: Callable[..., None], args: tuple[object, ...]) -> None:
    # As in a trainer started as a script: DataLoader workers are forked (a spawned
    # process would spawn them by default).
    multiprocessing.set_start_method("fork", force=True)
    try:
        function(*args)
    except BaseException as exc:
        results.put("".join(traceback.format_exception(exc)))
    else:
        results.put(None)


def in_trainer_process(function: Callable[..., None], *args: object, timeout: float = 300) -> None:
    """Run ``function(*args)`` in a fresh (spawned) interpreter, as a trainer runs: one
    that hosts no gRPC server, so that it may fork DataLoader workers. The test process
    does host one (the ``server`` fixture), and gRPC cannot fork a process whose server
    threads are inside it: it skips its fork handlers, and the child's calls then fail
    at random. ``function`` must be a module-level function; its failure is raised here."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_report, args=(results, function, args))
    process.start()
    try:
        failure = results.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"{function.__name__} did not finish in {timeout:.0f} s") from None
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(10)
    if failure is not None:
        raise AssertionError(f"{function.__name__} failed in the trainer process:\n{failure}")


@contextlib.contextmanager
def tcp_forwarder(host: str, target: tuple[str, int]) -> Iterator[str]:
    """``host:PORT`` (a free port) forwarding each connection to ``target``, as a port that
    a container publishes does; nothing else of ``target``'s host is reachable through it."""
    listener = socket.create_server((host, 0))
    stop = threading.Event()
    sockets: list[socket.socket] = [listener]

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(target, timeout=30)
            upstream.settimeout(None)
            sockets.extend((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"{host}:{listener.getsockname()[1]}"
    finally:
        stop.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        thread.join(10)
