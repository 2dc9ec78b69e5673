"""The metrics an autoscaler reads: whether trainers wait on a server
(``batchwire_stream_waiting_seconds_total`` over ``batchwire_stream_seconds_total``) and how
busy its pipelines are (``batchwire_pipeline_busy_seconds_total`` over
``batchwire_pipeline_slots``), read from a real server's ``/metrics`` under a load larger than
it can serve and under a light one, as docs/operations.md says they differ; the same of a
unit of worker processes (``batchwire serve --workers 2``), whose ``/metrics`` gives each
worker's series under its ``worker`` label; and the Prometheus adapter's rules
(deploy/k8s/autoscaling) evaluated by Prometheus' own ``promtool`` over those scrapes.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from conftest import start_server
from deployfiles import K8S
from processes import serve_process
from prometheus_client.parser import text_string_to_metric_families

from batchwire.client import RemoteLoader
from batchwire.server.serving._stream_times import StreamTimes
from benchmarks.autoscale import Demand, Load, demand

# What docs/operations.md says: above these, add a server (the HPA's targets) ...
WAITING_TARGET = 0.5
BUSY_TARGET = 0.7
# ... and, of a fleet of two, one can go while both stay below half of them.


# -- the clock of stream-seconds, on a clock the test turns --------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stream_seconds_count_open_streams_up_to_the_scrape_and_waits_only_for_asked_batches() -> (
    None
):
    clock = Clock()
    times = StreamTimes(clock)
    lane = times.clock("shapes", "val")  # every batch asked for at open
    pulled = times.clock("shapes", "val")  # its client asks as it goes
    other = times.clock("photos", "train")
    clock.now += 2.0
    lane.awaiting(asked=True)
    pulled.awaiting(asked=False)  # nothing asked yet: the client is not waiting on us
    clock.now += 1.0
    assert times.totals() == {("shapes", "val"): (6.0, 1.0), ("photos", "train"): (3.0, 0.0)}
    pulled.asked()  # now it waits
    clock.now += 0.5
    pulled.asked()  # asking for more while waiting starts nothing new
    clock.now += 0.5
    lane.took()
    pulled.took()
    pulled.asked()  # asked while not awaiting (the handler is writing): no wait yet
    clock.now += 4.0
    assert times.totals()[("shapes", "val")] == (16.0, 3.0)
    lane.close()
    lane.close()  # idempotent
    other.awaiting(asked=True)
    clock.now += 1.0
    other.close()  # a wait the stream's end cuts short counts up to the end
    clock.now += 10.0
    assert times.totals() == {("shapes", "val"): (27.0, 3.0), ("photos", "train"): (9.0, 1.0)}
    pulled.close()
    clock.now += 10.0  # closed streams count no more
    assert times.totals() == {("shapes", "val"): (27.0, 3.0), ("photos", "train"): (9.0, 1.0)}
    families = {f.name: f for f in times.collect()}
    assert {s.name for s in families["batchwire_stream_seconds"].samples} == {
        "batchwire_stream_seconds_total"
    }
    waiting = {
        (s.labels["dataset"], s.labels["pipeline"]): s.value
        for s in families["batchwire_stream_waiting_seconds"].samples
    }
    assert waiting == {("shapes", "val"): 3.0, ("photos", "train"): 1.0}


# -- a real server, overloaded and then nearly idle ----------------------------------------


def scrape_text(metrics_port: int) -> str:
    url = f"http://localhost:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of a scrape by name: (labels, value)."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


class Phase:
    """Two scrapes of one server ``seconds`` apart under a load, and what they say."""

    def __init__(self, first: str, second: str, seconds: float) -> None:
        self.first, self.second, self.seconds = first, second, seconds
        self.demand: Demand = demand(samples(first), samples(second), seconds)


def measure(metrics_port: int, load: Load | None, seconds: float) -> Phase:
    """Two scrapes of the ``/metrics`` on ``metrics_port`` at least ``seconds`` apart while
    ``load`` runs (None: with no trainer)."""
    with load or contextlib.nullcontext():
        if load is not None:
            load.wait_for_batches(3)  # every trainer streams
        first = scrape_text(metrics_port)
        started = time.monotonic()
        if load is not None:
            load.wait_for_batches(3 + load.trainers * 10)
        while time.monotonic() - started < seconds:
            time.sleep(0.1)
        second = scrape_text(metrics_port)
        elapsed = time.monotonic() - started
    return Phase(first, second, elapsed)


OPTIONS = {"dataset": "shapes", "pipeline": "train", "batch_size": 16, "params": {"size": 96}}


@pytest.fixture(scope="module")
def phases(data_dir: pathlib.Path) -> Iterator[dict[str, Phase]]:
    """The same server under 4 trainers that take batches as fast as they come (more than it
    can make) and then under one that takes a batch every 0.2 s."""
    server = start_server(data_dir, metrics_port=0, num_threads=1)
    assert server.metrics_port is not None
    port = server.metrics_port
    try:
        yield {
            "overloaded": measure(port, Load(server.target, 4, pause=0.0, **OPTIONS), 5.0),
            "light": measure(port, Load(server.target, 1, pause=0.2, **OPTIONS), 5.0),
        }
    finally:
        server.stop(grace=1.0)


def test_a_batch_run_alone_keeps_its_slot_busy(data_dir: pathlib.Path) -> None:
    """A slot is busy from its run's start: a run of one batch (requests that come one at a
    time, as each worker of a unit gets a light trainer's) counts its time, not 0. Here the
    epoch is one batch, so its stream's only run has one."""
    server = start_server(data_dir, metrics_port=0, num_threads=1)
    try:
        assert server.metrics_port is not None
        before = samples(scrape_text(server.metrics_port))
        with RemoteLoader(
            server.target, dataset="shapes", batch_size=520, params={"size": 32}
        ) as loader:
            assert sum(1 for _ in loader) == 1
        after = samples(scrape_text(server.metrics_port))
    finally:
        server.stop(grace=1.0)
    busy = "batchwire_pipeline_busy_seconds_total"
    assert sum(v for _, v in after[busy]) > sum(v for _, v in before.get(busy, ())), after[busy]


