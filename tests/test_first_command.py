"""The first commands a newcomer runs, as README's quick start 2 writes them: what they
print, and where the server they start can be reached from.

``batchwire serve`` with README's flags (the data directory and the port made the test's)
runs as a real process: it logs no warning from its start to SERVING, and every socket it
listens on (gRPC, the bulk connections, a unit's workers and their own ports) is a
loopback address, read from ``/proc``. A server told ``--host 0.0.0.0`` without TLS or
tokens still warns. ``batchwire ingest`` of a folder prints each fact once.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image
from processes import PYTHON_BATCHWIRE, wait_until_serving

from batchwire.cli import build_parser
from batchwire.cli._serve import resolve_config
from batchwire.server import BatchwireServer

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# A log record as `batchwire` writes it in the plain format: "DATE TIME LEVEL LOGGER: ...",
# a worker's with "[worker I]" after the logger.
RECORD = re.compile(
    r"^\d{4}-\d\d-\d\d \S+ (?P<level>[A-Z]+) \S+(?: \[worker \d+\])?: (?P<message>.*)$"
)
# Any line that reads as a warning or worse, a record or not.
WORSE_THAN_INFO = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def readme_serve() -> list[str]:
    """Quick start 2's `batchwire serve` command, without its trailing ``&``."""
    lines = [line for line in README.read_text().splitlines() if line.startswith("batchwire serve")]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0].partition("&")[0])
    assert "--host" not in words, "the quick start is about the default host"
    return words


def records(text: str) -> list[tuple[str, str]]:
    """The (level, message) of each log record in a plain log."""
    matches = (RECORD.match(line) for line in text.splitlines())
    return [(m["level"], m["message"]) for m in matches if m]


def listening(pid: int) -> set[tuple[Address, int]]:
    """The TCP addresses process ``pid`` listens on: its sockets' inodes matched against
    the kernel's tables of its network namespace."""
    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
            if match:
                inodes.add(match.group(1))
    found: set[tuple[Address, int]] = set()
    for table in ("tcp", "tcp6"):
        for line in pathlib.Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            if sys.byteorder == "little":  # the kernel writes each 32-bit word as a number
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(raw)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped  # a dual-stack socket bound to an IPv4 address
            found.add((address, int(hex_port, 16)))
    return found


def children(pid: int) -> list[int]:
    path = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()]


