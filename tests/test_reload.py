"""Datasets that change while the server runs: ingested, replaced (ingest --overwrite) or
removed under ``--data-dir``, seen by a rescan (a call, a timer, SIGHUP) without a restart.

Old and new datasets differ in their number of samples and classes, so a batch tells
which version it came from.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from conftest import TEST_DEVICE, start_server
from processes import serve_process

from batchwire.client import BatchwireError, Mixture, RemoteLoader, check_health
from batchwire.server import BatchwireServer, ServerConfig
from batchwire.server.data import Manifest, ingest, write_image_folders
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

# Small images through a small val pipeline: cheap on two shared cores.
SMALL = {"size": 32, "resize": 32}
DEADLINE = 60.0


def _images(root: pathlib.Path, classes: tuple[str, ...], per_class: int) -> pathlib.Path:
    source = root / f"images-{len(classes)}x{per_class}"
    if not source.exists():
        write_image_folders(source, per_class=per_class, size=32, seed=3, classes=classes)
    return source


def _ingest(
    root: pathlib.Path,
    data: pathlib.Path,
    name: str,
    classes: tuple[str, ...],
    per_class: int,
    *,
    overwrite: bool = False,
) -> Manifest:
    report = ingest(
        _images(root, classes, per_class),
        data,
        name=name,
        shard_size=16,
        overwrite=overwrite,
        num_threads=1,
    )
    return Manifest.load(report.path)


OLD = ("circle", "square")  # 2 classes x 20: 40 samples
NEW = ("circle", "square", "triangle")  # 3 classes x 8: 24 samples


def _datasets(address: str) -> dict[str, pb.DatasetInfo]:
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.BatchwireStub(channel).ListDatasets(pb.ListDatasetsRequest(), timeout=10)
    return {info.name: info for info in reply.datasets}


def _labels_by_id(loader: RemoteLoader) -> dict[int, int]:
    """Every id the loader's pass delivers, with its label (each id must come once)."""
    seen: dict[int, int] = {}
    for _, labels, ids in loader:
        for sample_id, label in zip(ids.tolist(), labels.tolist(), strict=True):
            assert sample_id not in seen, f"id {sample_id} delivered twice"
            seen[sample_id] = label
    return seen


def _expected_labels(manifest: Manifest) -> dict[int, int]:
    labels = np.repeat(np.arange(len(manifest.classes)), manifest.class_counts)
    return dict(enumerate(labels.tolist()))


def _loader(address: str, name: str | Mixture, **options: object) -> RemoteLoader:
    settings: dict[str, object] = {
        "dataset": name,
        "pipeline": "val",
        "batch_size": 2,
        "shuffle": False,
        "drop_last": False,
        "return_ids": True,
        "normalize": False,
        "params": SMALL,
        "prefetch": 1,
    }
    return RemoteLoader(address, **{**settings, **options})  # type: ignore[arg-type]


@pytest.fixture
def served(tmp_path: pathlib.Path) -> Iterator[tuple[BatchwireServer, pathlib.Path]]:
    """A server (rescans only when asked) over a data directory holding ``old``."""
    data = tmp_path / "datasets"
    _ingest(tmp_path, data, "old", OLD, 20)
    server = start_server(data, rescan_interval=0.0, num_threads=1)
    try:
        yield server, data
    finally:
        server.stop(grace=1.0)


