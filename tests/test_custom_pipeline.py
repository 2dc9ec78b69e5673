"""The documented custom pipeline (examples/custom.toml + examples/custom_pipeline.py) is
served, chosen by name, tuned by declared parameters, and used by RemoteLoader."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest
import torch
from conftest import class_of, start_server
from processes import serve_process

from batchwire.client import InvalidArgumentError, Preprocessor, RemoteLoader
from batchwire.server import BatchwireServer, ConfigError, load_file, pipelines_from_config
from batchwire.server.data import Dataset, Manifest
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
CONFIG = EXAMPLES / "custom.toml"
STILL = {"size": 40, "resize": 48, "jitter": 0.0, "flip": 0.0}  # no randomness


@pytest.fixture(scope="module")
def custom_server(data_dir: pathlib.Path) -> Iterator[BatchwireServer]:
    pipelines = pipelines_from_config(load_file(CONFIG)["pipelines"], base_dir=CONFIG.parent)
    server = start_server(data_dir, pipelines=pipelines)
    yield server
    server.stop(grace=1.0)


def test_the_example_pipeline_is_served_and_described(custom_server: BatchwireServer) -> None:
    with grpc.insecure_channel(custom_server.target) as channel:
        info = pb_grpc.BatchwireStub(channel).DescribeDataset(
            pb.DescribeDatasetRequest(dataset="shapes"), timeout=30
        )
    pipelines = {p.name: p for p in info.pipelines}
    assert sorted(pipelines) == ["gray", "train", "val"]
    gray = pipelines["gray"]
    assert "grayscale" in gray.description
    assert dict(gray.params) == {"size": 224, "resize": 256, "jitter": 0.2, "flip": 0.5}
    assert list(gray.mean) == pytest.approx([114.5] * 3)
    assert list(gray.std) == pytest.approx([57.6] * 3)


def test_remote_loader_streams_the_custom_pipeline(
    custom_server: BatchwireServer, shapes_manifest: Manifest, data_dir: pathlib.Path
) -> None:
    with RemoteLoader(
        custom_server.target,
        dataset="shapes",
        pipeline="gray",
        batch_size=16,
        shuffle=False,
        normalize=False,
        return_ids=True,
        params=STILL,
    ) as loader:
        images, labels, ids = next(iter(loader))
    assert images.dtype == torch.uint8
    assert tuple(images.shape) == (16, 3, 40, 40)
    # Grayscale: three equal channels, which the colour `val` preset never gives.
    assert torch.equal(images[:, 0], images[:, 1])
    assert torch.equal(images[:, 1], images[:, 2])
    assert labels.tolist() == class_of(shapes_manifest, ids.numpy()).tolist()

    # Normalized by the client with the mean/std declared in the config.
    with RemoteLoader(
        custom_server.target,
        dataset="shapes",
        pipeline="gray",
        batch_size=16,
        shuffle=False,
        params=STILL,
    ) as loader:
        normalized, _ = next(iter(loader))
    torch.testing.assert_close(normalized, (images.float() - 114.5) / 57.6)

    # The same images sent to the Preprocess RPC come out the same.
    with Dataset(data_dir / "shapes") as dataset:
        encoded, _ = dataset.read(ids.numpy())
    with Preprocessor(
        custom_server.target, pipeline="gray", normalize=False, params=STILL
    ) as preprocessor:
        result = preprocessor([bytes(e) for e in encoded])  # type: ignore[arg-type]
    assert torch.equal(result.images, images)


def test_declared_parameters_are_the_only_knobs(custom_server: BatchwireServer) -> None:
    for params, words in (
        ({"angle": 10.0}, "has no parameter 'angle'"),
        ({"jitter": 2.0}, r"'jitter' must be in \[0, 0.9\]"),
        ({"size": 40.5}, "whole number"),
    ):
        with (
            RemoteLoader(
                custom_server.target, dataset="shapes", pipeline="gray", batch_size=4, params=params
            ) as loader,
            pytest.raises(InvalidArgumentError, match=words),
        ):
            next(iter(loader))


def test_batchwire_serve_with_the_documented_config(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # The file path in the config is relative to the config, not to the working directory.
    with (
        serve_process(data_dir, tmp_path / "serve.log", "--config", str(CONFIG)) as served,
        RemoteLoader(
            served.address, dataset="shapes", pipeline="gray", batch_size=8, params=STILL
        ) as loader,
    ):
        images, labels = next(iter(loader))
    assert tuple(images.shape) == (8, 3, 40, 40)
    assert labels.shape == (8,)


def test_config_errors_name_the_pipeline_and_what_to_fix(tmp_path: pathlib.Path) -> None:
    cases = {
        'function = "missing.py:build"': "missing.py does not exist",
        'function = "custom_pipeline.py:nope"': "has no function 'nope'",
        'function = "no_such_module_xyz:build"': "cannot import pipeline module",
        'function = "build"': "'module:function' or 'file.py:function'",
    }
    (tmp_path / "custom_pipeline.py").write_text((EXAMPLES / "custom_pipeline.py").read_text())
    for line, words in cases.items():
        config = tmp_path / "c.toml"
        config.write_text(f"[pipelines.x]\n{line}\n")
        with pytest.raises(ConfigError, match=r"\[pipelines\.x\]") as caught:
            pipelines_from_config(load_file(config)["pipelines"], base_dir=tmp_path)
        assert words in str(caught.value)
