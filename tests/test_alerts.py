"""The Prometheus alerting rules in deploy/prometheus/: Prometheus's own ``promtool`` checks
them, loads them through deploy/prometheus.yml and runs their unit tests (alerts.test.yml:
input series and the alerts expected of them, firing and quiet). Those tests skip where
promtool is not installed (``.ci/run`` installs it). Without promtool, the rules are still
held to the metrics the server exports.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import grpc
import pytest
import yaml
from deployfiles import DEPLOY, ROOT

from batchwire.server.serving._metrics import ServerMetrics
from batchwire.server.serving._streaming import StreamMetrics

RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
PROMTOOL_MISSING = (
    "promtool not found: `apt-get install prometheus` installs it, or extract usr/bin/promtool "
    "from that package as .ci/run does"
)


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(PROMTOOL_MISSING)
    return path


def run(promtool: str, *args: str) -> str:
    done = subprocess.run([promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def rules() -> list[dict[str, Any]]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    return group["rules"]


def test_promtool_checks_the_rules(promtool: str) -> None:
    output = run(promtool, "check", "rules", str(RULES.relative_to(ROOT)))
    assert f"SUCCESS: {len(rules())} rules found" in output, output


def test_the_compose_prometheus_config_loads_the_rules(promtool: str) -> None:
    output = run(promtool, "check", "config", "deploy/prometheus.yml")
    assert "1 rule files found" in output and "prometheus/alerts.yml" in output, output


def test_promtool_unit_tests_pass_with_a_firing_and_a_quiet_case_for_every_alert(
    promtool: str,
) -> None:
    output = run(promtool, "test", "rules", str(RULE_TESTS.relative_to(ROOT)))
    assert "SUCCESS" in output, output
    cases = [
        case
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
    ]
    for alert in (rule["alert"] for rule in rules()):
        expected = [case["exp_alerts"] for case in cases if case["alertname"] == alert]
        assert any(expected), f"no test has {alert} fire"
        assert [] in expected, f"no test has {alert} stay quiet"


def test_rules_use_the_metrics_and_labels_the_server_exports() -> None:
    metrics = ServerMetrics()
    StreamMetrics(metrics, "imagenet", "train")  # labelled children: their samples exist
    metrics.errors.labels(method="m", code="UNAUTHENTICATED")
    families = list(metrics.registry.collect())
    exported = {sample.name for family in families for sample in family.samples}
    labels = {"instance", "job"} | {
        label for family in families for sample in family.samples for label in sample.labels
    }
    for rule in rules():
        expr = rule["expr"]
        used = set(re.findall(r"\bbatchwire_\w+", expr))
        assert used <= exported, f"{rule['alert']}: {used - exported} not exported"
        for name, value in re.findall(r'(\w+)="([^"]*)"', expr):
            assert name in labels, f"{rule['alert']}: no metric has the label {name}"
            if name == "code":
                assert value in grpc.StatusCode.__members__, value
        templated = set(re.findall(r"\$labels\.(\w+)", str(rule.get("annotations"))))
        assert templated <= labels, f"{rule['alert']}: {templated - labels}"
