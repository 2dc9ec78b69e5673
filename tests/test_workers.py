"""``batchwire serve --workers N``: N real server processes behind one port, checked
from outside as ops and trainers see them: exact epochs from whichever worker,
one health answer, one /metrics, a drain on SIGTERM, the unit stopping when a
worker dies."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from processes import PYTHON_BATCHWIRE, ServeProcess, serve_process, tcp_forwarder
from prometheus_client.parser import text_string_to_metric_families
from test_bulk import assert_on_the_connections

from batchwire.client import RemoteLoader
from batchwire.server import ServerConfig
from batchwire.server.engine._cpus import pipeline_threads, usable_cpus
from batchwire.server.workers import plan_workers

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SAMPLES = 520  # the shapes dataset
# A channel of its own connection: gRPC otherwise shares one connection among the
# channels of a process that have the same target and options.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


# -- how workers are planned (pure) ------------------------------------------------------


def _config(**settings: object) -> ServerConfig:
    return ServerConfig(data_dir=pathlib.Path("/data"), **settings)  # type: ignore[arg-type]


def test_a_gpu_host_gets_one_worker_per_gpu_each_on_its_own() -> None:
    # The unit's CPUs are shared by its GPUs (at most GPU_THREADS_CAP threads each).
    threads = pipeline_threads(0, "gpu", 2, usable_cpus())
    assert plan_workers(_config(), gpu_count=2) == [
        {"device": "gpu", "devices": (0,), "num_threads": threads},
        {"device": "gpu", "devices": (1,), "num_threads": threads},
    ]
    assert plan_workers(_config(devices=(1, 3)), gpu_count=4) == [
        {"device": "gpu", "devices": (1,), "num_threads": threads},
        {"device": "gpu", "devices": (3,), "num_threads": threads},
    ]
    assert [p["num_threads"] for p in plan_workers(_config(num_threads=5), gpu_count=2)] == [5, 5]
    # Fewer workers than GPUs share them out; more take them in turn.
    assert [p["devices"] for p in plan_workers(_config(workers=2), gpu_count=4)] == [
        (0, 2),
        (1, 3),
    ]
    assert [p["devices"] for p in plan_workers(_config(workers=3), gpu_count=2)] == [
        (0,),
        (1,),
        (0,),
    ]
    # One GPU, or --workers 1: today's single server, unchanged.
    assert plan_workers(_config(), gpu_count=1) == [{}]
    assert plan_workers(_config(workers=1), gpu_count=4) == [{}]


def test_a_gpu_host_with_cores_to_spare_gets_several_workers_per_gpu() -> None:
    """One process's interpreter lock holds it well below a GPU's decoding rate: by default
    a GPU gets up to four workers, one per four usable CPUs, who share those CPUs."""
    assert (
        plan_workers(_config(), gpu_count=1, usable=16)
        == [{"device": "gpu", "devices": (0,), "num_threads": 4}] * 4
    )
    eight = plan_workers(_config(), gpu_count=8, usable=224)  # a DGX-like host
    assert len(eight) == 32 and {p["num_threads"] for p in eight} == {7}
    assert sorted(p["devices"] for p in eight) == sorted([(gpu,) for gpu in range(8)] * 4)
    assert [p["devices"] for p in plan_workers(_config(), gpu_count=2, usable=16)] == [
        (0,),
        (1,),
        (0,),
        (1,),
    ]
    # Too few CPUs for a second worker: one per GPU, as on this machine.
    assert plan_workers(_config(), gpu_count=1, usable=6) == [{}]
    assert len(plan_workers(_config(), gpu_count=4, usable=8)) == 4
    assert len(plan_workers(_config(workers=1), gpu_count=1, usable=64)) == 1


def test_a_cpu_host_gets_one_worker_unless_asked_and_workers_share_the_cores() -> None:
    assert plan_workers(_config(), gpu_count=0) == [{}]
    assert plan_workers(_config(device="cpu")) == [{}]
    cores = usable_cpus()
    assert (
        plan_workers(_config(device="cpu", workers=2)) == [{"num_threads": max(1, cores // 2)}] * 2
    )
    assert plan_workers(_config(device="cpu", workers=2, num_threads=3)) == [{"num_threads": 3}] * 2


# -- a real unit of two workers -------------------------------------------------------


def _serve(data_dir: pathlib.Path, log: pathlib.Path, *args: str):  # type: ignore[no-untyped-def]
    return serve_process(data_dir, log, "--workers", "2", *args)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _worker_pids(parent: int) -> list[int]:
    """The parent's spawned worker processes (not multiprocessing's resource tracker)."""
    children = pathlib.Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    pids = []
    for pid in map(int, children):
        try:
            command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in command:
            pids.append(pid)
    return pids


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone too: it no longer serves, its parent just has not reaped it.
    status = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return status.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.fixture(scope="module")
def unit(
    data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    log = tmp_path_factory.mktemp("unit") / "serve.log"
    with _serve(data_dir, log, "--metrics-port", "0", "--bulk-port", str(_free_pair())) as served:
        yield served


def _free_pair() -> int:
    """A port P such that P and P+1 are free now."""
    while True:
        with socket.socket() as first:
            first.bind(("localhost", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("localhost", port + 1))
                except OSError:
                    continue
        return port


def test_the_start_line_says_how_many_workers(unit: ServeProcess) -> None:
    assert " with 2 workers on localhost:" in unit.start_line
    assert len(_worker_pids(unit.process.pid)) == 2


def _epoch(address: str, epoch: int) -> list[int]:
    with RemoteLoader(
        address,
        dataset="shapes",
        batch_size=16,
        shuffle=True,
        drop_last=False,
        seed=7,
        params={"size": 32},
        return_ids=True,
        normalize=False,
    ) as loader:
        loader.set_epoch(epoch)
        return [int(i) for _, _, batch in loader for i in batch]


def _by_worker(port: int, metric: str = "batchwire_batches_sent_total") -> dict[str, float]:
    """``metric`` summed by worker, as the unit's metrics endpoint on ``port`` says now."""
    sent: dict[str, float] = {}
    for (name, labels), count in _scrape(port).items():
        if name == metric:
            worker = dict(labels)["worker"]
            sent[worker] = sent.get(worker, 0.0) + count
    return sent


