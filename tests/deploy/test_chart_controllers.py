"""The chart with several controllers (controller.replicas): a rolling Deployment, the headless
Service the controllers find each other through, the peer flags, the PDB; and the optional Gateway
API Inference Extension objects, validated against the CRD schemas kept in tests/deploy/crds."""

from __future__ import annotations

import copy
import re

import pytest

from tests.deploy.chart_render import (
    RenderError,
    container,
    crd_schemas,
    flag_values,
    pod_labels,
    selects,
    validate_crd_object,
    validate_k8s,
)
from tests.deploy.test_chart_flags import check_programs

CTRL = "tandem-controller"
PEERS = "tandem-controller-peers"
PEERS_DNS = f"{PEERS}.llm.svc.cluster.local:8000"
PEER_FLAGS = ("--peer", "--peer-dns", "--peer-file", "--advertise-address")
# gpu-values.yaml has 2 GPU executors; 4 let 3 controllers roll (one more during an update).
FOUR_EXECUTORS = {"gpu": {"replicas": 4}}
POOL = {
    "enabled": True,
    "endpointPicker": {"name": "tandem-epp"},
    "httpRoute": {"parentRefs": [{"name": "inference-gateway"}], "timeout": "600s"},
}


def _several(replicas: int = 3, **controller) -> dict:
    return {**FOUR_EXECUTORS, "controller": {"replicas": replicas, **controller}}


def test_one_controller_renders_as_before(renderer, tmp_path):
    m = renderer.render("gpu-values.yaml", tmp_path=tmp_path)
    dep = m.get("Deployment", CTRL)
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    args = container(dep, "controller")["args"]
    for flag in PEER_FLAGS + ("--handover-drain-timeout",):
        assert flag not in args, flag
    assert flag_values(args, "--executor-lease-seconds") == ["10"]
    assert "POD_IP" not in {e["name"] for e in container(dep, "controller")["env"]}
    assert "lifecycle" not in container(dep, "controller")
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 50
    assert PEERS not in {n for _, n in m.kinds_names()}
    assert not [d for d in m.all("PodDisruptionBudget") if d["metadata"]["name"] == CTRL]
    assert not m.all("InferencePool") and not m.all("HTTPRoute")


def test_several_controllers(renderer, tmp_path, monkeypatch):
    m = renderer.render(
        "gpu-values.yaml",
        _several(executorLeaseSeconds=6, handoverDrainTimeout=12),
        tmp_path=tmp_path,
    )
    dep = m.get("Deployment", CTRL)
    assert dep["spec"]["replicas"] == 3
    # A new controller is ready before an old one drains and releases its executors.
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    c = container(dep, "controller")
    args = c["args"]
    assert flag_values(args, "--peer-dns") == [PEERS_DNS]
    assert flag_values(args, "--advertise-address") == ["$(POD_IP):8000"]
    assert flag_values(args, "--executor-lease-seconds") == ["6"]
    assert flag_values(args, "--handover-drain-timeout") == ["12"]
    (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Admission goes on while the endpoints drop the pod, then the drain; the kill deadline
    # covers both (preStop 5 + shutdownGrace 30 + 20).
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 55

    # Peers see every controller, ready or not; clients reach the ready ones only.
    peers = m.get("Service", PEERS)
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    assert peers["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert selects(peers["spec"]["selector"], pod_labels(dep))
    client = m.get("Service", CTRL)
    assert "publishNotReadyAddresses" not in client["spec"]
    assert client["spec"].get("clusterIP") != "None"
    assert selects(client["spec"]["selector"], pod_labels(dep))
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}

    pdb = m.get("PodDisruptionBudget", CTRL)
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(dep))
    for doc in m.docs:
        validate_k8s(doc)
    # The controller's own settings loader takes the peer flags (as the kubelet expands
    # $(POD_IP), here a literal).
    assert check_programs(m, tmp_path / "pods", monkeypatch) >= 2


