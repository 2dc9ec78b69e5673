"""Prometheus metrics, scraped over real HTTP from real servers while real clients stream."""

from __future__ import annotations

import pathlib
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import lmdb
import pytest
from conftest import server_device_kind, start_server
from prometheus_client.parser import text_string_to_metric_families
from test_resources import within

from batchwire.cli import main
from batchwire.client import NotFoundError, RemoteLoader
from batchwire.server import BatchwireServer, ServerError
from batchwire.server.data import Manifest, sample_key
from batchwire.server.runners import STAGES, StageTimes
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc
from batchwire.v1 import datum_pb2

SHAPES = {"dataset": "shapes", "pipeline": "val"}
STREAM = "/batchwire.v1.Batchwire/StreamBatches"


def scrape(server: BatchwireServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` as {(name, sorted labels): value}."""
    assert server.metrics_port is not None
    url = f"http://localhost:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def ended(samples: dict, status: str) -> float:  # type: ignore[type-arg]
    return value(samples, "batchwire_streams_ended_total", status=status, **SHAPES)


def settled(server: BatchwireServer) -> dict:  # type: ignore[type-arg]
    """A scrape once no stream is open: a stream's last batch is counted when gRPC has
    taken it, which can be just after the client has read it."""
    samples: dict = {}  # type: ignore[type-arg]

    def idle() -> bool:
        samples.clear()
        samples.update(scrape(server))
        return not any(v for (name, _), v in samples.items() if name == "batchwire_active_streams")

    assert within(30, idle), "a stream stays counted as active after it ended"
    return samples


@pytest.fixture(scope="module")
def metered(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    server = start_server(data_dir, metrics_port=0)
    yield server
    server.stop(grace=1.0)


def test_metrics_move_while_a_client_streams(metered: BatchwireServer) -> None:
    before = scrape(metered)
    assert value(before, "batchwire_serving") == 1
    with RemoteLoader(
        metered.target, batch_size=8, params={"size": 32}, prefetch=1, **SHAPES
    ) as loader:
        batches = iter(loader)
        next(batches)
        # The stream is open (520 samples, 8 a batch): the server waits on this client.
        during = scrape(metered)
        assert value(during, "batchwire_active_streams", **SHAPES) >= 1
        for name in (
            "batchwire_samples_sent_total",
            "batchwire_bytes_sent_total",
            "batchwire_batches_sent_total",
            "batchwire_streams_started_total",
        ):
            assert value(during, name, **SHAPES) > value(before, name, **SHAPES), name
        received = 1 + sum(1 for _ in batches)
    assert received == 65
    after = settled(metered)

    def grew(name: str) -> float:
        return value(after, name, **SHAPES) - value(before, name, **SHAPES)

    assert grew("batchwire_samples_sent_total") == 520
    assert grew("batchwire_batches_sent_total") == 65
    # The uint8 images, in the messages or, to this client on the server's host, in shared
    # memory (a batch that finds no free buffer travels in its messages); ids and labels.
    shared = grew("batchwire_shared_memory_bytes_total")
    assert 0 < shared <= 520 * 3 * 32 * 32
    assert grew("batchwire_bytes_sent_total") + shared > 520 * 3 * 32 * 32
    assert grew("batchwire_pipeline_seconds_count") == 65
    assert grew("batchwire_pipeline_seconds_sum") > 0
    assert grew("batchwire_client_wait_seconds_count") == 65
    assert grew("batchwire_streams_started_total") == 1
    assert ended(after, "OK") - ended(before, "OK") == 1, "a whole epoch is an OK stream"
    # Where the server's time went: each stage of making the 65 batches took some.
    for stage in STAGES:
        name = "batchwire_stage_seconds_total"
        assert value(after, name, stage=stage) > value(before, name, stage=stage), stage
    # The pipeline slots: every batch taken counted with its wait, their time measured.
    pipe = {"pipeline": "val"}
    assert grew_by(before, after, "batchwire_queue_wait_seconds_count", **pipe) == 65
    assert grew_by(before, after, "batchwire_pipeline_busy_seconds_total", **pipe) > 0
    assert value(after, "batchwire_pipeline_builds_total", **pipe) >= 1
    info = scrape(metered)
    assert value(info, "batchwire_server_info", **server_info(info)) == 1


def grew_by(before: dict, after: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return value(after, name, **labels) - value(before, name, **labels)


def test_stage_times_sum_each_call_and_refuse_an_unknown_stage() -> None:
    def read(seq: int) -> int:
        time.sleep(0.01)
        return seq * 2

    def encode() -> None:
        time.sleep(0.01)
        raise ValueError("bad batch")

    stages = StageTimes()

    def timed_read(seq: int) -> int:
        with stages.timing("read"):
            return read(seq)

    assert [timed_read(i) for i in range(3)] == [0, 2, 4]
    # A failing call counts, and raises.
    with pytest.raises(ValueError, match="bad batch"), stages.timing("encode"):
        encode()
    totals = stages.snapshot()
    assert set(totals) == set(STAGES) and totals["pipeline"] == 0.0
    assert totals["read"] >= 0.03 and totals["encode"] >= 0.01
    with pytest.raises(ValueError, match="unknown stage 'decode'"):
        stages.add("decode", 1.0)


def server_info(samples: dict) -> dict[str, str]:  # type: ignore[type-arg]
    ((_, labels),) = [key for key in samples if key[0] == "batchwire_server_info"]
    found = dict(labels)
    assert found["device"] == server_device_kind() and found["version"]
    return found


def test_errors_are_counted_by_method_and_status_code(metered: BatchwireServer) -> None:
    before = scrape(metered)
    with pytest.raises(NotFoundError):
        list(RemoteLoader(metered.target, dataset="missing", batch_size=8))
    with grpc.insecure_channel(metered.target) as channel:
        stub = pb_grpc.BatchwireStub(channel)
        too_big = pb.StreamBatchesRequest(batch_size=10**6, **SHAPES)
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.StreamBatches(too_big, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        call = stub.StreamBatches(
            pb.StreamBatchesRequest(batch_size=4, params={"size": 32}, **SHAPES), timeout=30
        )
        next(call)
        call.cancel()  # a client that goes away
    after: dict = {}  # type: ignore[type-arg]

    def counted(**labels: str) -> Callable[[], bool]:
        def check() -> bool:
            after.update(scrape(metered))
            return value(after, "batchwire_errors_total", **labels) > value(
                before, "batchwire_errors_total", **labels
            )

        return check

    assert within(30, counted(method=STREAM, code="INVALID_ARGUMENT"))
    # A client leaving mid-stream is no server error, but the stream's end says so.
    assert within(30, lambda: ended(scrape(metered), "CANCELLED") > ended(before, "CANCELLED"))
    assert not any(dict(k[1]).get("code") == "CANCELLED" for k in after)
    # The loader asks DescribeDataset first: the unknown name ends there.
    assert within(30, counted(method="/batchwire.v1.Batchwire/DescribeDataset", code="NOT_FOUND"))
    labels = {dict(key[1]).get("dataset") for key in after if key[0].startswith("batchwire_")}
    assert "missing" not in labels, "client-chosen names must never become label values"


def test_refused_tokens_are_counted_too(data_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("a-token\n")
    server = start_server(data_dir, metrics_port=0, token_file=tokens, health_open=True)
    try:
        with (
            grpc.insecure_channel(server.target) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.BatchwireStub(channel).ListDatasets(pb.ListDatasetsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        method = "/batchwire.v1.Batchwire/ListDatasets"
        # abort() sends the status before the interceptor sees the call end: poll.
        assert within(
            30,
            lambda: (
                value(
                    scrape(server), "batchwire_errors_total", method=method, code="UNAUTHENTICATED"
                )
                == 1
            ),
        )
    finally:
        server.stop(grace=1.0)


def test_skipped_samples_are_counted(data_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    copy = tmp_path / "datasets"
    shutil.copytree(data_dir, copy)
    damaged = [3, 250, 401]
    manifest = Manifest.load(copy / "shapes")
    garbage = datum_pb2.Datum(encoded=True, data=b"these bytes are not an image", label=0)
    for shard in manifest.shards:
        env = lmdb.open(str(copy / "shapes" / shard.path), lock=False)
        with env.begin(write=True) as txn:
            for sample_id in damaged:
                if shard.first_id <= sample_id < shard.first_id + shard.count:
                    txn.put(sample_key(sample_id), garbage.SerializeToString())
        env.close()
    server = start_server(copy, metrics_port=0)
    try:
        with RemoteLoader(
            server.target, batch_size=40, shuffle=False, params={"size": 32}, **SHAPES
        ) as loader:
            for _ in loader:
                pass
            assert sorted(loader.skipped_ids) == damaged
        samples = settled(server)
        assert value(samples, "batchwire_skipped_samples_total", **SHAPES) == len(damaged)
        assert value(samples, "batchwire_samples_sent_total", **SHAPES) == 520 - len(damaged)
    finally:
        server.stop(grace=1.0)


def test_each_server_has_its_own_metrics_and_stops_serving_them(data_dir: pathlib.Path) -> None:
    first = start_server(data_dir, metrics_port=0)
    second = start_server(data_dir, metrics_port=0)
    try:
        assert first.metrics_port != second.metrics_port
        with RemoteLoader(first.target, batch_size=52, params={"size": 32}, **SHAPES) as loader:
            assert sum(len(labels) for _, labels in loader) == 520
        assert value(settled(first), "batchwire_samples_sent_total", **SHAPES) == 520
        assert value(scrape(second), "batchwire_samples_sent_total", **SHAPES) == 0
    finally:
        first.stop(grace=1.0)
        second.stop(grace=1.0)
    with pytest.raises(urllib.error.URLError):
        scrape(first)


def test_a_metrics_port_in_use_stops_serve_with_what_to_do(
    data_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.create_server(("localhost", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ServerError, match="choose another --metrics-port"):
            start_server(data_dir, metrics_port=port)
        args = ["serve", "--data-dir", str(data_dir), "--host", "localhost", "--port", "0"]
        assert main([*args, "--device", "cpu", "--metrics-port", str(port)]) == 2
    error = capsys.readouterr().err
    assert (
        error.startswith("error: cannot serve metrics on localhost:") and "--metrics-port" in error
    )
