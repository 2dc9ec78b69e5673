"""Several servers behind one loader: ``bench --fleet`` and ``bench --chaos``.

``--fleet``: two servers, each pinned to a core of its own, the second sharing its core
with two busy processes (noisy neighbours: about half speed). Each server's solo rate, then
one loader over both, alternated; the loader should reach the sum of the solo rates,
because batches go to whichever server is ready.

``--chaos``: three servers and two ranks streaming epochs while, every few seconds, one
server is killed (SIGKILL) or drained (SIGTERM) and started again on its port. Every
finished epoch of each rank is checked against the sampler's plan: samples lost and
repeated must both be 0.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping

from batchwire.cli._bench_probe import rss_mib
from batchwire.cli._bench_runs import LocalServer, RunResult, run_remote

__all__ = ["ChaosResult", "RankTally", "chaos", "chaos_report", "fleet", "fleet_table"]


class Burner:
    """``count`` processes that keep core ``cpu`` busy while the ``with`` block runs."""

    def __init__(self, cpu: str, count: int = 1) -> None:
        self._command = ["taskset", "-c", cpu, sys.executable, "-c", "while True: pass"]
        self._count = count
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Burner:
        self._processes = [subprocess.Popen(self._command) for _ in range(self._count)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for process in self._processes:
            process.kill()
            process.wait(10)


def fleet(
    data_dir: pathlib.Path,
    work: pathlib.Path,
    dataset: str,
    pipeline: str,
    batch_size: int,
    images: int,
    repeats: int,
) -> dict[str, RunResult]:
    """Median runs of: the fast server alone, the slowed one alone, one loader over both."""
    runs: dict[str, list[RunResult]] = collections.defaultdict(list)
    # The loader runs on core 0 beside the fast server in every run: on core 1 the busy
    # neighbours would slow the loader itself, and by chance, run to run.
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    with (
        contextlib.ExitStack() as restore,
        LocalServer(data_dir, work, cpus="0", threads=1) as fast,
        LocalServer(data_dir, work, cpus="1", threads=1) as slow,
        Burner("1", count=2),  # one left the server about 0.7 of its speed; two, about half
    ):
        restore.callback(os.sched_setaffinity, 0, affinity)
        setups = {
            "fast": [fast],
            "slow": [slow],
            "both": [fast, slow],
        }
        for repeat in range(repeats):
            for name, servers in setups.items():
                result = run_remote(
                    name,
                    [s.address for s in servers],
                    [s.pid for s in servers],
                    dataset,
                    pipeline,
                    batch_size,
                    images,
                )
                print(
                    f"[{repeat + 1}/{repeats}] {name:<5} {result.images_per_second:8.0f} images/s",
                    flush=True,
                )
                runs[name].append(result)
    return {
        name: sorted(results, key=lambda r: r.images_per_second)[len(results) // 2]
        for name, results in runs.items()
    }


def fleet_table(results: Mapping[str, RunResult]) -> str:
    fast, slow, both = (results[n].images_per_second for n in ("fast", "slow", "both"))
    return "\n".join(
        [
            f"{'run':<44}{'images/s':>9}",
            f"{'fast: server on core 0 alone':<44}{fast:9.0f}",
            f"{'slow: server on core 1 (shared) alone':<44}{slow:9.0f}",
            f"{'both: one loader over the two servers':<44}{both:9.0f}",
            "",
            f"slow/fast images/s               {slow / fast:5.2f}   (the slowed server's speed)",
            f"both/(fast+slow) images/s        {both / (fast + slow):5.2f}   target >= 0.85",
            f"2*slow/(fast+slow)               {2 * slow / (fast + slow):5.2f}   (arithmetic, not "
            "measured: static lanes, batch k on server k % 2, move at the slow server's pace)",
        ]
    )


@dataclasses.dataclass
class RankTally:
    """One rank's finished epochs, checked against the plan."""

    rank: int
    epochs: int = 0
    samples: int = 0
    lost: int = 0
    repeated: int = 0


@dataclasses.dataclass
class ChaosResult:
    seconds: float
    kills: collections.Counter[str]
    ranks: list[RankTally]
    rss_start_mib: list[float]
    rss_end_mib: list[float]
    restarts: collections.Counter[int]

    @property
    def exact(self) -> bool:
        return all(r.lost == 0 and r.repeated == 0 and r.epochs > 0 for r in self.ranks)


