"""An outage of a server, as the loader says it: one WARNING when it begins (what the loader
does, for how long), DEBUG for each retry, one INFO when the server serves again, one ERROR
when the loader gives up; the epoch exact through it."""

from __future__ import annotations

import contextlib
import logging
import pathlib
import signal
import socket
import threading
import time

import pytest
import test_failover as failover
from conftest import start_server
from processes import serve_process
from test_failover import BATCH

from batchwire.client import RemoteLoader, UnavailableError
from batchwire.common.sampler import Plan
from batchwire.server import BatchwireServer, ServerError

OPTIONS = {**failover.OPTIONS, "seed": 5}  # the failover tests' loader, another order
EXPECTED = Plan(num_samples=520, batch_size=BATCH, seed=5, drop_last=False).share().tolist()
CLIENT = "batchwire.client"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return int(probe.getsockname()[1])


def lines(caplog: pytest.LogCaptureFixture, level: int, words: str = "") -> list[str]:
    """The loader's log lines at ``level`` that hold ``words``."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(CLIENT) and r.levelno == level and words in r.getMessage()
    ]


def test_the_only_server_killed_for_20s_is_said_once_and_the_epoch_stays_exact(
    data_dir: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL of the loader's only server after 10 batches, the same server started again
    on its port 20 s later: at most two WARNING lines (one), DEBUG lines for the retries,
    one INFO when it serves again, and every sample of the epoch once, in order."""
    caplog.set_level(logging.DEBUG, logger=CLIENT)
    port = free_port()
    with contextlib.ExitStack() as servers:
        first = servers.enter_context(
            serve_process(data_dir, tmp_path / "a.log", "--port", str(port))
        )
        back = threading.Event()

        def start_again() -> None:
            back.wait(20)  # the outage
            servers.enter_context(serve_process(data_dir, tmp_path / "b.log", "--port", str(port)))

        again = threading.Thread(target=start_again, name="test-start-again")
        ids: list[int] = []
        with RemoteLoader(first.address, retry_timeout=60, timeout=120, **OPTIONS) as loader:  # type: ignore[arg-type]
            for n, (_, _, batch) in enumerate(loader):
                ids += batch.tolist()
                if n == 9:
                    first.process.send_signal(signal.SIGKILL)
                    again.start()
        again.join(150)
    assert ids == EXPECTED
    warnings = lines(caplog, logging.WARNING)
    assert len(warnings) <= 2, warnings
    (began,) = lines(caplog, logging.WARNING, "failed")
    assert f"localhost:{port} failed" in began and "only server" in began, began
    assert "retry_timeout=60s" in began, began
    assert len(lines(caplog, logging.DEBUG, "failed again")) >= 2  # retries in 20 s: DEBUG
    (ended,) = lines(caplog, logging.INFO, "serves again")
    assert f"localhost:{port} serves again" in ended, ended
    assert lines(caplog, logging.ERROR) == []


def test_a_loader_that_gives_up_says_so_once(
    data_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The only server stops for good: one WARNING when it fails, one ERROR when the loader
    gives up after retry_timeout, and the loop raises UnavailableError."""
    caplog.set_level(logging.DEBUG, logger=CLIENT)
    server = start_server(data_dir)
    loader = RemoteLoader(server.target, retry_timeout=3, timeout=60, **OPTIONS)  # type: ignore[arg-type]
    iterator = iter(loader)
    next(iterator)
    server.stop(grace=0)
    with pytest.raises(UnavailableError, match=r"retry_timeout=3\)"):
        for _ in iterator:
            pass
    loader.close()
    assert len(lines(caplog, logging.WARNING, "failed")) == 1, caplog.text
    (gave_up,) = lines(caplog, logging.ERROR)
    assert "giving up" in gave_up and "retry_timeout=3" in gave_up, gave_up
    assert lines(caplog, logging.INFO, "serves again") == []


def samples_sent(server: BatchwireServer) -> float:
    return sum(
        sample.value
        for metric in server.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "batchwire_samples_sent_total"
    )


def test_one_of_two_servers_down_for_a_while_is_said_once_and_back_once(
    data_dir: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One of two servers stops after 10 batches and starts again on its port 5 s later,
    while the other serves the epoch: one WARNING for it (its batches move), one INFO once
    it serves again (within the next epochs), and every epoch exact."""
    caplog.set_level(logging.DEBUG, logger=CLIENT)
    port = free_port()
    down = start_server(data_dir, port=port)
    other = start_server(data_dir)
    restarted: list[BatchwireServer] = []
    try:
        back = threading.Event()

        def start_again() -> None:
            back.wait(5)  # the outage
            for attempt in range(20):  # the port is free again once the stop let go of it
                try:
                    restarted.append(start_server(data_dir, port=port))
                    return
                except ServerError:
                    if attempt == 19:
                        raise
                    back.wait(0.5)

        again = threading.Thread(target=start_again, name="test-start-again")
        epochs: list[list[int]] = [[]]
        with RemoteLoader([down.target, other.target], retry_timeout=60, **OPTIONS) as loader:  # type: ignore[arg-type]
            for n, (_, _, batch) in enumerate(loader):
                epochs[0] += batch.tolist()
                if n == 9:
                    down.stop(grace=0)
                    again.start()
            again.join(120)
            assert restarted, f"no server could be started on port {port} again"
            # The restarted server takes batches again within a few epochs, or, where
            # epochs are quicker than that, within its cooldown as a failed server (5 s)
            # and a retry's backoff (at most 2 s), with room for a loaded machine.
            deadline = time.monotonic() + 15
            while not samples_sent(restarted[0]) and (
                len(epochs) < 6 or time.monotonic() < deadline
            ):
                epochs.append([i for _, _, batch in loader for i in batch.tolist()])
    finally:
        for server in (down, other, *restarted):
            server.stop(grace=0)
    assert samples_sent(restarted[0]) > 0
    for epoch, ids in enumerate(epochs):
        plan = Plan(num_samples=520, batch_size=BATCH, seed=5, epoch=epoch, drop_last=False)
        assert ids == plan.share().tolist()
    (began,) = lines(caplog, logging.WARNING, "failed")
    assert f"localhost:{port} failed" in began and "other servers" in began, began
    (ended,) = lines(caplog, logging.INFO, "serves again")
    assert f"localhost:{port} serves again" in ended, ended
    assert lines(caplog, logging.ERROR) == []
