"""DALI threads follow the CPUs the server may use (affinity and cgroup quota), not the
node's cores."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import urllib.request

import pytest
from processes import serve_process
from prometheus_client.parser import text_string_to_metric_families

from batchwire.server.engine._cpus import (
    GPU_THREADS_CAP,
    cgroup_cpu_limit,
    pipeline_threads,
    usable_cpus,
)


def server_info(metrics_port: int) -> dict[str, str]:
    url = f"http://localhost:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "batchwire_server_info":
                return dict(sample.labels)
    raise AssertionError("no batchwire_server_info in /metrics")


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_a_server_limited_by_taskset_to_one_cpu_builds_pipelines_with_one_thread(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    with serve_process(
        data_dir,
        tmp_path / "serve.log",
        "--metrics-port",
        "0",
        launcher=("taskset", "-c", str(cpu)),
        threads=False,  # the default, derived from what the process may use
    ) as served:
        match = re.search(r"metrics on port (\d+)", served.start_line)
        assert match, served.start_line
        info = server_info(int(match.group(1)))
    assert info["usable_cpus"] == "1"
    assert info["threads"] == "1"
    assert "pipelines run on the CPU, 1 DALI threads each (1 CPUs usable" in served.log.read_text()


def write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_caps_the_cpus(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "0::/kubepods/pod1/container\n")
    write(root / "cpu.max", "max 100000\n")
    write(root / "kubepods" / "cpu.max", "max 100000\n")
    write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")  # 1.5 CPUs
    write(root / "kubepods" / "pod1" / "container" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(root, tmp_path / "self") == 1.5
    # Rounded up, and never above the affinity mask.
    expected = min(2, len(os.sched_getaffinity(0)))
    assert usable_cpus(root, tmp_path / "self") == expected


def test_a_container_sees_its_own_cgroup_at_the_mount_root(tmp_path: pathlib.Path) -> None:
    # Without a cgroup namespace the path names the host's hierarchy, absent in the mount.
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "0::/docker/0123abcd\n")
    write(root / "cpu.max", "100000 100000\n")
    assert cgroup_cpu_limit(root, tmp_path / "self") == 1.0
    assert usable_cpus(root, tmp_path / "self") == 1


def test_a_cgroup_v1_quota_caps_the_cpus(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "4:memory:/job\n2:cpu,cpuacct:/job\n1:cpuset:/\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us", "50000\n")
    write(root / "cpu,cpuacct" / "job" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(root, tmp_path / "self") == 0.5
    assert usable_cpus(root, tmp_path / "self") == 1


def test_no_quota_leaves_the_affinity_mask(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "0::/\n")
    write(root / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(root, tmp_path / "self") is None
    assert cgroup_cpu_limit(root, tmp_path / "missing") is None
    assert usable_cpus(root, tmp_path / "self") == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("configured", "device", "devices", "usable", "threads"),
    [
        (0, "cpu", 1, 16, 16),  # the CPU pipelines decode: every usable CPU
        (3, "cpu", 1, 16, 3),  # --num-threads wins
        (0, "gpu", 8, 224, GPU_THREADS_CAP),  # a 224-core node with 8 GPUs: capped
        (0, "gpu", 8, 16, 2),  # a 16-CPU container with 8 GPUs: shared
        (0, "gpu", 4, 2, 1),  # never fewer than one
    ],
)
def test_pipeline_threads(
    configured: int, device: str, devices: int, usable: int, threads: int
) -> None:
    assert pipeline_threads(configured, device, devices, usable) == threads
