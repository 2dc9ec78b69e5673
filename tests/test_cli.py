"""The commands ops and newcomers run: serve (as a real process), health, demo."""

from __future__ import annotations

import argparse
import fcntl
import os
import pathlib
import pty
import re
import signal
import socket
import struct
import subprocess
import termios

import pytest
from processes import PYTHON_BATCHWIRE, serve_process

from batchwire.cli import main
from batchwire.client import RemoteLoader
from batchwire.server import BatchwireServer, ServerConfig


def test_health_exits_zero_only_when_serving(
    server: BatchwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["health", "--address", server.target]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert main(["health", "--address", "localhost:1", "--timeout", "2"]) == 1
    # The hint the loader gives, not gRPC's raw text alone.
    assert "is `batchwire serve` running there?" in capsys.readouterr().err


def test_health_wait_returns_once_serving_and_says_why_a_server_without_data_never_is(
    server: BatchwireServer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["health", "--address", server.target, "--wait", "60"]) == 0
    assert capsys.readouterr().out.strip() == f"{server.target}: SERVING"
    empty = BatchwireServer(
        ServerConfig(data_dir=tmp_path, host="localhost", port=0, device="cpu", num_threads=1)
    )
    empty.start()
    try:
        assert main(["health", "--address", empty.target, "--wait", "10"]) == 1
    finally:
        empty.stop(grace=1.0)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert f"{empty.target}: NOT_SERVING after 10 s: it found no datasets" in err
    assert "batchwire ingest" in err


def test_health_of_nothing_listening_is_one_line_and_an_url_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as closed:
        closed.bind(("localhost", 0))
        port = closed.getsockname()[1]
    assert main(["health", "--address", f"localhost:{port}", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"localhost:{port}: UNAVAILABLE" in err, err
    assert main(["health", "--address", "http://localhost:50051"]) == 2
    err = capsys.readouterr().err
    assert "is a URL: write HOST:PORT without 'http://', e.g. localhost:50051" in err
    with pytest.raises(ValueError, match="is a URL"):
        RemoteLoader("https://gpu-host:50051/", dataset="shapes")


def test_serve_process_streams_and_drains_on_sigterm(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with serve_process(data_dir, tmp_path / "serve.log", "--grace", "5") as served:
        assert " with 1 worker on localhost:" in served.start_line  # the CPU's default
        assert main(["health", "--address", served.address]) == 0
        with RemoteLoader(
            served.address, dataset="shapes", batch_size=16, params={"size": 32}
        ) as loader:
            images, labels = next(iter(loader))
        assert images.shape == (16, 3, 32, 32)
        assert labels.shape == (16,)
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=30) == 0
        assert "SIGTERM received" in served.log.read_text()
        assert main(["health", "--address", served.address, "--timeout", "2"]) == 1


def test_serve_without_a_data_directory_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    monkeypatch.delenv("BATCHWIRE_DATA_DIR", raising=False)
    monkeypatch.delenv("BATCHWIRE_CONFIG", raising=False)
    assert main(["serve", "--port", "0"]) == 2
    assert "--data-dir" in capsys.readouterr().err
    assert main(["serve", "--data-dir", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # As a process: its one line, no log lines of a server that never started before it.
    command = [*PYTHON_BATCHWIRE, "serve", "--data-dir", str(tmp_path / "missing")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: data directory {tmp_path / 'missing'} does not exist or is not a directory"
    ], done.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nmax_streams = 0\n")
    assert main(["serve", "--data-dir", str(tmp_path), "--config", str(bad)]) == 2
    assert "max_streams" in capsys.readouterr().err


def test_demo_builds_serves_and_prints_a_rate(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "demo",
        "--cache",
        str(tmp_path),
        "--images",
        "96",
        "--batch-size",
        "16",
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"streamed 96 images .* \d+ images/s", out), out
    assert "circle 24, cross 24, square 24, triangle 24" in out
    assert "the rate includes building its DALI pipelines and warming up" in out
    assert "ingested 96 images in 4 classes" in out
    assert main(args) == 0  # the second run reuses the cached dataset
    assert "using the sample dataset" in capsys.readouterr().out
    # Without --images, whatever is cached; with another number, a dataset of that size.
    assert main([*args[:3], "--batch-size", "16", "--device", "cpu"]) == 0
    assert "(96 images)" in capsys.readouterr().out
    assert main([*args[:4], "48", *args[5:]]) == 0
    out = capsys.readouterr().out
    assert "has 96 images, not 48: making it again" in out
    assert re.search(r"streamed 48 images ", out), out


def _demo_stderr(cache: pathlib.Path, *flags: str, terminal: bool) -> str:
    """What ``batchwire demo`` writes to stderr: a terminal (a pseudo-terminal) or a pipe."""
    command = [*PYTHON_BATCHWIRE, "demo", "--cache", str(cache), "--images", "32"]
    command += ["--batch-size", "8", "--device", "cpu", *flags]
    if not terminal:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr
    leader, follower = pty.openpty()
    # A terminal of 24 x 100: a new one has 0 columns, into which tqdm draws nothing.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert process.wait(300) == 0
    finally:
        os.close(leader)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_progress_bars_only_on_a_terminal_and_never_with_no_progress(
    tmp_path: pathlib.Path,
) -> None:
    bar = re.compile(r"\d+%\|")  # tqdm's "42%|███"
    assert bar.search(_demo_stderr(tmp_path, "--rebuild", terminal=True))
    assert not bar.search(_demo_stderr(tmp_path, "--rebuild", terminal=False))
    assert not bar.search(_demo_stderr(tmp_path, "--rebuild", "--no-progress", terminal=True))
    for command in ("ingest", "demo", "bench"):
        assert "--no-progress" in _help(command), command


def _help(command: str) -> str:
    done = subprocess.run(
        [*PYTHON_BATCHWIRE, command, "--help"], capture_output=True, text=True, timeout=60
    )
    return done.stdout


def test_version_is_the_installed_packages(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    import batchwire
    import batchwire.client
    import batchwire.common
    import batchwire.server

    installed = importlib.metadata.version("batchwire")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"batchwire {installed}"
    assert batchwire.__version__ == batchwire.common.__version__ == installed
    assert batchwire.client.__version__ == batchwire.server.__version__ == installed


def test_an_address_without_a_port_is_refused_before_dialing_443(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["health", "--address", "localhost"]) == 2
    assert "has no port" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no port: write HOST:PORT"):
        RemoteLoader("gpu-host", dataset="shapes")


def test_a_data_dir_that_is_one_dataset_says_to_point_at_its_parent(
    data_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = data_dir / "shapes"
    assert main(["serve", "--data-dir", str(dataset), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "is itself a dataset" in err and f"here {data_dir}" in err


def test_a_port_in_use_is_one_line_without_tracebacks(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as taken:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                *PYTHON_BATCHWIRE,
                "serve",
                "--data-dir",
                str(data_dir),
                "--port",
                str(port),
                "--device",
                "cpu",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert "another process is using the port" in done.stderr
    assert "Traceback" not in done.stderr and "Failed to add port" not in done.stderr


def test_the_commands_agree_on_their_common_options() -> None:
    """One tool: the same option means the same default and reads the same in every
    command's help, and each command's help gives its own log level."""
    commands = _subcommands()
    for name in ("health", "preview", "bench"):
        address = commands[name]._option_string_actions["--address"]
        assert address.default in (None, "localhost:50051"), name
    assert commands["preview"]._option_string_actions["--address"].default == "localhost:50051"
    for name in ("demo", "bench", "preview"):
        assert commands[name]._option_string_actions["--pipeline"].default == "train", name
        assert commands[name]._option_string_actions["--batch-size"].metavar == "N", name
    for name, command in commands.items():
        level = command._option_string_actions["--log-level"].help or ""
        expected = "WARNING" if name in ("demo", "bench") else "INFO"
        assert f"(default {expected})" in level, (name, level)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from batchwire.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)
