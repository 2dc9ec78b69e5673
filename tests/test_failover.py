"""Exactly-once through server failures: real server processes, real signals, real sockets."""

from __future__ import annotations

import logging
import pathlib
import re
import signal
import time
from collections.abc import Iterator

import pytest
from processes import ServeProcess, serve_process

from batchwire.client import RemoteLoader
from batchwire.common.sampler import Plan

BATCH = 8
OPTIONS = {
    "dataset": "shapes",
    "pipeline": "val",
    "batch_size": BATCH,
    "return_ids": True,
    "params": {"size": 32},
    "seed": 3,
    "drop_last": False,
    "prefetch": 2,
}
EXPECTED = Plan(num_samples=520, batch_size=BATCH, seed=3, drop_last=False).share().tolist()


@pytest.fixture()
def two_servers(data_dir: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[list[ServeProcess]]:
    with (
        serve_process(data_dir, tmp_path / "a.log", "--grace", "5") as a,
        serve_process(data_dir, tmp_path / "b.log", "--grace", "5") as b,
    ):
        yield [a, b]


def stream_with_failure(
    servers: list[ServeProcess], fail: signal.Signals
) -> tuple[list[int], float]:
    """One epoch over both servers; the first gets ``fail`` after 10 batches.

    Returns the ids delivered and when the signal was sent (time.monotonic).
    """
    ids: list[int] = []
    signalled = 0.0
    with RemoteLoader([s.address for s in servers], retry_timeout=30, **OPTIONS) as loader:  # type: ignore[arg-type]
        assert len(loader) == 65
        for n, (_, _, batch_ids) in enumerate(loader):
            ids += batch_ids.tolist()
            if n == 9:
                servers[0].process.send_signal(fail)
                signalled = time.monotonic()
    return ids, signalled


def resumed(caplog: pytest.LogCaptureFixture) -> bool:
    """A failed server held batches, and they were asked of the other server."""
    held = re.compile(r"[1-9][0-9]* batch(es)? it held go to the other servers")
    return any(held.search(r.getMessage()) for r in caplog.records)


def test_sigkill_of_one_server_mid_epoch_loses_and_repeats_nothing(
    two_servers: list[ServeProcess], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.client")
    ids, _ = stream_with_failure(two_servers, signal.SIGKILL)
    assert resumed(caplog), "the killed server's batches moved to the other server"
    assert two_servers[0].process.wait(10) == -signal.SIGKILL
    assert ids == EXPECTED  # the same samples, in the same order, as an undisturbed run


def test_sigterm_drains_one_server_and_the_epoch_continues_on_the_other(
    two_servers: list[ServeProcess], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.client")
    ids, signalled = stream_with_failure(two_servers, signal.SIGTERM)
    assert resumed(caplog), "the drained server's batches moved to the other server"
    # --grace 5: the process must be gone 5 s after the signal (plus process exit).
    exit_code = two_servers[0].process.wait(timeout=max(0.1, signalled + 5 + 2 - time.monotonic()))
    assert exit_code == 0
    log = two_servers[0].log.read_text()
    assert "draining" in log and "SIGTERM received" in log
    assert ids == EXPECTED


def test_state_dict_moves_to_another_list_of_servers(two_servers: list[ServeProcess]) -> None:
    a, b = (s.address for s in two_servers)
    first = RemoteLoader([a], **OPTIONS)  # type: ignore[arg-type]
    head: list[int] = []
    for n, (_, _, batch_ids) in enumerate(first):
        head += batch_ids.tolist()
        if n == 20:
            break
    state = first.state_dict()
    first.close()
    for servers in ([b], [b, a]):
        again = RemoteLoader(servers, **OPTIONS)  # type: ignore[arg-type]
        again.load_state_dict(state)
        tail = [i for _, _, batch_ids in again for i in batch_ids.tolist()]
        assert head + tail == EXPECTED


def test_a_dns_name_fans_out_to_every_address(two_servers: list[ServeProcess]) -> None:
    port = two_servers[0].address.rsplit(":", 1)[1]
    loader = RemoteLoader(f"dns:///localhost:{port}", **OPTIONS)  # type: ignore[arg-type]
    servers = loader._servers.servers()
    assert len(servers) >= 1 and all(s.tls_name == "localhost" for s in servers)
    ids = [i for _, _, batch_ids in loader for i in batch_ids.tolist()]
    assert ids == EXPECTED