def _stream_rank(
    tally: RankTally,
    addresses: list[str],
    expected: Callable[[int], list[int]],
    options: Mapping[str, object],
    until: threading.Event,
    failures: list[BaseException],
) -> None:
    """Epochs of one rank until ``until`` is set (the epoch under way is finished)."""
    from batchwire.client import RemoteLoader

    try:
        with RemoteLoader(addresses, rank=tally.rank, world_size=2, **options) as loader:  # type: ignore[arg-type]
            while not until.is_set():
                loader.set_epoch(tally.epochs)
                got = [int(i) for _, _, ids in loader for i in ids.tolist()]
                want = expected(tally.epochs)
                tally.lost += sum((collections.Counter(want) - collections.Counter(got)).values())
                tally.repeated += sum(
                    (collections.Counter(got) - collections.Counter(want)).values()
                )
                tally.samples += len(got)
                tally.epochs += 1
    except BaseException as exc:  # reported, and the run fails
        failures.append(exc)


def chaos(
    data_dir: pathlib.Path,
    work: pathlib.Path,
    dataset: str,
    *,
    num_samples: int,
    pipeline: str,
    batch_size: int,
    seconds: float,
    every: float,
    params: Mapping[str, float] | None = None,
    seed: int = 11,
) -> ChaosResult:
    """Three servers, two ranks, one server killed or drained every ``every`` seconds for
    ``seconds`` seconds, from the end of each rank's first epoch; then every rank finishes
    the epoch under way."""
    from batchwire.common.sampler import Plan

    servers = [LocalServer(data_dir, work, threads=1) for _ in range(3)]
    ports = [int(s.address.rsplit(":", 1)[1]) for s in servers]
    addresses = [s.address for s in servers]
    kills: collections.Counter[str] = collections.Counter()
    restarts: collections.Counter[int] = collections.Counter()
    rng = random.Random(seed)
    options = {
        "dataset": dataset,
        "pipeline": pipeline,
        "batch_size": batch_size,
        "seed": seed,
        "drop_last": False,
        "return_ids": True,
        "normalize": False,
        "params": dict(params or {}),
        "retry_timeout": 120.0,
    }

    def expected(rank: int) -> Callable[[int], list[int]]:
        def share(epoch: int) -> list[int]:
            plan = Plan(
                num_samples=num_samples,
                batch_size=batch_size,
                seed=seed,
                epoch=epoch,
                drop_last=False,
                rank=rank,
                world_size=2,
            )
            return [int(i) for i in plan.share()]

        return share

    until = threading.Event()
    failures: list[BaseException] = []
    tallies = [RankTally(rank) for rank in range(2)]
    ranks = [
        threading.Thread(
            target=_stream_rank,
            args=(tally, addresses, expected(tally.rank), options, until, failures),
            name=f"batchwire-chaos-rank-{tally.rank}",
            daemon=True,
        )
        for tally in tallies
    ]
    try:
        for thread in ranks:
            thread.start()
        # Warm first: RSS at the start is that of servers that have served an epoch.
        warm_by = time.monotonic() + 600
        while min(t.epochs for t in tallies) < 1 and not failures and time.monotonic() < warm_by:
            time.sleep(0.1)
        rss_start = [rss_mib([s.pid]) for s in servers]
        started = time.monotonic()
        while time.monotonic() - started < seconds and not failures:
            time.sleep(every * rng.uniform(0.5, 1.5))
            victim = rng.randrange(3)
            how = rng.choice([signal.SIGKILL, signal.SIGTERM])
            servers[victim].process.send_signal(how)
            servers[victim].process.wait(60)
            servers[victim].close()
            kills[how.name] += 1
            restarts[victim] += 1
            print(
                f"  {time.monotonic() - started:5.0f} s  {how.name} {addresses[victim]}; "
                f"epochs {[t.epochs for t in tallies]}",
                flush=True,
            )
            servers[victim] = LocalServer(data_dir, work, threads=1, port=ports[victim])
        until.set()
        for thread in ranks:
            thread.join(600)
        rss_end = [rss_mib([s.pid]) for s in servers]
    finally:
        until.set()
        for server in servers:
            server.close()
    if failures:
        raise failures[0]
    return ChaosResult(time.monotonic() - started, kills, tallies, rss_start, rss_end, restarts)


def chaos_report(result: ChaosResult) -> str:
    lines = [
        f"chaos: {result.seconds:.0f} s, {sum(result.kills.values())} servers stopped "
        f"({result.kills['SIGKILL']} SIGKILL, {result.kills['SIGTERM']} SIGTERM) and restarted"
    ]
    for r in result.ranks:
        lines.append(
            f"rank {r.rank}: {r.epochs} epochs, {r.samples} samples, "
            f"{r.lost} lost, {r.repeated} repeated"
        )
    start = ", ".join(f"{m:.0f}" for m in result.rss_start_mib)
    end = ", ".join(f"{m:.0f}" for m in result.rss_end_mib)
    lines.append(
        f"server RSS MiB after the first epoch [{start}], at the end [{end}] "
        f"(restarted servers are new processes: {dict(result.restarts)} restarts by server)"
    )
    lines.append("exactly once: " + ("yes" if result.exact else "NO"))
    return "\n".join(lines)
