"""What ``--streams`` reads from the server process besides its streams.

- CPU seconds: utime + stime of the server process from ``/proc/PID/stat`` (its
  children, none here, excluded);
- where its time goes: the ``/metrics`` counters ``batchwire_stage_seconds_total``
  (``read``, ``pipeline``, ``encode``) and ``batchwire_client_wait_seconds_sum``
  (``send``: batches waiting in gRPC writes), with ``batchwire_samples_sent_total``
  to divide them by, and the device from ``batchwire_server_info``;
- batches sent by each worker of a unit (``batchwire_batches_sent_total{worker}``);
- GPU memory: the process's, from NVML (``pynvml``, from the ``nvidia-ml-py`` package,
  imported only here and only if installed), else from ``nvidia-smi``; None where
  neither answers (no GPU). Where the driver lists processes by pids of another PID
  namespace (a container), the process is not found and the memory in use on the
  visible GPUs is taken instead, which on a benchmark host is the server's.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import subprocess
import urllib.request
from typing import Any

from batchwire.bench import process_cpu_seconds
from batchwire.server.runners import STAGES as SERVER_STAGES

__all__ = ["STAGES", "Counters", "ServerProbe", "gpu_memory_mib"]

STAGES = (*SERVER_STAGES, "send")  # the server's stages, and its gRPC writes
_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Counters:
    """The server's running totals at one moment."""

    cpu_seconds: float
    samples: float  # samples sent, all streams
    seconds: dict[str, float]  # by STAGES, summed over the server's threads and streams

    def per_image_ms(self, later: Counters) -> tuple[float, dict[str, float]]:
        """(CPU ms per image, ms per image of each stage) from this moment to ``later``;
        zeros where no image was sent in between."""
        images = later.samples - self.samples
        if images <= 0:
            return 0.0, dict.fromkeys(STAGES, 0.0)
        stages = {s: (later.seconds[s] - self.seconds[s]) / images * 1000 for s in STAGES}
        return (later.cpu_seconds - self.cpu_seconds) / images * 1000, stages


class ServerProbe:
    """Reads :class:`Counters` of the server process ``pid`` serving ``/metrics`` on
    ``metrics_port`` (localhost)."""

    def __init__(self, pid: int, metrics_port: int) -> None:
        self.pid = pid
        self._url = f"http://localhost:{metrics_port}/metrics"

    def scrape(self) -> list[Any]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self._url, timeout=10) as reply:
            text = reply.read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def counters(self) -> Counters:
        cpu = process_cpu_seconds(self.pid)
        seconds = dict.fromkeys(STAGES, 0.0)
        samples = 0.0
        for sample in self.scrape():
            if sample.name == "batchwire_stage_seconds_total":
                seconds[sample.labels["stage"]] += sample.value
            elif sample.name == "batchwire_client_wait_seconds_sum":
                seconds["send"] += sample.value
            elif sample.name == "batchwire_samples_sent_total":
                samples += sample.value
        return Counters(cpu_seconds=cpu, samples=samples, seconds=seconds)

    def batches_by_worker(self) -> dict[str, float]:
        """Batches sent so far by each worker of a unit (a lone server: worker "0")."""
        sent: dict[str, float] = {}
        for sample in self.scrape():
            if sample.name == "batchwire_batches_sent_total":
                worker = sample.labels.get("worker", "0")
                sent[worker] = sent.get(worker, 0.0) + sample.value
        return sent

    def device(self) -> str:
        """Where the server runs its pipelines (``cpu`` or ``gpu``), as it reports."""
        for sample in self.scrape():
            if sample.name == "batchwire_server_info":
                return str(sample.labels.get("device", "unknown"))
        return "unknown"


def gpu_memory_mib(pid: int) -> float | None:
    """GPU memory of process ``pid`` in MiB, over all visible GPUs; None without a GPU
    (or without both NVML and ``nvidia-smi``)."""
    used = _nvml_mib(pid)
    return used if used is not None else _nvidia_smi_mib(pid)


def _nvml_mib(pid: int) -> float | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        listed = [
            p.usedGpuMemory
            for handle in handles
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid == pid and p.usedGpuMemory is not None
        ]
        if listed:
            return float(sum(listed)) / _MIB
        return float(sum(nvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)) / _MIB
    except nvml.NVMLError:
        return None


@functools.cache
def _nvml() -> Any:
    """The ``pynvml`` module, initialised once (it stays so until the process exits);
    None where it is not installed or finds no driver."""
    try:
        import pynvml  # nvidia-ml-py, where the host has it; not a dependency
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


def _nvidia_smi_mib(pid: int) -> float | None:
    apps = _nvidia_smi("--query-compute-apps=pid,used_memory")
    if apps is None:
        return None
    listed = [
        float(row[1]) for row in apps if len(row) == 2 and row[0] == str(pid) and _number(row[1])
    ]
    if listed:
        return sum(listed)
    totals = _nvidia_smi("--query-gpu=memory.used") or []
    used = [float(row[0]) for row in totals if row and _number(row[0])]
    return sum(used) if used else None


def _nvidia_smi(query: str) -> list[list[str]] | None:
    """Rows of ``nvidia-smi QUERY --format=csv,noheader,nounits``; None if it fails."""
    command = shutil.which("nvidia-smi")
    if command is None:
        return None
    try:
        done = subprocess.run(
            [command, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [[cell.strip() for cell in line.split(",")] for line in done.stdout.splitlines()]


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