def test_a_dataset_ingested_while_serving_is_listed_and_streamed(
    served: tuple[BatchwireServer, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    server, data = served
    assert set(_datasets(server.target)) == {"old"}
    manifest = _ingest(tmp_path, data, "fresh", NEW, 8)

    changes = server.rescan()

    assert [(c.name, c.change) for c in changes] == [("fresh", "added")]
    listed = _datasets(server.target)
    assert set(listed) == {"old", "fresh"}
    assert listed["fresh"].num_samples == 24 and len(listed["fresh"].version) == 12
    with _loader(server.target, "fresh") as loader:
        assert _labels_by_id(loader) == _expected_labels(manifest)
    registry = server.metrics.registry
    assert registry.get_sample_value("batchwire_datasets_changed_total", {"change": "added"}) == 1
    assert registry.get_sample_value("batchwire_dataset_rescans_total") == 1
    assert registry.get_sample_value("batchwire_datasets") == 2

    # Removed: no longer listed, a new stream gets NOT_FOUND; nothing else changes.
    shutil.rmtree(data / "fresh")
    assert [(c.name, c.change) for c in server.rescan()] == [("fresh", "removed")]
    assert set(_datasets(server.target)) == {"old"}
    with pytest.raises(BatchwireError) as caught, _loader(server.target, "fresh") as loader:
        next(iter(loader))
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert server.rescan() == []


def test_a_stream_open_across_an_overwrite_finishes_on_the_old_version(
    served: tuple[BatchwireServer, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    server, data = served
    old_manifest = Manifest.load(data / "old")
    old_version = _datasets(server.target)["old"].version
    # 20 batches of 2: far more than the client and the server hold ahead, so most of
    # the epoch is read from LMDB after the old files were renamed away and removed.
    before = _loader(server.target, "old")
    iterator = iter(before)
    _, labels, ids = next(iterator)
    seen = dict(zip(ids.tolist(), labels.tolist(), strict=True))

    new_manifest = _ingest(tmp_path, data, "old", NEW, 8, overwrite=True)
    assert [(c.name, c.change) for c in server.rescan()] == [("old", "replaced")]
    assert not any(p.name.startswith(".") for p in data.iterdir())  # the old files are gone

    for _, labels, ids in iterator:
        for sample_id, label in zip(ids.tolist(), labels.tolist(), strict=True):
            assert sample_id not in seen, f"id {sample_id} delivered twice"
            seen[sample_id] = label
    assert seen == _expected_labels(old_manifest)  # 40 samples, 2 classes: all old
    saved = before.state_dict()
    assert saved["dataset_version"] == old_version
    before.close()

    info = _datasets(server.target)["old"]
    assert info.version != old_version and info.num_samples == 24
    with _loader(server.target, "old") as after:
        assert _labels_by_id(after) == _expected_labels(new_manifest)
    registry = server.metrics.registry
    replaced = registry.get_sample_value("batchwire_datasets_changed_total", {"change": "replaced"})
    assert replaced == 1

    # A stream that expects the old version (a resume) is refused, not served the new one.
    request = pb.StreamBatchesRequest(
        dataset="old", pipeline="val", batch_size=2, start=4, dataset_version=old_version
    )
    with grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(call))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "was replaced" in refused.value.details()


def test_a_state_of_another_version_is_refused_and_an_old_format_state_loads(
    served: tuple[BatchwireServer, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    server, data = served
    with _loader(server.target, "old") as loader:
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        state = loader.state_dict()
        del iterator
    old_version = state["dataset_version"]
    assert state["cursor"] == 6

    _ingest(tmp_path, data, "old", NEW, 8, overwrite=True)
    server.rescan()
    new_version = _datasets(server.target)["old"].version

    with _loader(server.target, "old") as loader, pytest.raises(BatchwireError) as refused:
        loader.load_state_dict(state)
    message = str(refused.value)
    assert f"state was saved on version {old_version} of dataset 'old'" in message
    assert f"the server now serves version {new_version}" in message
    assert "replaced" in message and "start the epoch again" in message.lower()

    # At an epoch's start nothing of the old version is left to finish: it loads.
    with _loader(server.target, "old") as loader:
        loader.load_state_dict({**state, "epoch": 1, "cursor": 0})
        assert loader.epoch == 1

    # Saved by an earlier release (no dataset_version): loads, and resumes at its cursor.
    legacy = {k: v for k, v in state.items() if k != "dataset_version"}
    with _loader(server.target, "old") as loader:
        loader.load_state_dict(legacy)
        _, _, ids = next(iter(loader))
        assert ids.tolist() == [6, 7]
        assert loader.state_dict()["dataset_version"] == new_version


def test_a_server_started_without_datasets_serves_once_one_is_ingested(
    tmp_path: pathlib.Path,
) -> None:
    data = tmp_path / "datasets"
    data.mkdir()
    config = ServerConfig(
        data_dir=data,
        host="localhost",
        port=0,
        device=TEST_DEVICE,
        num_threads=1,
        rescan_interval=0.0,
    )
    server = BatchwireServer(config)
    server.start()
    try:
        assert check_health(server.target) == "NOT_SERVING"
        assert server.rescan() == []
        assert check_health(server.target) == "NOT_SERVING"

        _ingest(tmp_path, data, "late", NEW, 8)
        server.rescan()  # returns once the warm-up that follows is done

        assert check_health(server.target) == "SERVING"
        assert set(_datasets(server.target)) == {"late"}
    finally:
        server.stop(grace=1.0)


def test_the_timer_rescans(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "datasets"
    _ingest(tmp_path, data, "old", OLD, 20)
    server = start_server(data, rescan_interval=0.05, num_threads=1)
    try:
        shutil.copytree(data / "old", data / ".copy")
        os.rename(data / ".copy", data / "copy")  # appears whole, as ingest publishes
        _wait_listed(server.target, "copy")
    finally:
        server.stop(grace=1.0)


def test_sighup_rescans_a_serving_process(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "datasets"
    _ingest(tmp_path, data, "old", OLD, 20)
    args = ("--rescan-interval", "0")
    with serve_process(data, tmp_path / "serve.log", *args) as serving:
        _ingest(tmp_path, data, "fresh", NEW, 8)
        serving.process.send_signal(signal.SIGHUP)
        _wait_listed(serving.address, "fresh")
        # The rescan lists the dataset, then logs it: the line may come a moment later.
        log = tmp_path / "serve.log"
        _wait_until(
            lambda: "dataset 'fresh' added: 24 samples" in log.read_text(),
            lambda: log.read_text()[-2000:],
        )


def _wait_until(condition: Callable[[], bool], failure: Callable[[], str]) -> None:
    """Poll ``condition`` until it holds, or fail with ``failure()`` after DEADLINE seconds."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, failure()
        time.sleep(0.05)


def _wait_listed(address: str, name: str) -> None:
    """Poll ListDatasets until it lists ``name``, or fail after DEADLINE seconds."""
    _wait_until(
        lambda: name in _datasets(address),
        lambda: f"{name!r} not listed within {DEADLINE:.0f}s",
    )


def test_a_mixture_follows_its_sources_versions(
    served: tuple[BatchwireServer, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """A source of a mixture replaced mid-epoch: the open stream finishes on the old
    version, a state of it is refused afterwards, and new passes plan on the new one."""
    server, data = served
    _ingest(tmp_path / "other", data, "other", OLD, 5)  # 10 samples
    server.rescan()
    mixture = Mixture({"old": 0.5, "other": 0.5})  # an epoch of 50: 25 of each
    loader = _loader(server.target, mixture, batch_size=5)
    assert loader.source_counts == {"old": 25, "other": 25}
    iterator = iter(loader)
    _, labels, ids = next(iterator)
    state = loader.state_dict()
    old_version = _datasets(server.target)["other"].version
    assert state["sources"] == [
        ["old", 25, _datasets(server.target)["old"].version],
        ["other", 25, old_version],
    ]

    _ingest(tmp_path / "new", data, "other", NEW, 8, overwrite=True)  # 24 samples, 3 classes
    assert [(c.name, c.change) for c in server.rescan()] == [("other", "replaced")]
    seen, seen_labels = ids.tolist(), labels.tolist()
    for _, labels, ids in iterator:
        seen += ids.tolist()
        seen_labels += labels.tolist()
    labels_of_other = [label for label, i in zip(seen_labels, seen, strict=True) if i >= 40]
    assert len(seen) == 50 and sum(i >= 40 for i in seen) == 25  # the old version's plan
    assert set(labels_of_other) <= {0, 1}  # its 2 classes: none of the new one's triangles
    loader.close()

    with _loader(server.target, mixture, batch_size=5) as resumed:
        with pytest.raises(BatchwireError) as refused:
            resumed.load_state_dict(state)
        assert "a dataset was replaced" in str(refused.value)
        # New passes plan on the new version: 40 and 24 samples, an epoch of 64.
        assert resumed.source_counts == {"old": 32, "other": 32}
        assert len([i for _, _, ids in resumed for i in ids.tolist()]) == 64

    # A stream that expects the old version of a source is refused, not served the new one.
    request = pb.StreamBatchesRequest(
        pipeline="val",
        batch_size=5,
        sources=[
            pb.Source(dataset="old", count=25),
            pb.Source(dataset="other", count=25, version=old_version),
        ],
    )
    with grpc.insecure_channel(server.target) as channel:
        call = pb_grpc.BatchwireStub(channel).StreamBatches(request, timeout=30)
        with pytest.raises(grpc.RpcError) as failed:
            next(iter(call))
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"version {old_version} of dataset 'other'" in failed.value.details()