def test_one_loader_pulls_an_exact_epoch_from_every_worker(unit: ServeProcess) -> None:
    """The unit's port hands a process's one connection to one worker; the workers' own
    ports, which the unit announces, let one trainer process pull from both."""
    assert re.search(r"each also on its own port: \d+, \d+", unit.log.read_text())
    port = unit.metrics_port
    before = _by_worker(port)
    ids = _epoch(unit.address, 0)
    assert sorted(ids) == list(range(SAMPLES))
    after = _by_worker(port)
    sent = {w: after.get(w, 0.0) - before.get(w, 0.0) for w in ("0", "1")}
    assert sum(sent.values()) == -(-SAMPLES // 16), sent  # each batch once, by one worker
    assert sent["0"] > 0 and sent["1"] > 0, sent


def test_a_trainer_on_another_host_gets_its_images_from_every_workers_bulk_port(
    unit: ServeProcess,
) -> None:
    # --bulk-port P: worker i's bulk connections on P+i.
    args = list(unit.process.args)  # type: ignore[arg-type]
    first = int(args[args.index("--bulk-port") + 1])
    for port in (first, first + 1):
        socket.create_connection(("localhost", port), timeout=10).close()
    metrics = unit.metrics_port
    series = ("batchwire_bulk_bytes_total", "batchwire_bytes_sent_total")
    before = {name: _by_worker(metrics, name) for name in series}
    with RemoteLoader(
        unit.address,
        dataset="shapes",
        batch_size=16,
        seed=7,
        params={"size": 32},
        return_ids=True,
        shared_memory=False,  # as a trainer on another host
    ) as loader:
        ids = [int(i) for _, _, batch in loader for i in batch]
    assert sorted(ids) == list(range(SAMPLES))
    after = {name: _by_worker(metrics, name) for name in series}
    bulk, messages = (
        {w: after[name].get(w, 0.0) - before[name].get(w, 0.0) for w in ("0", "1")}
        for name in series
    )
    assert bulk["0"] > 0 and bulk["1"] > 0, bulk  # both workers' connections
    on = (sum(by_worker.values()) for by_worker in (bulk, messages))
    assert_on_the_connections(*on, SAMPLES, 3 * 32 * 32, batches=-(-SAMPLES // 16))


def test_a_unit_whose_workers_ports_are_closed_is_pulled_through_its_own_port(
    unit: ServeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """As a container that publishes the unit's port alone: the workers' ports do not
    answer from the trainer's side, and the loader streams through the unit's port."""
    _, _, port = unit.address.rpartition(":")
    # 127.0.0.2 forwards the unit's port only; the workers listen on localhost.
    published = tcp_forwarder("127.0.0.2", ("127.0.0.1", int(port)))
    with published as address, caplog.at_level(logging.WARNING, logger="batchwire"):
        ids = _epoch(address, 1)
    assert sorted(ids) == list(range(SAMPLES))
    messages = [record.getMessage() for record in caplog.records]
    warning = [m for m in messages if "is a unit of 2 workers" in m]
    assert len(warning) == 1, caplog.text
    assert "pulls through the unit's port" in warning[0] and "--worker-port" in warning[0]


def test_health_is_one_answer_from_every_worker(unit: ServeProcess) -> None:
    channels = [grpc.insecure_channel(unit.address, options=OWN_CONNECTION) for _ in range(16)]
    try:
        for channel in channels:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "batchwire.v1.Batchwire"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
                assert reply.status == SERVING
    finally:
        for channel in channels:
            channel.close()


def test_one_metrics_endpoint_has_the_series_of_both_workers(unit: ServeProcess) -> None:
    port = unit.metrics_port
    # Each worker sets its batchwire_serving when it next looks at the unit's states
    # (every 0.25 s): poll, with a deadline, for both.
    deadline = time.monotonic() + 30
    while True:
        samples = _scrape(port)
        both = [samples.get(("batchwire_serving", (("worker", w),))) for w in ("0", "1")]
        if both == [1, 1] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert samples[("batchwire_workers", ())] == 2
    for worker in ("0", "1"):
        assert samples[("batchwire_serving", (("worker", worker),))] == 1
        assert samples[("batchwire_worker_serving", (("worker", worker),))] == 1
        assert samples[("batchwire_worker_scrape_errors", (("worker", worker),))] == 0
    infos = [labels for name, labels in samples if name == "batchwire_server_info"]
    assert sorted(dict(labels)["worker"] for labels in infos) == ["0", "1"]


# -- stopping ---------------------------------------------------------------------------


def test_sigterm_drains_every_worker_and_all_exit_zero(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with _serve(data_dir, tmp_path / "serve.log", "--grace", "3") as served:
        workers = _worker_pids(served.process.pid)
        assert len(workers) == 2
        channels = [grpc.insecure_channel(served.address, options=OWN_CONNECTION) for _ in range(4)]
        try:
            watches = [
                health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=60
                )
                for channel in channels
            ]
            for watch in watches:
                assert next(watch).status == SERVING
            served.process.send_signal(signal.SIGTERM)
            # Whichever worker each watch reached, it reports the drain.
            for watch in watches:
                assert next(watch).status == NOT_SERVING
            # The watches are calls in flight: they hold the drain for the grace period.
            assert served.process.wait(timeout=3 + 5 + 10) == 0
        finally:
            for channel in channels:
                channel.close()
        assert all(_gone(pid) for pid in workers)
        log = served.log.read_text()
        assert "SIGTERM received: draining 2 workers" in log
        assert "[worker 0]: draining" in log and "[worker 1]: draining" in log


def test_a_worker_that_dies_stops_the_unit_with_an_error(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    with _serve(data_dir, tmp_path / "serve.log", "--grace", "3") as served:
        first, second = _worker_pids(served.process.pid)
        os.kill(first, signal.SIGKILL)
        assert served.process.wait(timeout=60) == 1
        assert _gone(second)
        assert f"(pid {first}) exited with status -9" in served.log.read_text()


def test_a_worker_that_cannot_start_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    args = ["--port", "0", "--host", "localhost", "--device", "cpu", "--workers", "2"]
    done = subprocess.run(
        [*PYTHON_BATCHWIRE, "serve", "--data-dir", str(tmp_path / "missing"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert "error:" in done.stderr and "does not exist" in done.stderr
    assert done.stdout == ""


def test_sighup_to_the_unit_rescans_in_every_worker(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    data = tmp_path / "datasets"
    shutil.copytree(data_dir / "shapes", data / "shapes")
    log = tmp_path / "serve.log"
    with _serve(data, log, "--rescan-interval", "0") as served:
        # A dataset appears whole, as ingest publishes one (a hidden name, then a rename).
        shutil.copytree(data / "shapes", data / ".fresh")
        os.rename(data / ".fresh", data / "fresh")
        served.process.send_signal(signal.SIGHUP)
        added = re.compile(r"\[worker (\d)\]: dataset 'fresh' added")
        deadline = time.monotonic() + 60
        while {m.group(1) for m in added.finditer(log.read_text())} != {"0", "1"}:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert served.process.poll() is None  # SIGHUP does not stop the unit
