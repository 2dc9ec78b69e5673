"""Device choice: the GPU where one is visible, the CPU otherwise; GPU tests skip cleanly."""

from __future__ import annotations

import pathlib

import pytest
import torch
from conftest import start_server

from batchwire.client import RemoteLoader
from batchwire.server.core import DeviceError, DevicePlan, visible_gpu_count


@pytest.mark.parametrize(
    ("mode", "devices", "gpus", "expected"),
    [
        ("auto", None, 0, DevicePlan("cpu", (None,))),
        ("auto", None, 2, DevicePlan("gpu", (0, 1))),
        ("auto", (1,), 2, DevicePlan("gpu", (1,))),
        ("cpu", None, 4, DevicePlan("cpu", (None,))),
        ("gpu", None, 1, DevicePlan("gpu", (0,))),
    ],
)
def test_device_plan(
    mode: str, devices: tuple[int, ...] | None, gpus: int, expected: DevicePlan
) -> None:
    assert DevicePlan.resolve(mode, devices, gpu_count=gpus) == expected


def test_asking_for_a_missing_gpu_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
        DevicePlan.resolve("gpu", gpu_count=0)
    with pytest.raises(DeviceError, match=r"GPU ids \[3\] are not visible"):
        DevicePlan.resolve("auto", (3,), gpu_count=2)
    with pytest.raises(DeviceError, match="device must be one of"):
        DevicePlan.resolve("tpu", gpu_count=0)


def test_auto_on_this_host_matches_what_cuda_sees() -> None:
    plan = DevicePlan.resolve("auto")
    assert plan.kind == ("gpu" if visible_gpu_count() else "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(visible_gpu_count() == 0, reason="needs a visible CUDA GPU")
def test_gpu_pipelines_serve_batches_onto_the_gpu(data_dir: pathlib.Path) -> None:
    server = start_server(data_dir, device="gpu")
    try:
        with RemoteLoader(server.target, dataset="shapes", batch_size=64, device="cuda") as loader:
            images, labels = next(iter(loader))
        assert images.is_cuda and labels.is_cuda
        assert images.shape == (64, 3, 224, 224) and images.dtype == torch.float32
    finally:
        server.stop(grace=1.0)
