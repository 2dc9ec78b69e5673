"""Which device the pipelines run on: the GPU where one is visible, else the CPU.

``DevicePlan.resolve`` is pure (it takes the number of visible GPUs), so the
choice is tested on machines without a GPU; only ``visible_gpu_count`` asks
CUDA, through DALI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batchwire.server.errors import DeviceError

__all__ = ["DeviceError", "DevicePlan", "visible_gpu_count"]


MODES = ("auto", "cpu", "gpu")


def visible_gpu_count() -> int:
    """CUDA devices visible to this process (0 where CUDA or a driver is missing)."""
    try:
        from nvidia.dali.backend import GetCUDADeviceCount

        return int(GetCUDADeviceCount())
    except Exception:  # no driver, no libcuda: that is simply "no GPU"
        return 0


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """``kind`` is "cpu" or "gpu"; streams are spread over ``device_ids`` in turn."""

    kind: str
    device_ids: tuple[int | None, ...]

    @classmethod
    def resolve(
        cls, mode: str, devices: Sequence[int] | None = None, gpu_count: int | None = None
    ) -> DevicePlan:
        """The plan for ``mode`` (auto|cpu|gpu) and an optional list of GPU ids."""
        if mode not in MODES:
            raise DeviceError(f"device must be one of {MODES}, got {mode!r}")
        if mode == "cpu":
            return cls("cpu", (None,))
        count = visible_gpu_count() if gpu_count is None else gpu_count
        if count == 0:
            if mode == "gpu":
                raise DeviceError(
                    "--device gpu was asked for but no CUDA GPU is visible; "
                    "check the driver and CUDA_VISIBLE_DEVICES, or use --device auto"
                )
            return cls("cpu", (None,))
        ids = tuple(range(count)) if not devices else tuple(devices)
        missing = [i for i in ids if not 0 <= i < count]
        if missing:
            raise DeviceError(f"GPU ids {missing} are not visible (this host sees {count} GPUs)")
        return cls("gpu", ids)
