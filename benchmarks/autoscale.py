"""A fleet that follows its trainers: ``python -m benchmarks --autoscale``.

Real ``batchwire serve`` processes on 127.0.0.1, 127.0.0.2, ... (one port, as the pods of a
headless Service), each pinned to a core of its own where there are enough, behind a name
(``dns:///fleet.test:PORT``) answered by a stand-in for DNS in this process that names the
servers that are SERVING, as the Service names ready pods. Trainers (``RemoteLoader`` threads
here, ids checked against each epoch's plan) rise and fall, and an autoscaler that does
Kubernetes' HorizontalPodAutoscaler's arithmetic (:func:`recommend`) on the servers'
``/metrics``, every ``period`` seconds, starts and stops servers: up at once, down once the
recommendation stayed lower for the scale-down window; a server stops as a pod does
(it leaves the name, then SIGTERM: it drains).

Prints each tick (servers, what the metrics say, the recommendation, the fleet's rate) and
the figures of docs/deployment.md: how fast the fleet grows (load up to a new server's
first batch), how it shrinks, and what a scale-down costs a trainer (its longest wait for
a batch around it, and the server's drain). ``tests/test_autoscaler.py`` plays the same
scenario and checks every epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from batchwire.bench import wait_serving
from batchwire.client import RemoteLoader
from batchwire.common.sampler import Plan

__all__ = [
    "Demand",
    "FleetRun",
    "Load",
    "Policy",
    "ServerProcess",
    "demand",
    "play",
    "recommend",
    "run_autoscale",
]

NAME = "fleet.test"
Samples = Mapping[str, Sequence[tuple[Mapping[str, str], float]]]

# -- what a server's /metrics says of its demand -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Demand:
    """What two scrapes of one server ``seconds`` apart say: the share of stream time its
    trainers waited on it, how busy its pipeline slots were, the mean number of streams
    open, and images sent per second."""

    waiting_share: float
    busy_share: float
    open_streams: float
    images_per_second: float


def _total(samples: Samples, name: str) -> float:
    return sum(value for _, value in samples.get(name, ()))


def demand(before: Samples, after: Samples, seconds: float) -> Demand:
    """The :class:`Demand` between two scrapes (every series summed over its labels, as
    the adapter's rules sum a pod's series: datasets, pipelines and workers):
    ``rate(waiting) / rate(open)`` (0 with no stream open), and ``rate(busy) / slots``."""

    def rate(name: str) -> float:
        return (_total(after, name) - _total(before, name)) / seconds

    open_ = rate("batchwire_stream_seconds_total")
    waiting = rate("batchwire_stream_waiting_seconds_total")
    slots = _total(after, "batchwire_pipeline_slots")
    return Demand(
        waiting_share=waiting / open_ if open_ > 0 else 0.0,
        busy_share=rate("batchwire_pipeline_busy_seconds_total") / slots if slots else 0.0,
        open_streams=open_,
        images_per_second=rate("batchwire_samples_sent_total"),
    )


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of ``url`` (a ``/metrics``) by name."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


# -- the HorizontalPodAutoscaler's arithmetic ------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """The autoscaler's settings: deploy/k8s/autoscaling's targets (the mean over serving
    pods of each metric), Kubernetes' default tolerance, bounds, and the stabilization
    windows in ticks (the manifests': 60 s up, 600 s down, ticks of the HPA's 15 s sync
    period): up to the lowest recommendation of the last ``scale_up_ticks``, down to the
    highest of the last ``scale_down_ticks``."""

    waiting_target: float = 0.5
    busy_target: float = 0.7
    tolerance: float = 0.1
    min_replicas: int = 1
    max_replicas: int = 2
    scale_up_ticks: int = 2
    scale_down_ticks: int = 3


def recommend(current: int, pods: Sequence[Demand], policy: Policy) -> int:
    """Replicas the HPA asks for, for ``current`` replicas whose serving pods report ``pods``:
    for each metric (a ``Pods`` metric with an ``AverageValue`` target), the current count
    where the mean is within ``tolerance`` of the target, else ``ceil(sum / target)`` (the
    mean over the pods that report, times their number); pods that report nothing yet
    (warming up) count 0 when that scales up, as the HPA counts pods with no metrics. The
    largest proposal, within the bounds."""
    if not pods:
        return max(policy.min_replicas, min(current, policy.max_replicas))
    proposals = []
    for values, target in (
        ([pod.waiting_share for pod in pods], policy.waiting_target),
        ([pod.busy_share for pod in pods], policy.busy_target),
    ):
        ratio = statistics.fmean(values) / target
        if abs(ratio - 1.0) <= policy.tolerance:
            proposals.append(current)
            continue
        proposal = math.ceil(sum(values) / target)
        if proposal > current and len(values) < current:
            # Pods without metrics: 0 of the metric, and the ratio is asked again.
            padded = sum(values) / (current * target)
            proposal = current if padded <= 1.0 + policy.tolerance else math.ceil(padded * current)
        proposals.append(proposal)
    return max(policy.min_replicas, min(max(proposals), policy.max_replicas))


# -- servers as pods -----------------------------------------------------------------------


class ServerProcess:
    """``batchwire serve`` on ``host:port`` (0: any free port), metrics on a free port,
    pipelines on the CPU (``cpus``: its taskset list), until :meth:`stop`."""

    def __init__(
        self,
        data_dir: pathlib.Path,
        host: str,
        port: int,
        log: pathlib.Path,
        *,
        cpus: str | None = None,
        grace: float = 10.0,
    ) -> None:
        self.host, self.log = host, log
        started = time.monotonic()
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
        launcher = ["taskset", "-c", cpus] if cpus is not None else []
        command = [
            *launcher,
            sys.executable,
            "-m",
            "batchwire.cli",
            "serve",
            *("--data-dir", str(data_dir), "--host", host, "--port", str(port)),
            *("--metrics-port", "0", "--device", "cpu", "--num-threads", "1"),
            *("--slots-per-device", "1", "--grace", f"{grace:g}"),
        ]
        with open(log, "w") as stderr:
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
            )
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r" on (\S+):(\d+); metrics on port (\d+)$", line.strip())
        if match is None:
            self.process.kill()
            self.process.wait(10)
            raise RuntimeError(f"batchwire serve did not start: {log.read_text()[-2000:]}")
        self.port, self.metrics_port = int(match.group(2)), int(match.group(3))
        self.address = f"{host}:{self.port}"
        wait_serving(self.address, 120.0)
        self.warm_up_seconds = time.monotonic() - started  # process start to SERVING
        self.baseline = self.scrape()
        self.baseline_at = time.monotonic()
        self.drain_seconds: float | None = None

    def scrape(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        return scrape(f"http://{self.host}:{self.metrics_port}/metrics")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (it drains) and wait; the exit status. :attr:`drain_seconds`: to its exit."""
        stopping = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            status = self.process.wait(10)
        self.drain_seconds = time.monotonic() - stopping
        if self.process.stdout is not None:
            self.process.stdout.close()
        return status

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