def test_an_overloaded_and_a_lightly_loaded_server_differ_as_documented(
    phases: dict[str, Phase],
) -> None:
    overloaded, light = phases["overloaded"].demand, phases["light"].demand
    # The series exist with the labels the docs and the adapter's rules use.
    names = samples(phases["light"].second)
    for name in (
        "batchwire_stream_seconds_total",
        "batchwire_stream_waiting_seconds_total",
        "batchwire_pipeline_busy_seconds_total",
    ):
        assert {tuple(sorted(labels)) for labels, _ in names[name]} >= {
            ("dataset", "pipeline") if "stream" in name else ("pipeline",)
        }, name
    ((labels, slots),) = names["batchwire_pipeline_slots"]
    assert labels == {} and slots == 2  # slots_per_device (2) on the one CPU device
    # Open stream-seconds: the trainers' streams were open (a loader holds one a server
    # during its pass; between passes, briefly, none).
    assert overloaded.open_streams > 0 and light.open_streams > 0
    assert 0 <= overloaded.waiting_share <= 1 and 0 <= light.waiting_share <= 1
    # Overloaded: trainers wait most of the time and the pipelines have no room: add a server.
    assert overloaded.waiting_share > WAITING_TARGET, overloaded
    assert overloaded.busy_share > BUSY_TARGET, overloaded
    # Light: trainers hardly wait and the pipelines idle: of two such servers, one can go.
    assert light.waiting_share < WAITING_TARGET / 2, light
    assert light.busy_share < BUSY_TARGET / 2, light


# -- the Prometheus adapter's rules and KEDA's queries, evaluated by promtool ---------------

AUTOSCALING = K8S / "autoscaling"
NAMESPACE = "batchwire"
STEP_S = 15  # the series' scrape interval
STEPS = 10  # 150 s of series: more than the rules' 2 m rates
USED = (
    "batchwire_stream_seconds_total",
    "batchwire_stream_waiting_seconds_total",
    "batchwire_pipeline_busy_seconds_total",
    "batchwire_pipeline_slots",
)


def adapter_rules() -> dict[str, dict[str, Any]]:
    values = yaml.safe_load((AUTOSCALING / "prometheus-adapter-values.yaml").read_text())
    return {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}


def render(rule: dict[str, Any], pods: list[str]) -> str:
    """The rule's metricsQuery as the adapter sends it when the HPA asks for ``pods``."""
    series = re.match(r"\w+", rule["seriesQuery"])
    assert series is not None
    matchers = f'namespace="{NAMESPACE}",pod=~"{"|".join(pods)}"'
    query = rule["metricsQuery"].replace("<<.Series>>", series.group(0))
    return query.replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod")


