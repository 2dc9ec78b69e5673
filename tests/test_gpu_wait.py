"""``--gpu-wait``: how a server's threads wait for its GPUs, CUDA's scheduling flag of each
device's primary context.

On a GPU host the test marked ``gpu`` serves a batch with ``--gpu-wait block`` and reads the
flag back from the driver. Without one, the driver's side is a small library built here that
keeps the flags as CUDA's driver API does (``cuDevicePrimaryCtxGetState``, ``..SetFlags_v2``):
what the server asks of it, and what it does with a refusal.
"""

from __future__ import annotations

import ctypes
import logging
import pathlib
import shutil
import subprocess

import pytest
from conftest import start_server
from processes import in_trainer_process

from batchwire.client import RemoteLoader
from batchwire.server import ServerConfig, settings
from batchwire.server.engine import GPU_WAITS, gpu_wait_of, set_gpu_wait

# Two devices; device 0's context was given another flag (CU_CTX_MAP_HOST, 0x8) beside
# spinning (0x1), which a new way of waiting must keep. Device 2 does not exist.
_DRIVER = r"""
static unsigned int flags[2] = {0x8 | 0x1, 0x0};
unsigned int flags_of(int dev) { return flags[dev]; }
int cuInit(unsigned int f) { return 0; }
int cuDeviceGet(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal > 1) return 101;
    *dev = ordinal;
    return 0;
}
int cuDevicePrimaryCtxGetState(int dev, unsigned int *f, int *active) {
    *f = flags[dev];
    *active = 1;
    return 0;
}
int cuDevicePrimaryCtxSetFlags_v2(int dev, unsigned int f) { flags[dev] = f; return 0; }
int cuGetErrorName(int status, const char **name) {
    if (status != 101) return 1;
    *name = "CUDA_ERROR_INVALID_DEVICE";
    return 0;
}
"""


@pytest.fixture
def driver(tmp_path: pathlib.Path) -> pathlib.Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver")
    source = tmp_path / "driver.c"
    source.write_text(_DRIVER)
    library = tmp_path / "libcuda-stand-in.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", library, source], check=True)
    return library


def test_the_setting_takes_exactly_the_ways_cuda_has() -> None:
    (declared,) = [s for s in settings() if s.name == "gpu_wait"]
    assert declared.choices is not None and set(declared.choices) == set(GPU_WAITS)
    assert ServerConfig(data_dir=pathlib.Path("d")).gpu_wait == "auto"


def test_block_is_set_on_each_device_keeping_its_other_flags(
    driver: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        failed = set_gpu_wait("block", [0, 1], driver=str(driver))
    assert failed == {}
    assert not caplog.records
    stand_in = ctypes.CDLL(str(driver))
    assert [stand_in.flags_of(0), stand_in.flags_of(1)] == [0x8 | 0x4, 0x4]
    assert gpu_wait_of(0, driver=str(driver)) == "block"
    set_gpu_wait("yield", [1], driver=str(driver))
    assert [gpu_wait_of(i, driver=str(driver)) for i in (0, 1)] == ["block", "yield"]


def test_a_refusal_is_said_with_the_drivers_name_for_it_and_serving_goes_on(
    driver: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        failed = set_gpu_wait("spin", [2, 0], driver=str(driver))
    assert list(failed) == [2] and "CUDA_ERROR_INVALID_DEVICE" in failed[2]
    (record,) = caplog.records
    assert "GPU 2 as --gpu-wait spin" in record.getMessage()
    assert "CUDA's own way" in record.getMessage()
    # The device that exists got it all the same.
    assert ctypes.CDLL(str(driver)).flags_of(0) == 0x8 | 0x1
    assert gpu_wait_of(0, driver=str(driver)) == "spin"


def test_without_a_driver_block_is_said_once_a_device_and_auto_asks_nothing(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "libcuda.so.1")
    assert set_gpu_wait("auto", [0], driver=missing) == {}
    with caplog.at_level(logging.WARNING):
        failed = set_gpu_wait("block", [0, 1], driver=missing)
    assert sorted(failed) == [0, 1]
    assert len(caplog.records) == 2
    with pytest.raises(OSError):
        gpu_wait_of(0, driver=missing)


def _serves_with_block(data_dir: pathlib.Path) -> None:
    # A process of its own: the flag is its primary context's, for the process's life.
    server = start_server(data_dir, device="gpu", gpu_wait="block")
    try:
        with RemoteLoader(server.target, dataset="shapes", batch_size=16, pipeline="val") as loader:
            images, _ = next(iter(loader))
        assert images.shape[0] == 16
        assert gpu_wait_of(0) == "block"
    finally:
        server.stop(grace=1.0)


@pytest.mark.gpu
def test_a_gpu_server_waits_for_its_gpu_as_told(data_dir: pathlib.Path) -> None:
    in_trainer_process(_serves_with_block, data_dir)