@contextlib.contextmanager
def resolving(name: str, answer: Callable[[], list[str]]) -> Iterator[None]:
    """While the block runs, ``name`` resolves (``socket.getaddrinfo``, in this process) to
    the addresses ``answer()`` gives at each lookup: a stand-in for a headless Service's
    DNS name, which names the pods that are ready."""
    resolve = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *rest: Any, **options: Any) -> Any:
        if host != name:
            return resolve(host, port, *rest, **options)
        family, kind = socket.AF_INET, socket.SOCK_STREAM
        return [(family, kind, 6, "", (ip, int(port))) for ip in answer()]

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.getaddrinfo = resolve


# -- trainers ------------------------------------------------------------------------------


class Trainer(threading.Thread):
    """One trainer's loop: epochs of a ``RemoteLoader`` (shuffled by its own seed), a pause
    after each batch (its compute), until stopped; each epoch's ids and each batch's time
    kept. An epoch cut short by the stop is kept apart (:attr:`last`)."""

    def __init__(
        self, target: str, pause: float, seed: int, options: Mapping[str, Any], name: str
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._target, self.pause, self.seed = target, pause, seed
        self._options = dict(options)
        self.stopping = threading.Event()
        self.epochs: list[np.ndarray] = []  # the ids of each whole epoch, in order
        self.last = np.zeros(0, np.int64)  # the epoch the stop cut short
        self.batch_times: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with RemoteLoader(
                self._target,
                return_ids=True,
                seed=self.seed,
                shuffle=True,
                drop_last=False,
                normalize=False,
                **self._options,
            ) as loader:
                epoch = 0
                while not self.stopping.is_set():
                    loader.set_epoch(epoch)
                    ids: list[np.ndarray] = []
                    for _, _, batch_ids in loader:
                        ids.append(batch_ids.numpy())
                        self.batch_times.append(time.monotonic())
                        if self.stopping.is_set() or (
                            self.pause and self.stopping.wait(self.pause)
                        ):
                            break
                    else:
                        self.epochs.append(np.concatenate(ids))
                        epoch += 1
                        continue
                    self.last = np.concatenate(ids)
        except BaseException as exc:  # reported by Load
            self.error = exc

    def plan(self, epoch: int, num_samples: int) -> np.ndarray:
        """The ids epoch ``epoch`` must deliver, in order."""
        batch_size = int(self._options["batch_size"])
        share = Plan(
            num_samples=num_samples,
            batch_size=batch_size,
            seed=self.seed,
            epoch=epoch,
            shuffle=True,
            drop_last=False,
        )
        return np.asarray(share.share())

    def exact(self, num_samples: int) -> list[str]:
        """What is wrong with the epochs it saw (nothing: [])."""
        wrong = [
            f"{self.name} epoch {epoch}: {len(ids)} ids, not its plan's"
            for epoch, ids in enumerate(self.epochs)
            if not np.array_equal(ids, self.plan(epoch, num_samples))
        ]
        head = self.plan(len(self.epochs), num_samples)[: len(self.last)]
        if not np.array_equal(self.last, head):
            wrong.append(f"{self.name}'s last epoch is not its plan's first {len(self.last)} ids")
        return wrong


class Load:
    """``trainers`` :class:`Trainer` threads on ``target`` while the ``with`` block runs
    (more with :meth:`add`); raises the first trainer's error at the end."""

    def __init__(self, target: str, trainers: int, *, pause: float, **options: Any) -> None:
        self._target, self._options = target, options
        self.all: list[Trainer] = []
        self._initial = (trainers, pause)

    @property
    def trainers(self) -> int:
        return sum(1 for t in self.all if not t.stopping.is_set())

    def add(self, count: int, pause: float) -> list[Trainer]:
        added = [
            Trainer(
                self._target,
                pause,
                len(self.all) + i,
                self._options,
                f"trainer-{len(self.all) + i}",
            )
            for i in range(count)
        ]
        self.all += added
        for trainer in added:
            trainer.start()
        return added

    def stop(self, trainers: Sequence[Trainer]) -> None:
        for trainer in trainers:
            trainer.stopping.set()
        for trainer in trainers:
            trainer.join(60)

    def batches(self) -> int:
        return sum(len(t.batch_times) for t in self.all)

    def wait_for_batches(self, count: int, timeout: float = 120.0) -> None:
        """Until the trainers took ``count`` batches in all, or raise their error."""
        deadline = time.monotonic() + timeout
        while self.batches() < count:
            failed = [t.error for t in self.all if t.error is not None]
            if failed:
                raise failed[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.batches()} of {count} batches in {timeout:.0f} s")
            time.sleep(0.05)

    def __enter__(self) -> Load:
        self.add(*self._initial)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(self.all)
        failed = [t.error for t in self.all if t.error is not None]
        if failed and exc_info[0] is None:
            raise failed[0]


# -- the scenario --------------------------------------------------------------------------


@dataclasses.dataclass
class Tick:
    at: float  # seconds since the run began
    phase: str
    servers: int
    waiting_share: float  # the mean over the serving servers
    busy_share: float
    recommended: int
    images_per_second: float  # the fleet's
    settled: bool  # the tick's window was all in its phase (the load changed before it)


@dataclasses.dataclass
class FleetRun:
    """What :func:`play` saw: its ticks and events, the trainers and the servers."""

    ticks: list[Tick] = dataclasses.field(default_factory=list)
    events: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    trainers: list[Trainer] = dataclasses.field(default_factory=list)
    started: list[ServerProcess] = dataclasses.field(default_factory=list)
    stopped: list[tuple[float, ServerProcess, int]] = dataclasses.field(default_factory=list)
    scaled_up: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)
    # ^ (load rose to decision, decision to SERVING, SERVING to its first batch) seconds
    scaled_down: list[float] = dataclasses.field(default_factory=list)  # load fell to stop
    begun: float = 0.0  # time.monotonic() at the start: ticks and events count from it

    def rates(self, phase: str, servers: int) -> list[float]:
        """The fleet's rate at the settled ticks of ``phase`` with ``servers`` servers."""
        return [
            t.images_per_second
            for t in self.ticks
            if t.phase == phase and t.servers == servers and t.settled
        ]


