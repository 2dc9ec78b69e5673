"""What the benchmark measures about processes: CPU time and resident memory.

CPU seconds come from ``getrusage`` for this process (all threads) and its
reaped children (DataLoader workers), and from ``/proc/PID/stat`` for another
process (a server). Peak RSS is sampled from ``/proc`` every 250 ms by a named
daemon thread.
"""

from __future__ import annotations

import os
import pathlib
import resource
import threading
from collections.abc import Iterable

__all__ = ["CpuClock", "RssSampler", "process_cpu_seconds", "process_tree", "rss_mib"]

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far, its children excluded."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime, stime are fields 14 and 15 of stat (11, 12 after the command name).
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _own_cpu(children: bool) -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += kids.ru_utime + kids.ru_stime
    return total


class CpuClock:
    """CPU seconds spent by this process (plus reaped children) or by ``pid``."""

    def __init__(self, pid: int | None = None, *, children: bool = False) -> None:
        self._pid = pid
        self._children = children
        self._start = self._now()

    def _now(self) -> float:
        return _own_cpu(self._children) if self._pid is None else process_cpu_seconds(self._pid)

    def seconds(self) -> float:
        return self._now() - self._start


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants that are alive now."""
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for children in pathlib.Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:
                continue
            pids += kids
            frontier += kids
    return pids


def rss_mib(pids: Iterable[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total / 2**20


class RssSampler:
    """Peak resident memory of processes while the ``with`` block runs.

    With ``children=True`` each process counts with its descendants (DataLoader
    workers); finding them reads every thread's ``children`` file, so it is off
    by default: the sampler's own CPU time counts against the process it measures.
    """

    def __init__(self, *roots: int, interval: float = 0.25, children: bool = False) -> None:
        self._roots = roots
        self._interval = interval
        self._children = children
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchwire-bench-rss", daemon=True)
        self.peaks = [0.0] * len(roots)

    def _sample(self) -> None:
        for i, root in enumerate(self._roots):
            pids = process_tree(root) if self._children else [root]
            self.peaks[i] = max(self.peaks[i], rss_mib(pids))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sample()