def test_pdb_with_several_controllers_ignores_min_available(renderer, tmp_path):
    overrides = _several(2, podDisruptionBudget={"enabled": False, "minAvailable": 1})
    pdb = renderer.render("gpu-values.yaml", overrides, tmp_path=tmp_path).get(
        "PodDisruptionBudget", CTRL
    )
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        # 2 executors: a rollout's extra controller would drive none and never be ready.
        (
            {"gpu": {"replicas": 2}, "controller": {"replicas": 2}},
            "controller.replicas (2) must be below",
        ),
        (
            {"gpu": {"replicas": 1, "autoscaling": {"enabled": True, "minReplicas": 2}}},
            "controller.replicas (3) must be below the number of executors (2",
        ),
        (
            {"controller": {"extraArgs": ["--executor-lease-seconds", "5"]}},
            "set controller.executorLeaseSeconds",
        ),
        (
            {"controller": {"extraArgs": ["--peer-dns=x:1"]}},
            "set controller.replicas instead of --peer-dns",
        ),
        ({"controller": {"replicas": 0}}, "replicas"),
        (
            {"controller": {"terminationGracePeriodSeconds": 48}},
            "must exceed controller.shutdownGrace + 15 + the preStop sleep (50)",
        ),
        ({"controller": {"executorLeaseSeconds": 0}}, "executorLeaseSeconds"),
        ({"controller": {"inferencePool": {"enabled": True}}}, "endpointPicker.name is required"),
        (
            {"controller": {"inferencePool": {**POOL, "httpRoute": {"parentRefs": []}}}},
            "httpRoute.parentRefs is required",
        ),
        (
            {"controller": {"inferencePool": {**POOL, "httpRoute": {"timeout": "10 minutes"}}}},
            "timeout",
        ),
    ],
)
def test_bad_controller_values_are_refused(renderer, tmp_path, overrides, message):
    values = _merge_values(_several(), overrides)
    with pytest.raises(RenderError, match=re.escape(message)):
        renderer.render("gpu-values.yaml", values, tmp_path=tmp_path)