class _Fleet:
    """The servers of a run, on 127.0.0.1, .2, ... at one port; the name names those up."""

    def __init__(self, data_dir: pathlib.Path, work: pathlib.Path, run: FleetRun) -> None:
        self._data_dir, self._work, self._run = data_dir, work, run
        self.up: list[ServerProcess] = []
        self.port = 0
        cpus = sorted(os.sched_getaffinity(0))
        self._cpus = [str(c) for c in cpus] if shutil.which("taskset") and len(cpus) > 1 else []

    def answer(self) -> list[str]:
        return [server.host for server in list(self.up)]

    def start(self) -> ServerProcess:
        index = len(self._run.started)
        cpus = self._cpus[index % len(self._cpus)] if self._cpus else None
        server = ServerProcess(
            self._data_dir,
            f"127.0.0.{index + 1}",
            self.port,
            self._work / f"server-{index + 1}.log",
            cpus=cpus,
        )
        self.port = server.port
        self._run.started.append(server)
        self.up.append(server)  # in the name once SERVING, as a pod once ready
        return server

    def stop_one(self, now: float) -> ServerProcess:
        server = self.up.pop()  # out of the name first, as a terminating pod
        status = server.stop()
        self._run.stopped.append((now, server, status))
        return server

    def close(self) -> None:
        for server in self._run.started:
            server.kill()