@contextlib.contextmanager
def readme_server(
    data_dir: pathlib.Path, log: pathlib.Path, *extra: str
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """README's `batchwire serve` as a process, on ``data_dir`` and any free port, with
    ``extra`` flags and no BATCHWIRE_* variable; the process and its port once SERVING.
    Stopped with SIGTERM (a drain) on exit, so that its log is whole."""
    words = readme_serve()
    words[words.index("--data-dir") + 1] = str(data_dir)
    words[words.index("--port") + 1] = "0"
    command = [*PYTHON_BATCHWIRE, *words[1:], "--device", "cpu", "--num-threads", "1", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r" on localhost:(\d+)(?:; metrics on port \d+)?$", line.strip())
        assert match, f"unexpected first line {line!r}; log: {log.read_text()[-2000:]}"
        port = int(match.group(1))
        wait_until_serving(f"localhost:{port}", timeout=120)
        yield process, port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_the_quick_start_server_listens_on_this_machine_only_and_warns_of_nothing(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    log = tmp_path / "serve.log"
    with readme_server(data_dir, log) as (process, port):
        addresses = listening(process.pid)
    assert process.returncode == 0, log.read_text()[-2000:]
    assert (ipaddress.ip_address("127.0.0.1"), port) in addresses, addresses
    # gRPC's port and the bulk connections' (any free port): loopback, each of them.
    assert len({p for _, p in addresses}) >= 2, addresses
    assert all(address.is_loopback for address, _ in addresses), addresses
    text = log.read_text()
    said = records(text)
    assert [r for r in said if r[0] not in ("DEBUG", "INFO")] == [], said
    assert not WORSE_THAN_INFO.search(text), text
    listening_lines = [m for _, m in said if m.startswith("listening on ")]
    assert listening_lines == [
        f"listening on localhost:{port} (this machine only: --host 0.0.0.0 serves other "
        "hosts; plaintext, no tokens)"
    ], said


def test_a_unit_of_workers_follows_the_default_host(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """``--workers 2``: the parent's reserved port, each worker's gRPC, own and bulk ports,
    and the unit's /metrics, all on loopback; no warning."""
    log = tmp_path / "unit.log"
    with readme_server(data_dir, log, "--workers", "2", "--metrics-port", "0") as (process, port):
        workers = children(process.pid)
        addresses = listening(process.pid)
        for pid in workers:
            addresses |= listening(pid)
    assert process.returncode == 0, log.read_text()[-2000:]
    # The unit's port (both workers), 2 own ports, 2 bulk ports, 3 metrics endpoints.
    assert port in {p for _, p in addresses} and len({p for _, p in addresses}) >= 6, addresses
    assert all(address.is_loopback for address, _ in addresses), addresses
    text = log.read_text()
    said = records(text)
    assert [r for r in said if r[0] not in ("DEBUG", "INFO")] == [], said
    assert not WORSE_THAN_INFO.search(text), text
    assert len([m for _, m in said if m.startswith("listening on localhost:")]) == 2, said


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "0.0.0.0"])
def test_only_a_server_other_hosts_reach_without_tls_or_token_warns(
    host: str, data_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    if host == "[::1]" and not socket_binds("::1"):
        pytest.skip("this host has no IPv6 loopback")
    words = readme_serve()[1:]
    words[words.index("--data-dir") + 1] = str(data_dir)
    words[words.index("--port") + 1] = "0"
    args = build_parser().parse_args(
        [*words, "--host", host, "--device", "cpu", "--num-threads", "1"]
    )
    server = BatchwireServer(resolve_config(args, {}))
    with caplog.at_level(logging.INFO, logger="batchwire.server"):
        server.start()
        server.stop(grace=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if host != "0.0.0.0":
        assert warnings == [], warnings
        return
    (warning,) = warnings
    assert warning.startswith("listening on every interface (0.0.0.0) in plaintext with no token")
    assert f"port {server.port}" in warning
    assert "--host localhost" in warning and "--token-file" in warning


def socket_binds(address: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True


# -- ingest -------------------------------------------------------------------------------


def test_ingest_of_a_folder_says_each_fact_once(tmp_path: pathlib.Path) -> None:
    """What ``batchwire ingest`` prints by default: the summary, the files it rejected,
    and warnings; no log line repeats the count, the classes or where it wrote."""
    src = tmp_path / "my-images"
    for name in ("cat", "dog"):
        (src / name).mkdir(parents=True)
        for i in range(3):
            pixels = np.full((20, 24, 3), 40 * i, np.uint8)
            Image.fromarray(pixels).save(src / name / f"{i}.png")
    (src / "dog" / "broken.jpg").write_bytes(b"nope")
    (src / "empty").mkdir()
    (src / "empty" / "notes.jpg").write_bytes(b"not an image")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    done = subprocess.run(
        [*PYTHON_BATCHWIRE, "ingest", str(src), str(tmp_path / "datasets"), "--name", "pets"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    written = str(tmp_path / "datasets" / "pets")
    assert done.stdout.splitlines()[0].startswith(
        f"ingested 6 images in 3 classes into {written} (1 shard, "
    ), done.stdout
    assert output.count(written) == 1, output
    assert output.count("3 classes") == 1, output
    assert len(re.findall(r"\b6 (images|samples|files)\b", output)) == 1, output
    assert done.stdout.splitlines()[1:] == [
        "rejected 2 files:",
        "  dog/broken.jpg: only 4 bytes: not an image",
        "  empty/notes.jpg: only 12 bytes: not an image",
    ], done.stdout
    # Warnings stay: a class with nothing to train on.
    said = records(done.stderr)
    assert said == [("WARNING", "class 'empty' has no decodable image")], done.stderr