def input_series(pod: str, phase: Phase) -> list[dict[str, str]]:
    """The pod's series as Prometheus would hold them had the server run as it did between
    the phase's scrapes for 150 s: each counter growing at its measured rate, every
    label the server gave it kept, ``namespace`` and ``pod`` added as Prometheus adds them."""
    before, after = samples(phase.first), samples(phase.second)
    found = []
    for name in USED:
        for labels, value in after.get(name, ()):  # a server with no stream yet has none
            start = next((v for lb, v in before.get(name, ()) if lb == labels), 0.0)
            step = (value - start) / phase.seconds * STEP_S if name.endswith("_total") else 0.0
            every = {**labels, "namespace": NAMESPACE, "pod": pod}
            selector = ",".join(f'{k}="{v}"' for k, v in sorted(every.items()))
            found.append({"series": f"{name}{{{selector}}}", "values": f"{value}+{step}x{STEPS}"})
    return found


def test_the_adapter_rules_and_keda_queries_say_on_real_metrics_what_the_docs_say(
    phases: dict[str, Phase], tmp_path: pathlib.Path
) -> None:
    """promtool evaluates each rule as the adapter sends it, over the real server's series
    (overloaded, light, and a pod with no stream yet): its value is the share the docs
    define, above the target overloaded, below half of it light, 0 with no stream; and each
    KEDA query is the sum of the adapter's per-pod values."""
    check_rules(tmp_path, phases["overloaded"], phases["light"])


def check_rules(
    tmp_path: pathlib.Path, overloaded: Phase, light: Phase, idle: Phase | None = None
) -> None:
    """promtool's verdict on the adapter's rules and KEDA's queries over three pods: one
    ``overloaded`` (each rule above its target), one ``light`` (below half of it) and one
    with no stream: ``idle``'s series, or else a pod that exports only its slots, as a
    server does before its first stream (each rule 0). Each rule's value must be the share
    :func:`demand` computed from the pod's two scrapes."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found (.ci/run installs it from Debian's prometheus package)")
    pods = {"overloaded": overloaded, "light": light}
    if idle is not None:
        pods["idle"] = idle
    series = [s for pod, phase in pods.items() for s in input_series(pod, phase)]
    if idle is None:
        fresh = f'batchwire_pipeline_slots{{namespace="{NAMESPACE}",pod="idle"}}'
        series.append({"series": fresh, "values": f"2+0x{STEPS}"})
    expected = {
        "batchwire_trainers_waiting_share": ("waiting_share", 0.5),
        "batchwire_pipeline_busy_share": ("busy_share", 0.7),
    }
    rules = adapter_rules()
    assert set(rules) == set(expected)
    scaled = yaml.safe_load((AUTOSCALING / "keda" / "scaledobject.yaml").read_text())
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    names = ["overloaded", "light", "idle"]
    tests = []
    for (name, (field, target)), keda in zip(expected.items(), queries, strict=True):
        query = render(rules[name], names)
        for pod in names:
            value = getattr(pods[pod].demand, field) if pod in pods else 0.0
            series.append(
                {"series": f'expected_{name}{{pod="{pod}"}}', "values": f"{value}x{STEPS}"}
            )
        tests += [
            # The share the docs define: what the test computed from the two scrapes.
            (f"abs(({query}) - on(pod) expected_{name}) < bool 1e-6", [1, 1, 1]),
            # Add a server; or, of two such, remove one; a pod with no stream counts 0.
            (f"({query}) > bool {target}", [1, 0, 0]),
            (f"({query}) < bool {target / 2}", [0, 1, 1]),
        ]
        sums = f"abs(({keda}) - scalar(sum({query}))) < bool 1e-9"
        tests.append((sums, None))
    cases = []
    for expr, values in tests:
        if values is None:
            samples_ = [{"labels": "{}", "value": 1}]
        else:
            samples_ = [
                {"labels": f'{{pod="{pod}"}}', "value": v}
                for pod, v in zip(names, values, strict=True)
            ]
        cases.append({"expr": expr, "eval_time": f"{STEP_S * STEPS}s", "exp_samples": samples_})
    file = tmp_path / "adapter.test.yml"
    file.write_text(
        yaml.safe_dump(
            {
                # promtool evaluates at multiples of this (default 1 m), eval_time rounded down.
                "evaluation_interval": f"{STEP_S}s",
                "tests": [
                    {"interval": f"{STEP_S}s", "input_series": series, "promql_expr_test": cases}
                ],
            },
            width=1000,
        )
    )
    done = subprocess.run(
        [promtool, "test", "rules", str(file)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# -- a unit of two worker processes: the same measures, summed over its workers ------------


@pytest.fixture(scope="module")
def unit_phases(
    data_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Phase]]:
    """``batchwire serve --workers 2`` (one DALI thread each) with no trainer, under 4
    trainers that take batches as fast as they come and under one that takes a batch every
    0.2 s. Each trainer's loader, given the unit's address, pulls from both workers (their
    own ports), and the parent's ``/metrics`` merges the workers' series."""
    log = tmp_path_factory.mktemp("unit") / "serve.log"
    with serve_process(data_dir, log, "--workers", "2", "--metrics-port", "0") as unit:
        assert " with 2 workers on " in unit.start_line
        port = unit.metrics_port
        yield {
            "idle": measure(port, None, 2.0),
            "overloaded": measure(port, Load(unit.address, 4, pause=0.0, **OPTIONS), 5.0),
            "light": measure(port, Load(unit.address, 1, pause=0.2, **OPTIONS), 5.0),
        }


def by_worker(text: str, name: str) -> dict[str, float]:
    """``name``'s samples of a scrape summed by their ``worker`` label."""
    sums: dict[str, float] = {}
    for labels, value in samples(text).get(name, ()):
        sums[labels["worker"]] = sums.get(labels["worker"], 0.0) + value
    return sums


