"""How this process's threads wait for its GPUs: CUDA's scheduling flag of each device's
primary context (``--gpu-wait``).

A thread that waits for a GPU (a stream's or an event's synchronization, a copy to the
host) spins on its core, yields it, or sleeps until the GPU is done. CUDA's own choice
("auto") spins wherever a process has fewer contexts than the host has cores: on a GPU
host every worker process of a unit (up to 4 per GPU) then spins in every wait of its DALI
pipelines, on cores the other workers and the record path could use. "block" makes those
threads sleep in the driver until the GPU's work is done (``CU_CTX_SCHED_BLOCKING_SYNC``,
``cudaDeviceScheduleBlockingSync`` to the runtime): less CPU, a wake-up's latency more.

The flag is the primary context's, which DALI, nvJPEG and any library of the process
share through CUDA's runtime: it is set through the driver API (``libcuda.so.1``, present
wherever a GPU is visible), before the first pipeline makes that context active.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable

__all__ = ["GPU_WAITS", "gpu_wait_of", "set_gpu_wait"]

log = logging.getLogger(__name__)

# CU_CTX_SCHED_* of cuda.h, by the name --gpu-wait gives them.
GPU_WAITS = {"auto": 0x0, "spin": 0x1, "yield": 0x2, "block": 0x4}
_SCHED_MASK = 0x7
_DRIVER = "libcuda.so.1"
# cuda.h's names that stand for a symbol of another name since CUDA 11 (the v2 of
# cuDevicePrimaryCtxSetFlags may be called with the context active).
_SYMBOLS = {"cuDevicePrimaryCtxSetFlags": "cuDevicePrimaryCtxSetFlags_v2"}


def set_gpu_wait(wait: str, device_ids: Iterable[int], driver: str = _DRIVER) -> dict[int, str]:
    """Make the threads of this process wait for each of ``device_ids`` (CUDA ordinals)
    as ``wait`` says (a key of :data:`GPU_WAITS`); "auto" leaves CUDA's own choice alone.
    Returns, by device, why it could not be set (a driver's refusal is logged, never
    raised: the pipelines run as well with CUDA's own waiting)."""
    if GPU_WAITS[wait] == 0:
        return {}
    failed: dict[int, str] = {}
    try:
        call = _driver(driver)
        call("cuInit", 0)
    except OSError as exc:
        failed = {device: str(exc) for device in device_ids}
    else:
        for device in device_ids:
            try:
                handle, flags = _state(call, device)
                wanted = (flags & ~_SCHED_MASK) | GPU_WAITS[wait]
                call("cuDevicePrimaryCtxSetFlags", handle, ctypes.c_uint(wanted))
            except OSError as exc:
                failed[device] = str(exc)
    for device, why in failed.items():
        log.warning(
            "could not make this process wait for GPU %d as --gpu-wait %s says (%s): its "
            "threads wait CUDA's own way (auto)",
            device,
            wait,
            why,
        )
    return failed


def gpu_wait_of(device: int, driver: str = _DRIVER) -> str:
    """How this process's threads wait for ``device`` now (a key of :data:`GPU_WAITS`);
    OSError where the driver cannot say."""
    call = _driver(driver)
    call("cuInit", 0)
    _, flags = _state(call, device)
    names = {value: name for name, value in GPU_WAITS.items()}
    return names.get(flags & _SCHED_MASK, f"flags {flags:#x}")


def _state(call: Callable[..., None], device: int) -> tuple[ctypes.c_int, int]:
    """``device``'s handle and its primary context's flags."""
    handle = ctypes.c_int()
    call("cuDeviceGet", ctypes.byref(handle), device)
    flags, active = ctypes.c_uint(), ctypes.c_int()
    call("cuDevicePrimaryCtxGetState", handle, ctypes.byref(flags), ctypes.byref(active))
    return handle, flags.value


def _driver(path: str) -> Callable[..., None]:
    """A caller of the CUDA driver's functions by name that raises OSError with the
    driver's own name for a failure (``cuGetErrorName``)."""
    lib = ctypes.CDLL(path)

    def call(name: str, *args: object) -> None:
        status = getattr(lib, _SYMBOLS.get(name, name))(*args)
        if status != 0:
            text = ctypes.c_char_p()
            lib.cuGetErrorName(status, ctypes.byref(text))
            label = (text.value or b"").decode() or f"error {status}"
            raise OSError(status, f"{name}: {label}")

    return call
