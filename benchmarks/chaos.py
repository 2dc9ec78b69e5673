"""Servers stopped under streaming ranks: ``python -m benchmarks --chaos``.

Three servers and two ranks streaming epochs while, every few seconds, one server is killed
(SIGKILL) or drained (SIGTERM) and started again on its port. Every finished epoch of each
rank is checked against the sampler's plan: samples lost and repeated must both be 0.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping

from batchwire.bench import LocalServer, rss_mib

__all__ = ["ChaosResult", "RankTally", "chaos", "chaos_report", "run_chaos"]


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
    *,
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
    stops: int = 0,
    params: Mapping[str, float] | None = None,
    seed: int = 11,
) -> ChaosResult:
    """Three servers, two ranks, one server killed or drained every ``every`` seconds for
    ``seconds`` seconds (and at least ``stops`` times, however long that takes), from the
    end of each rank's first epoch; then every rank finishes the epoch under way."""
    servers = _Servers(data_dir, work, 3)
    options = _rank_options(dataset, pipeline, batch_size, seed, params)
    until = threading.Event()
    failures: list[BaseException] = []
    tallies = [RankTally(rank) for rank in range(2)]
    ranks = [
        threading.Thread(
            target=_stream_rank,
            args=(tally, servers.addresses, _expected(num_samples, batch_size, seed, tally.rank)),
            kwargs={"options": options, "until": until, "failures": failures},
            name=f"batchwire-chaos-rank-{tally.rank}",
            daemon=True,
        )
        for tally in tallies
    ]
    try:
        for thread in ranks:
            thread.start()
        _wait_first_epochs(tallies, failures)
        rss_start = servers.rss()
        started = time.monotonic()
        rng = random.Random(seed)
        while (time.monotonic() - started < seconds or servers.stopped < stops) and not failures:
            time.sleep(every * rng.uniform(0.5, 1.5))
            how, victim = servers.stop_one(rng)
            epochs = [t.epochs for t in tallies]
            print(
                f"  {time.monotonic() - started:5.0f} s  {how} {victim}; epochs {epochs}",
                flush=True,
            )
            servers.start(victim)
        until.set()
        for thread in ranks:
            thread.join(600)
        rss_end = servers.rss()
    finally:
        until.set()
        servers.close()
    if failures:
        raise failures[0]
    return ChaosResult(
        time.monotonic() - started, servers.kills, tallies, rss_start, rss_end, servers.restarts
    )


def _wait_first_epochs(tallies: list[RankTally], failures: list[BaseException]) -> None:
    """Until every rank finished an epoch (or one failed; at most 10 minutes): RSS at the
    start is that of servers that have served an epoch."""
    warm_by = time.monotonic() + 600
    while min(t.epochs for t in tallies) < 1 and not failures and time.monotonic() < warm_by:
        time.sleep(0.1)


class _Servers:
    """Local servers on fixed ports: one stopped at a time, and started again on its port."""

    def __init__(self, data_dir: pathlib.Path, work: pathlib.Path, count: int) -> None:
        self._data_dir, self._work = data_dir, work
        self._servers = [LocalServer(data_dir, work, threads=1) for _ in range(count)]
        self.addresses = [s.address for s in self._servers]
        self.kills: collections.Counter[str] = collections.Counter()
        self.restarts: collections.Counter[int] = collections.Counter()

    def stop_one(self, rng: random.Random) -> tuple[str, str]:
        """Kill (SIGKILL) or drain (SIGTERM) one at random and wait until it is gone:
        (the signal's name, the server's address)."""
        victim = rng.randrange(len(self._servers))
        how = rng.choice([signal.SIGKILL, signal.SIGTERM])
        self._servers[victim].process.send_signal(how)
        self._servers[victim].process.wait(60)
        self._servers[victim].close()
        self.kills[how.name] += 1
        self.restarts[victim] += 1
        return how.name, self.addresses[victim]

    def start(self, address: str) -> None:
        """Start the server of ``address`` again, on its port."""
        which = self.addresses.index(address)
        port = int(address.rsplit(":", 1)[1])
        self._servers[which] = LocalServer(self._data_dir, self._work, threads=1, port=port)

    @property
    def stopped(self) -> int:
        return sum(self.kills.values())

    def rss(self) -> list[float]:
        return [rss_mib([s.pid]) for s in self._servers]

    def close(self) -> None:
        for server in self._servers:
            server.close()


def _rank_options(
    dataset: str,
    pipeline: str,
    batch_size: int,
    seed: int,
    params: Mapping[str, float] | None,
) -> dict[str, object]:
    """Each rank's RemoteLoader: every sample of an epoch, ids returned, long retries."""
    return {
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


def _expected(
    num_samples: int, batch_size: int, seed: int, rank: int
) -> Callable[[int], list[int]]:
    """The ids ``rank`` of two must receive in an epoch, by the sampler's plan."""
    from batchwire.common.sampler import Plan

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


def run_chaos(args: argparse.Namespace) -> int:
    """Servers stopped and restarted under two streaming ranks: exit 1 unless exactly once."""
    from batchwire.bench import bench_dataset, machine, write_json
    from batchwire.server.data import Manifest

    data_dir, dataset = bench_dataset(args.data_dir, args.dataset, args.photos)
    seconds = args.duration or 300.0
    print(
        f"{dataset}: 3 servers, 2 ranks, a server stopped every ~{args.every:.0f} s for "
        f"{seconds:.0f} s" + (f" (at least {args.stops} stops)" if args.stops else "")
    )
    with tempfile.TemporaryDirectory(prefix="batchwire-bench-") as work:
        result = chaos(
            data_dir,
            pathlib.Path(work),
            dataset,
            num_samples=Manifest.load(data_dir / dataset).num_samples,
            pipeline=args.pipeline,
            batch_size=args.batch_size,
            seconds=seconds,
            every=args.every,
            stops=args.stops,
            params={"size": float(args.size)} if args.size else None,
        )
    print(chaos_report(result))
    if args.json:
        record = {
            "seconds": result.seconds,
            "kills": dict(result.kills),  # asdict would rebuild a Counter from its items
            "restarts": {str(k): v for k, v in result.restarts.items()},
            "ranks": [dataclasses.asdict(r) for r in result.ranks],
            "rss_start_mib": result.rss_start_mib,
            "rss_end_mib": result.rss_end_mib,
            "exact": result.exact,
        }
        write_json(args.json, {"machine": machine(), "chaos": record})
    return 0 if result.exact else 1
