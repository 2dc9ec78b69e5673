"""How many CPUs this process may use, and how many DALI threads a pipeline gets from them.

``os.cpu_count()`` is the node's cores: on a 224-core node a container limited to 16 CPUs
(a cgroup quota) or pinned to 16 cores (``taskset``, a cpuset) would still build every
pipeline with 224 threads. DALI keeps per-thread buffers (the ``mixed`` decoder two pinned
host buffers and one device buffer per thread, see ``DecoderBuffers``), so threads the
process cannot run cost memory for nothing. The usable count is the least of the CPUs in
the process's affinity mask and its cgroup's CPU quota (v2 ``cpu.max``, or v1
``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, on the process's cgroup and its parents),
rounded up.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Callable

__all__ = ["GPU_THREADS_CAP", "cgroup_cpu_limit", "pipeline_threads", "usable_cpus"]

# DALI threads a GPU pipeline gets at most by default. The GPU decodes and resizes; the
# threads feed it (and decode Huffman on the CPU for the hybrid nvJPEG path). DALI's
# ImageNet examples use 4 per GPU.
GPU_THREADS_CAP = 8

_CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


def usable_cpus(
    cgroup_root: pathlib.Path = _CGROUP_ROOT, proc_cgroup: pathlib.Path | None = None
) -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root, proc_cgroup or pathlib.Path("/proc/self/cgroup"))
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def cgroup_cpu_limit(cgroup_root: pathlib.Path, proc_cgroup: pathlib.Path) -> float | None:
    """The CPU quota of this process's cgroup and its parents in CPUs (the least of
    them), or None where none is set or cgroups cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2, one unified hierarchy
            limits += _limits_along(cgroup_root, path, _v2_limit)
        elif "cpu" in controllers.split(","):  # cgroup v1, the cpu controller's hierarchy
            mount = cgroup_root / controllers
            if not mount.is_dir():
                mount = cgroup_root / "cpu"
            limits += _limits_along(mount, path, _v1_limit)
    return min(limits, default=None)


def _limits_along(
    mount: pathlib.Path, path: str, read: Callable[[pathlib.Path], float | None]
) -> list[float]:
    """The quotas set on ``path`` and every cgroup above it, under ``mount``. In a
    container the process's own cgroup is the mount's root, whatever ``path`` says."""
    parts = [p for p in path.strip("/").split("/") if p]
    directories = {mount.joinpath(*parts[:depth]) for depth in range(len(parts) + 1)}
    return [limit for d in sorted(directories) if (limit := read(d)) is not None]


def _v2_limit(directory: pathlib.Path) -> float | None:
    try:
        quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100_000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_limit(directory: pathlib.Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def pipeline_threads(configured: int, device: str, devices: int, usable: int) -> int:
    """DALI threads for each pipeline: ``configured`` where set (not 0); else on the CPU
    every usable CPU; on GPUs the usable CPUs shared by the ``devices`` in use, at most
    ``GPU_THREADS_CAP``."""
    if configured:
        return configured
    if device != "gpu":
        return usable
    return max(1, min(GPU_THREADS_CAP, usable // max(1, devices)))