def play(
    data_dir: pathlib.Path,
    work: pathlib.Path,
    *,
    dataset: str = "shapes",
    num_samples: int = 520,
    policy: Policy | None = None,
    period: float = 2.0,
    heavy: int = 4,
    light_pause: float = 0.1,
    settle_ticks: int = 4,
    timeout: float = 120.0,
    options: Mapping[str, Any] | None = None,
) -> FleetRun:
    """The scenario: one light trainer on ``min_replicas`` servers; ``heavy`` trainers more
    (no pause) until the fleet reached ``max_replicas`` and ran ``settle_ticks`` ticks so;
    then those stop and the light one runs on until the fleet is back to ``min_replicas``
    and ``settle_ticks`` ticks more. Ticks every ``period`` seconds."""
    policy = policy or Policy()
    run = FleetRun()
    fleet = _Fleet(data_dir, work, run)
    begun = run.begun = time.monotonic()
    loader = {
        "dataset": dataset,
        "pipeline": "train",
        "batch_size": 16,
        "params": {"size": 96},
        "resolve_every": 0.5,
        **(options or {}),
    }

    def event(text: str) -> None:
        run.events.append((time.monotonic() - begun, text))

    try:
        for _ in range(policy.min_replicas):
            fleet.start()
        with resolving(NAME, fleet.answer):
            load = Load(f"dns:///{NAME}:{fleet.port}", 1, pause=light_pause, **loader)
            with load:
                run.trainers = load.all
                load.wait_for_batches(5)
                autoscaler = _Autoscaler(fleet, policy, run, begun, event)
                for _ in range(2):
                    autoscaler.tick("light", period)
                heavy_trainers = load.add(heavy, 0.0)
                event(f"load rises: {heavy} trainers more, taking batches as fast as they come")
                autoscaler.load_changed()
                autoscaler.until("heavy", period, policy.max_replicas, settle_ticks, timeout)
                load.stop(heavy_trainers)
                event(f"load falls: the {heavy} trainers stop")
                autoscaler.load_changed()
                autoscaler.until("light", period, policy.min_replicas, settle_ticks, timeout)
                run.trainers = load.all
    finally:
        fleet.close()
    return run