def _merge_values(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_values(out[key], value)
        else:
            out[key] = value
    return out


GA = "inference.networking.k8s.io/v1"
ALPHA = "inference.networking.x-k8s.io/v1alpha2"


def _check_v1_cel_rules(pool: dict) -> None:
    """The GA CRD's CEL rules, which the kept JSON schema cannot state: a Service endpoint picker
    needs a port, and the target port numbers are unique."""
    ref = pool["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service":
        assert "port" in ref, "port is required when kind is 'Service'"
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(set(numbers)) == len(numbers), "port number must be unique"


def _check_route(m, group: str) -> None:
    route = m.get("HTTPRoute", CTRL)
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [{"group": group, "kind": "InferencePool", "name": CTRL}]
    assert rule["timeouts"] == {"request": "600s"}


def test_inference_pool_and_route(renderer, tmp_path):
    """The default: the extension's GA API (inference.networking.k8s.io/v1)."""
    assert {k for _, k in crd_schemas()} == {"InferencePool", "HTTPRoute"}
    assert {v for v, k in crd_schemas() if k == "InferencePool"} == {GA, ALPHA}
    m = renderer.render("gpu-values.yaml", _several(inferencePool=POOL), tmp_path=tmp_path)
    dep = m.get("Deployment", CTRL)
    pool = m.get("InferencePool", CTRL)
    assert pool["apiVersion"] == GA
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    labels = pool["spec"]["selector"]["matchLabels"]
    assert labels == m.get("Service", CTRL)["spec"]["selector"]
    assert selects(labels, pod_labels(dep))
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "tandem-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    _check_v1_cel_rules(pool)
    _check_route(m, "inference.networking.k8s.io")
    for doc in m.docs:
        validate_k8s(doc)  # the two CRD objects against tests/deploy/crds


def test_inference_pool_v1alpha2(renderer, tmp_path):
    """Clusters with the extension's releases before v1.0 get the v1alpha2 shape."""
    pool_values = {**POOL, "apiVersion": ALPHA}
    m = renderer.render("gpu-values.yaml", _several(inferencePool=pool_values), tmp_path=tmp_path)
    pool = m.get("InferencePool", CTRL)
    assert pool["apiVersion"] == ALPHA
    assert pool["spec"]["targetPortNumber"] == 8000
    assert pool["spec"]["selector"] == m.get("Service", CTRL)["spec"]["selector"]
    assert selects(pool["spec"]["selector"], pod_labels(m.get("Deployment", CTRL)))
    assert pool["spec"]["extensionRef"] == {
        "name": "tandem-epp",
        "portNumber": 9002,
        "failureMode": "FailClose",
    }
    _check_route(m, "inference.networking.x-k8s.io")
    for doc in m.docs:
        validate_k8s(doc)


def test_inference_pool_without_route(renderer, tmp_path):
    pool = {**POOL, "httpRoute": {"enabled": False}}
    m = renderer.render(None, {"controller": {"inferencePool": pool}}, tmp_path=tmp_path)
    assert len(m.all("InferencePool")) == 1 and not m.all("HTTPRoute")
    validate_crd_object(m.get("InferencePool", CTRL))


def test_inference_pool_api_version_is_checked(renderer, tmp_path):
    pool = {**POOL, "apiVersion": "inference.networking.x-k8s.io/v1"}
    with pytest.raises(RenderError, match="inferencePool.apiVersion"):
        renderer.render(None, {"controller": {"inferencePool": pool}}, tmp_path=tmp_path)


def _spoilt(doc: dict, spoil) -> dict:
    doc = copy.deepcopy(doc)
    spoil(doc)
    return doc


def test_crd_schemas_refuse_what_their_crds_refuse(renderer, tmp_path):
    """The kept schemas are live: a wrong field, value or missing one fails."""
    m = renderer.render("gpu-values.yaml", _several(inferencePool=POOL), tmp_path=tmp_path)
    pool, route = m.get("InferencePool", CTRL), m.get("HTTPRoute", CTRL)
    alpha_values = {**POOL, "apiVersion": ALPHA}
    alpha = renderer.render(
        "gpu-values.yaml", _several(inferencePool=alpha_values), tmp_path=tmp_path
    ).get("InferencePool", CTRL)
    bad = [
        (pool, lambda d: d["spec"].update(targetPorts=[{"number": 70000}])),
        (pool, lambda d: d["spec"].update(targetPorts=[])),
        (pool, lambda d: d["spec"].pop("selector")),
        (pool, lambda d: d["spec"]["selector"].update(matchLabels={})),
        (pool, lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Sometimes")),
        (pool, lambda d: d["spec"].update(targetPortNumber=8000)),  # the v1alpha2 field
        (alpha, lambda d: d["spec"].update(targetPortNumber=70000)),
        (alpha, lambda d: d["spec"].pop("extensionRef")),
        (alpha, lambda d: d["spec"]["extensionRef"].update(failureMode="Sometimes")),
        (alpha, lambda d: d["spec"].update(targetPorts=[{"number": 8000}])),  # the v1 field
        (route, lambda d: d["spec"]["rules"][0].update(timeouts={"request": "10 min"})),
        (route, lambda d: d["spec"]["parentRefs"][0].pop("name")),
        (route, lambda d: d["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix")),
    ]
    for doc, spoil in bad:
        with pytest.raises(AssertionError, match="invalid for its CRD"):
            validate_k8s(_spoilt(doc, spoil))
    for spoil, message in [
        (lambda d: d["spec"]["endpointPickerRef"].pop("port"), "port is required"),
        (lambda d: d["spec"].update(targetPorts=[{"number": 1}, {"number": 1}]), "unique"),
    ]:
        with pytest.raises(AssertionError, match=message):
            _check_v1_cel_rules(_spoilt(pool, spoil))


def test_notes_name_the_controllers(renderer, tmp_path):
    if renderer.helm:
        pytest.skip("`helm template` does not print NOTES.txt; tests/deploy/helm_render does")
    one = renderer.render("gpu-values.yaml", notes=True)
    assert "controllers divide" not in one
    notes = renderer.render("gpu-values.yaml", _several(), tmp_path=tmp_path, notes=True)
    assert (
        f"3 controllers divide these executors between them; they find each other at {PEERS_DNS}"
        in notes
    )
