"""deploy/k8s/autoscaling held to Kubernetes' and KEDA's schemas and to each other: the HPA
component and the KEDA component each render with the fleet (``kubectl kustomize`` of an
overlay that adds one), the HPA and every other object validate against the Kubernetes API's
schemas (``kubernetes-validate``, strict), the ScaledObject against KEDA's own CRD schema
(``tests/schemas/keda-scaledobject-v1alpha1.json``, vendored from KEDA v2.20.2, strict as the
API server's field validation is), and both ask for the same fleet: bounds, behaviour, and
the adapter's metrics with the targets docs/operations.md gives. The adapter's rules are
evaluated over a real server's metrics in ``tests/test_demand_metrics.py``.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import yaml
from deployfiles import K8S, KUSTOMIZE_MISSING, kustomize, kustomize_command

AUTOSCALING = K8S / "autoscaling"
ADAPTER_VALUES = AUTOSCALING / "prometheus-adapter-values.yaml"
KEDA_SCHEMA = pathlib.Path(__file__).parent / "schemas" / "keda-scaledobject-v1alpha1.json"
# What KEDA's Prometheus scaler reads of a trigger's metadata (pkg/scalers/prometheus_scaler.go
# of KEDA v2.20.2, its `keda:"name=..."` fields).
PROMETHEUS_TRIGGER_KEYS = {
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "awsRegion",
    "timeout",
    "identityOwner",
}
# docs/operations.md: the targets ("above, add a server").
TARGETS = {"batchwire_trainers_waiting_share": 0.5, "batchwire_pipeline_busy_share": 0.7}


def render_with(component: str, work: pathlib.Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of an overlay that adds ``autoscaling/COMPONENT`` to the fleet, as
    uncommenting it in deploy/k8s/kustomization.yaml does."""
    if kustomize_command() is None:
        pytest.skip(KUSTOMIZE_MISSING)
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": base["namespace"],
        "resources": [os.path.relpath(K8S, work)],
        "components": [os.path.relpath(AUTOSCALING / component, work)],
    }
    (work / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    return kustomize(work)


@pytest.fixture(scope="module")
def hpa_fleet(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render_with("hpa", tmp_path_factory.mktemp("hpa"))


@pytest.fixture(scope="module")
def keda_fleet(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render_with("keda", tmp_path_factory.mktemp("keda"))


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def test_the_components_are_listed_in_the_fleets_kustomization() -> None:
    """Commented out: the fleet without an autoscaler stays as it was (tests/test_deploy.py)."""
    text = (K8S / "kustomization.yaml").read_text()
    commented = [line.strip().lstrip("#").strip() for line in text.splitlines()]
    assert "components:" in commented
    for component in ("hpa", "keda"):
        assert f"- autoscaling/{component}" in commented
        kind = yaml.safe_load((AUTOSCALING / component / "kustomization.yaml").read_text())
        assert kind["kind"] == "Component"
    assert "components" not in yaml.safe_load(text)


@pytest.mark.parametrize("component", ["hpa", "keda"])
def test_each_component_adds_its_autoscaler_to_the_fleet_and_leaves_replicas_to_it(
    component: str, hpa_fleet: list[dict[str, Any]], keda_fleet: list[dict[str, Any]]
) -> None:
    fleet = hpa_fleet if component == "hpa" else keda_fleet
    added = {"hpa": "HorizontalPodAutoscaler", "keda": "ScaledObject"}[component]
    assert sorted(o["kind"] for o in fleet) == sorted(
        ["ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "Service", added]
    )
    deployment = one(fleet, "Deployment")
    assert "replicas" not in deployment["spec"], "a re-apply would undo the autoscaler"
    # The GPU reservation per pod stays.
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    scaler = one(fleet, added)
    namespace = one(fleet, "Namespace")["metadata"]["name"]
    assert scaler["metadata"]["namespace"] == namespace
    target = scaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert target["apiVersion"] == deployment["apiVersion"]


@pytest.mark.parametrize("version", ["oldest", "latest"])
def test_the_hpa_fleet_is_valid_against_kubernetes_schemas(
    hpa_fleet: list[dict[str, Any]], version: str
) -> None:
    validator = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed"
    )
    versions = validator.utils.all_versions()
    oldest = min(versions, key=lambda v: tuple(int(n) for n in v.split(".")))
    wanted = validator.latest_version() if version == "latest" else oldest
    for document in hpa_fleet:
        try:
            validator.validate(document, wanted, strict=True)
        except validator.ValidationError as exc:
            pytest.fail(f"{document['kind']} {document['metadata']['name']}: {exc.message}")


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` refusing fields it does not declare, as the API server's strict field
    validation refuses them for a CRD (its schemas leave ``additionalProperties`` out)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            preserved = node.get("x-kubernetes-preserve-unknown-fields")
            if "properties" in node and "additionalProperties" not in node and not preserved:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validate_scaled_object(document: dict[str, Any]) -> None:
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.validate(document, strict(schema), cls=jsonschema.Draft7Validator)


def test_the_scaled_object_is_valid_against_kedas_crd_and_its_scaler(
    keda_fleet: list[dict[str, Any]],
) -> None:
    scaled = one(keda_fleet, "ScaledObject")
    validate_scaled_object(scaled)
    # The strict schema refuses a misspelt field, as the API server would.
    misspelt = copy.deepcopy(scaled)
    misspelt["spec"]["minReplicas"] = misspelt["spec"].pop("minReplicaCount")
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        validate_scaled_object(misspelt)
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        assert set(trigger["metadata"]) <= PROMETHEUS_TRIGGER_KEYS, trigger["name"]
        float(trigger["metadata"]["threshold"])  # KEDA parses it as a float
        assert trigger["metadata"]["serverAddress"].startswith("http")
    # The queries name the namespace the fleet runs in.
    namespace = one(keda_fleet, "Namespace")["metadata"]["name"]
    for trigger in scaled["spec"]["triggers"]:
        assert f'namespace="{namespace}"' in trigger["metadata"]["query"]


def quantity(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_the_hpa_and_the_scaled_object_ask_for_the_same_fleet(
    hpa_fleet: list[dict[str, Any]], keda_fleet: list[dict[str, Any]]
) -> None:
    hpa = one(hpa_fleet, "HorizontalPodAutoscaler")["spec"]
    keda = one(keda_fleet, "ScaledObject")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (
        keda["minReplicaCount"],
        keda["maxReplicaCount"],
    )
    assert hpa["behavior"] == keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # Targets: the adapter's metrics, each with docs/operations.md's number; KEDA's triggers
    # the same numbers, in the same order.
    targets = {
        m["pods"]["metric"]["name"]: quantity(m["pods"]["target"]["averageValue"])
        for m in hpa["metrics"]
    }
    assert targets == TARGETS
    assert all(m["pods"]["target"]["type"] == "AverageValue" for m in hpa["metrics"])
    thresholds = [float(t["metadata"]["threshold"]) for t in keda["triggers"]]
    assert thresholds == list(TARGETS.values())
    assert all(t["metricType"] == "AverageValue" for t in keda["triggers"])
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    assert [rule["name"]["as"] for rule in rules] == list(TARGETS)
    # For GPU pods: two at least (a server lost leaves another), scale-down slow and one pod
    # at a time (a GPU given back is minutes to get again), scale-up bounded per minute.
    assert hpa["minReplicas"] >= 2
    down, up = hpa["behavior"]["scaleDown"], hpa["behavior"]["scaleUp"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}]
    assert up["selectPolicy"] == "Min" and all(p["periodSeconds"] == 60 for p in up["policies"])


def test_termination_grace_covers_prestop_drain_and_the_units_margin(
    k8s_fleet: Callable[[], list[dict[str, Any]]],
) -> None:
    deployment = one(k8s_fleet(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    pre_stop = float(sleep[1])
    args = container["args"]
    grace = float(args[args.index("--grace") + 1])
    unit_margin = 5.0  # docs/operations.md, Stopping: a unit exits within --grace plus 5 s
    assert pod["terminationGracePeriodSeconds"] > pre_stop + grace + unit_margin
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop + grace


@pytest.fixture(scope="module")
def k8s_fleet() -> Callable[[], list[dict[str, Any]]]:
    if kustomize_command() is None:
        pytest.skip(KUSTOMIZE_MISSING)
    return kustomize


def test_the_adapter_values_are_what_the_helm_chart_reads() -> None:
    """``rules.custom`` of prometheus-community/prometheus-adapter: each rule's fields are
    the adapter's (seriesQuery, resources, name, metricsQuery) and its templates the ones
    it fills in."""
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert set(values) == {"rules"} and set(values["rules"]) == {"custom"}
    for rule in values["rules"]["custom"]:
        assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        templates = set(re.findall(r"<<[^>]*>>", rule["metricsQuery"]))
        assert templates <= {"<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"}
