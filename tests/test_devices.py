"""Device choice: the GPU where one is visible, the CPU otherwise; GPU tests skip cleanly.

On a GPU host, ``pytest -m gpu -rP`` runs the tests marked ``gpu`` and prints what they
measured; ``BATCHWIRE_TEST_DEVICE=auto pytest`` runs the other server tests there too.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from conftest import start_server
from prometheus_client.registry import CollectorRegistry

from batchwire.client import RemoteLoader
from batchwire.server.engine import DeviceError, DevicePlan, visible_gpu_count


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


def server_info(registry: CollectorRegistry) -> dict[str, str]:
    """The labels of ``batchwire_server_info``, as ``/metrics`` serves them."""
    (sample,) = [
        sample
        for family in registry.collect()
        for sample in family.samples
        if sample.name == "batchwire_server_info"
    ]
    return dict(sample.labels)


@pytest.mark.gpu
def test_gpu_pipelines_serve_batches_onto_the_gpu(data_dir: pathlib.Path) -> None:
    server = start_server(data_dir, device="gpu")
    try:
        info = server_info(server.metrics.registry)
        # gpus: the ids of the GPUs the pipelines run on (all that are visible, by default)
        assert info["device"] == "gpu"
        assert info["gpus"] == ",".join(str(i) for i in range(visible_gpu_count()))
        for pipeline in ("train", "val"):
            with RemoteLoader(
                server.target, dataset="shapes", pipeline=pipeline, batch_size=64, device="cuda"
            ) as loader:
                images, labels = next(iter(loader))
            assert images.is_cuda and labels.is_cuda
            assert images.shape == (64, 3, 224, 224) and images.dtype == torch.float32
    finally:
        server.stop(grace=1.0)


def val_epoch(data_dir: pathlib.Path, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``val`` image of ``shapes`` in id order, as uint8, from a server on ``device``."""
    server = start_server(data_dir, device=device)
    try:
        with RemoteLoader(
            server.target,
            dataset="shapes",
            pipeline="val",
            batch_size=64,
            shuffle=False,
            drop_last=False,
            normalize=False,
            return_ids=True,
        ) as loader:
            batches = list(loader)
    finally:
        server.stop(grace=1.0)
    return torch.cat([ids for _, _, ids in batches]), torch.cat([im for im, _, _ in batches])


def test_val_is_the_same_pixels_from_any_two_servers(data_dir: pathlib.Path) -> None:
    # No randomness in val: what the GPU comparison below measures is the decoders alone.
    first_ids, first = val_epoch(data_dir, "cpu")
    second_ids, second = val_epoch(data_dir, "cpu")
    assert torch.equal(first_ids, torch.arange(520)) and torch.equal(second_ids, first_ids)
    assert first.dtype == torch.uint8 and torch.equal(first, second)


@pytest.mark.gpu
def test_val_on_the_gpu_matches_val_on_the_cpu(data_dir: pathlib.Path) -> None:
    # nvJPEG and the CPU's libjpeg-turbo round the IDCT and upsample chroma their own
    # ways, so pixels differ by a few levels, most at the shapes' sharp colour edges; the
    # geometry (resize, centre crop) and everything else must be the same. Measured on an
    # H200 (DALI 2.4): per image, mean |diff| median 1.48 and max 3.56 levels; pixels off
    # by more than 16 levels at most 5.2 % of an image (a crop off by one pixel gives
    # tens of levels). The bounds are those figures with a margin.
    cpu_ids, cpu = val_epoch(data_dir, "cpu")
    gpu_ids, gpu = val_epoch(data_dir, "gpu")
    assert torch.equal(cpu_ids, gpu_ids) and cpu.shape == gpu.shape == (520, 3, 224, 224)
    diff = (cpu.int() - gpu.int()).abs().flatten(1)
    mean = diff.float().mean(1)  # per image
    worst = diff.amax(1)
    over = (diff > 16).float().mean(1)
    print(
        f"val, GPU against CPU, per image over {len(diff)} images: mean |diff| "
        f"median {mean.median():.3f}, max {mean.max():.3f} levels; largest pixel diff "
        f"median {worst.median().item()}, max {worst.max().item()}; pixels off by more "
        f"than 16 levels: at most {100 * over.max():.3f} % of an image"
    )
    assert mean.median() <= 2.0, "images differ by more than 2 levels on average"
    assert mean.max() <= 4.5, "an image differs by more than 4.5 levels on average"
    assert over.max() <= 0.07, "more than 7 % of an image's pixels differ by more than 16"