def test_a_units_measures_are_its_workers_summed_and_differ_as_documented(
    unit_phases: dict[str, Phase],
) -> None:
    """Every series the rules read comes from the workers, each under its ``worker`` label,
    none from the parent (which serves no stream): summed over the pod as the rules sum
    them, the unit's shares are those of one server with the workers' streams and slots."""
    idle, overloaded, light = (unit_phases[p] for p in ("idle", "overloaded", "light"))
    found = samples(light.second)
    for name, labels in (
        ("batchwire_stream_seconds_total", {"dataset", "pipeline", "worker"}),
        ("batchwire_stream_waiting_seconds_total", {"dataset", "pipeline", "worker"}),
        ("batchwire_pipeline_busy_seconds_total", {"pipeline", "worker"}),
        ("batchwire_pipeline_slots", {"worker"}),
    ):
        assert {frozenset(lb) for lb, _ in found[name]} == {frozenset(labels)}, name
        assert {lb["worker"] for lb, _ in found[name]} == {"0", "1"}, name
    # Slots: each worker's own (slots_per_device, 2, on its CPU device), the unit's 4.
    assert by_worker(light.second, "batchwire_pipeline_slots") == {"0": 2, "1": 2}
    # Under load both workers had the trainers' streams open and ran their batches: each
    # loader pulled from both, and each worker counted its own streams' time.
    for phase in (overloaded, light):
        for name in ("batchwire_stream_seconds_total", "batchwire_pipeline_busy_seconds_total"):
            before, after = by_worker(phase.first, name), by_worker(phase.second, name)
            grown = {w: after[w] - before.get(w, 0.0) for w in after}
            assert grown.keys() == {"0", "1"} and min(grown.values()) > 0, (name, grown)
    # With no trainer: no stream open, no batch run; the shares count 0.
    assert idle.demand.open_streams == 0 and idle.demand.busy_share == 0, idle.demand
    assert idle.demand.waiting_share == 0
    # Overloaded, trainers wait and the pipelines have no room: add a server. Light, of two
    # such units one can go.
    assert overloaded.demand.waiting_share > WAITING_TARGET, overloaded.demand
    assert overloaded.demand.busy_share > BUSY_TARGET, overloaded.demand
    assert light.demand.waiting_share < WAITING_TARGET / 2, light.demand
    assert light.demand.busy_share < BUSY_TARGET / 2, light.demand


def test_the_adapter_rules_and_keda_queries_sum_a_units_workers(
    unit_phases: dict[str, Phase], tmp_path: pathlib.Path
) -> None:
    """The rules over the unit's series as Prometheus would hold them, each worker's under
    its ``worker`` label: summed by pod, the values :func:`demand` computed, above the
    targets overloaded, below half of them light, 0 idle."""
    check_rules(tmp_path, unit_phases["overloaded"], unit_phases["light"], unit_phases["idle"])