class _Autoscaler:
    def __init__(
        self,
        fleet: _Fleet,
        policy: Policy,
        run: FleetRun,
        begun: float,
        event: Callable[[str], None],
    ) -> None:
        self._fleet, self._policy, self._run, self._begun = fleet, policy, run, begun
        self._event = event
        self._recommendations: list[int] = []
        self._load_changed = time.monotonic()
        self._previous: dict[int, tuple[float, Samples]] = {}
        self._last_tick = time.monotonic()

    def load_changed(self) -> None:
        self._load_changed = time.monotonic()

    def until(self, phase: str, period: float, replicas: int, ticks: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        steady = 0
        while steady < ticks and time.monotonic() < deadline:
            self.tick(phase, period)
            steady = steady + 1 if len(self._fleet.up) == replicas else 0

    def tick(self, phase: str, period: float) -> None:
        time.sleep(period)  # the metrics' window: one tick
        now = time.monotonic()
        settled = self._last_tick >= self._load_changed
        self._last_tick = now
        pods = []
        for server in list(self._fleet.up):
            since, before = self._previous.get(id(server), (server.baseline_at, server.baseline))
            after = server.scrape()
            pods.append(demand(before, after, now - since))
            self._previous[id(server)] = (now, after)
        current = len(self._fleet.up)
        wanted = recommend(current, pods, self._policy)
        # The HPA's stabilization: up to the lowest recommendation of its window, down to
        # the highest of its.
        policy = self._policy
        window = max(policy.scale_up_ticks, policy.scale_down_ticks)
        self._recommendations = [*self._recommendations, wanted][-window:]
        if wanted > current:
            wanted = max(current, min(self._recommendations[-policy.scale_up_ticks :]))
        elif wanted < current:
            wanted = min(current, max(self._recommendations[-policy.scale_down_ticks :]))
        self._run.ticks.append(
            Tick(
                at=now - self._begun,
                phase=phase,
                servers=current,
                waiting_share=statistics.fmean(p.waiting_share for p in pods) if pods else 0.0,
                busy_share=statistics.fmean(p.busy_share for p in pods) if pods else 0.0,
                recommended=wanted,
                images_per_second=sum(p.images_per_second for p in pods),
                settled=settled,
            )
        )
        if wanted > current:  # one at a time, as the manifests' policy allows per period
            decided = time.monotonic()
            server = self._fleet.start()
            self._event(f"scale up to {current + 1}: {server.address} SERVING")
            first = self._first_batch(server)
            self._run.scaled_up.append(
                (decided - self._load_changed, server.warm_up_seconds, first)
            )
            self._event(f"{server.address} sent its first batch {first:.1f} s after SERVING")
        elif wanted < current:
            self._run.scaled_down.append(time.monotonic() - self._load_changed)
            server = self._fleet.stop_one(time.monotonic() - self._begun)
            self._event(
                f"scale down to {current - 1}: {server.address} drained and exited in "
                f"{server.drain_seconds:.1f} s"
            )

    @staticmethod
    def _first_batch(server: ServerProcess, timeout: float = 60.0) -> float:
        """Seconds from SERVING (and in the name) to the server's first batch sent."""
        serving = time.monotonic()
        while time.monotonic() - serving < timeout:
            if _total(server.scrape(), "batchwire_batches_sent_total") > 0:
                return time.monotonic() - serving
            time.sleep(0.05)
        return math.inf


def scale_down_cost(run: FleetRun, seconds: float = 10.0) -> list[tuple[float, float]]:
    """For each server stopped and each trainer that took batches through the stop: its
    longest wait for a batch (the time between two batches, its pause deducted) in the
    ``seconds`` from the stop, beside its median wait over the run."""
    costs = []
    for at, _, _ in run.stopped:
        stop = run.begun + at
        for trainer in run.trainers:
            times = np.asarray(trainer.batch_times)
            if len(times) < 3 or times[-1] < stop:
                continue
            gaps = np.diff(times) - trainer.pause
            around = gaps[(times[1:] >= stop) & (times[:-1] <= stop + seconds)]
            if len(around):
                costs.append((float(around.max()), float(np.median(gaps))))
    return costs


def run_autoscale(args: argparse.Namespace) -> int:
    """``--autoscale``: play the scenario on the ``shapes``-like generated dataset."""
    from batchwire.server.data import ingest, write_image_folders

    with tempfile.TemporaryDirectory(prefix="batchwire-autoscale-") as temporary:
        work = pathlib.Path(temporary)
        write_image_folders(work / "images", per_class=130, size=64, seed=1)
        ingest(work / "images", work / "datasets", name="shapes", shard_size=200)
        run = play(work / "datasets", work)
        print_run(run, 520)
    return 0


def print_run(run: FleetRun, num_samples: int) -> None:
    print(
        f"{'t (s)':>6} {'phase':<6} {'servers':>7} {'waiting':>7} {'busy':>5} {'HPA':>4} {'images/s':>9}"
    )
    for tick in run.ticks:
        print(
            f"{tick.at:6.1f} {tick.phase:<6} {tick.servers:7d} {tick.waiting_share:7.2f} "
            f"{tick.busy_share:5.2f} {tick.recommended:4d} {tick.images_per_second:9.0f}"
        )
    for at, text in run.events:
        print(f"{at:6.1f} {text}")
    for rise, warm, first in run.scaled_up:
        print(
            f"grew: {rise:.1f} s from the load rising to the decision, {warm:.1f} s to SERVING, "
            f"{first:.1f} s more to its first batch"
        )
    for fall in run.scaled_down:
        print(f"shrank: {fall:.1f} s from the load falling to the scale-down")
    one, two = run.rates("heavy", 1), run.rates("heavy", 2)
    if one and two:
        print(
            f"heavy load: {statistics.median(one):.0f} images/s on 1 server, "
            f"{statistics.median(two):.0f} on 2 (medians of the ticks)"
        )
    for longest, median in scale_down_cost(run):
        print(
            f"a scale-down cost a trainer a wait of {longest:.2f} s for a batch at most "
            f"(its median wait {median:.3f} s)"
        )
    wrong = [w for trainer in run.trainers for w in trainer.exact(num_samples)]
    epochs = sum(len(t.epochs) for t in run.trainers)
    print(
        f"{epochs} whole epochs over {len(run.trainers)} trainers: "
        + ("; ".join(wrong) or "every one exact")
    )
