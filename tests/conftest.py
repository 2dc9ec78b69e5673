"""Shared fixtures: real datasets ingested by the test, and a real server on localhost:0."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis
import numpy as np
import pytest

from batchwire.server import BatchwireServer, ServerConfig
from batchwire.server.data import Manifest, ingest, write_image_folders
from batchwire.server.engine import DevicePlan, visible_gpu_count

# Hypothesis's own timers (a deadline per example, a health check on how fast inputs are
# generated) are timing thresholds: a slow or loaded host fails them with nothing wrong.
hypothesis.settings.register_profile(
    "batchwire", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.load_profile("batchwire")

SHAPES_PER_CLASS = 130  # 4 classes: 520 samples, enough for a batch of 512

# The device of the tests' servers: the CPU, unless BATCHWIRE_TEST_DEVICE says otherwise.
# On a GPU host, BATCHWIRE_TEST_DEVICE=auto runs the same tests with ``mixed`` decoding
# and the GPU operators.
TEST_DEVICE = os.environ.get("BATCHWIRE_TEST_DEVICE", "cpu")


def server_device_kind() -> str:
    """Where the servers of ``start_server`` run their pipelines: "cpu" or "gpu"."""
    return DevicePlan.resolve(TEST_DEVICE).kind


# Plain ``pytest`` (README's test command, and CI's) runs the suite a change is checked with
# before it lands. The tests marked ``slow`` (the image built and run with Compose, training
# in the frameworks on 2+ ranks, the docs' site and examples, the longest fault and soak
# runs) are the rest of the full suite: ``pytest --full`` (or BATCHWIRE_FULL_TESTS=1) runs
# them too, and ``pytest -m slow --full`` them alone.
FULL_SUITE_ENV = "BATCHWIRE_FULL_TESTS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=os.environ.get(FULL_SUITE_ENV, "") not in ("", "0"),
        help=f"also run the tests marked slow: the full suite ({FULL_SUITE_ENV}=1 does too)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--full"):
        return "suite: full (the tests marked slow included)"
    return "suite: the tests a change lands with; the tests marked slow skip (pytest --full)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` skip without ``--full``; tests marked ``gpu`` skip where CUDA sees
    no GPU. Each says why."""
    if not config.getoption("--full"):
        slow = pytest.mark.skip(reason="slow: part of the full suite, run with pytest --full")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(slow)
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked or visible_gpu_count():
        return
    skip = pytest.mark.skip(reason="needs a visible CUDA GPU (none is visible here)")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A data directory holding the dataset ``shapes`` (520 generated JPEGs, 4 classes)."""
    root = tmp_path_factory.mktemp("data")
    source = root / "images"
    write_image_folders(source, per_class=SHAPES_PER_CLASS, size=64, seed=1)
    ingest(source, root / "datasets", name="shapes", shard_size=200)
    return root / "datasets"


@pytest.fixture(scope="session")
def shapes_manifest(data_dir: pathlib.Path) -> Manifest:
    return Manifest.load(data_dir / "shapes")


def class_of(manifest: Manifest, ids: np.ndarray) -> np.ndarray:
    """The label each id must carry: ingest assigns ids class by class."""
    bounds = np.cumsum(manifest.class_counts)
    return np.searchsorted(bounds, np.asarray(ids), side="right")


def ingest_coco(
    coco: pathlib.Path, data_dir: pathlib.Path, *, shard_size: int = 10_000
) -> pathlib.Path:
    """The datasets of a ``write_coco_boxes`` COCO file ``coco``, in ``data_dir``: ``boxes``
    (its instances, ``shard_size`` samples a shard), ``masked`` (the same, with masks) and
    ``captions`` (its captions)."""
    images = coco.parent / "images"
    ingest(coco, data_dir, name="boxes", images=images, shard_size=shard_size)
    ingest(coco, data_dir, name="masked", images=images, masks=True)
    ingest(coco.parent / "captions.json", data_dir, name="captions", images=images)
    return data_dir


def start_server(data_dir: pathlib.Path, **overrides: object) -> BatchwireServer:
    settings: dict[str, object] = {
        "host": "localhost",
        "port": 0,
        "device": TEST_DEVICE,
        "num_threads": 2,
    }
    config = ServerConfig(data_dir=data_dir, **{**settings, **overrides})  # type: ignore[arg-type]
    server = BatchwireServer(config)
    server.start()
    assert server.wait_serving(120), "server did not become SERVING"
    return server


@pytest.fixture(scope="session")
def server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    """One real server for the session (CPU DALI, a free port on localhost)."""
    server = start_server(data_dir)
    yield server
    server.stop(grace=1.0)


Compose = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def docker_compose() -> Compose:
    """``deployfiles.compose``, Compose's model of ``-f deploy/NAME ...``; skips without it."""
    from deployfiles import COMPOSE_MISSING, compose, compose_command

    if compose_command() is None:
        pytest.skip(COMPOSE_MISSING)
    return compose
