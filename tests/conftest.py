"""Shared fixtures: real datasets ingested by the test, and a real server on localhost:0."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from deployfiles import COMPOSE_MISSING, compose, compose_command

from batchwire.server import BatchwireServer, ServerConfig
from batchwire.server.data import Manifest, ingest, write_image_folders

SHAPES_PER_CLASS = 130  # 4 classes: 520 samples, enough for a batch of 512


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


def start_server(data_dir: pathlib.Path, **overrides: object) -> BatchwireServer:
    settings: dict[str, object] = {
        "host": "localhost",
        "port": 0,
        "device": "cpu",
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
    if compose_command() is None:
        pytest.skip(COMPOSE_MISSING)
    return compose
