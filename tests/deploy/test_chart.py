"""The Helm chart (charts/tandem): render it and check what Kubernetes and the controller get.

Rendering (helm, or tests/deploy/helm_render) is in tests/deploy/chart_render.py. Every rendered
object is validated against the Kubernetes JSON schemas of the oldest and the newest supported
Kubernetes (kubernetes-validate, offline, strict: unknown fields fail); objects of CRDs
(Prometheus operator, KEDA) get their fields asserted here instead. The chart's secure defaults
are in tests/deploy/test_chart_security.py.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from tests.deploy.chart_render import (
    CHART,
    CRD_KINDS,
    NAMESPACE,
    RELEASE,
    Manifest,
    RenderError,
    container,
    env_of,
    flag_values,
    mount,
    pod_labels,
    selects,
    validate_k8s,
    volume,
)


def check_crd_object(doc: dict) -> None:
    spec = doc["spec"]
    if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
        endpoints = spec["endpoints" if doc["kind"] == "ServiceMonitor" else "podMetricsEndpoints"]
        assert endpoints and all(e["path"] == "/metrics" and e["port"] for e in endpoints)
        assert spec["selector"]["matchLabels"]
        assert spec["namespaceSelector"]["matchNames"] == [doc["metadata"]["namespace"]]
    elif doc["kind"] == "ScaledObject":
        assert spec["scaleTargetRef"]["kind"] == "StatefulSet"
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        for trigger in spec["triggers"]:
            # KEDA trigger metadata is a string map.
            assert all(isinstance(v, str) for v in trigger["metadata"].values()), trigger


# --- the three values files --------------------------------------------------------------------

CTRL, GPU, TPU = "tandem-controller", "tandem-gpu-executor", "tandem-tpu-executor"
# What the chart generates when the values provide no Secret: secure by default.
GENERATED_SECRETS = {
    ("Secret", "tandem-executor-tls"),
    ("Secret", "tandem-controller-tls"),
    ("Secret", "tandem-executor-token"),
    ("Secret", "tandem-admin-keys"),
}
GPU_DNS = "tandem-gpu-executor.llm.svc.cluster.local:50051"
TPU_DNS = "tandem-tpu-executor.llm.svc.cluster.local:50051"


def _pool(name: str) -> set[tuple[str, str]]:
    """The objects of one executor pool."""
    kinds = ("StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy")
    return {(kind, name) for kind in kinds}


# values.yaml alone: the controller and a GPU pool, nothing optional.
DEFAULT_OBJECTS = {
    ("ServiceAccount", "tandem"),
    ("Deployment", CTRL),
    ("Service", CTRL),
    ("ConfigMap", "tandem-dashboards"),
    ("Pod", "tandem-test"),  # the `helm test` hook
    *_pool(GPU),
    *GENERATED_SECRETS,
}
_CORE = DEFAULT_OBJECTS - _pool(GPU) - GENERATED_SECRETS  # every values file renders these
EXPECTED_OBJECTS = {
    "gpu-values.yaml": {
        *DEFAULT_OBJECTS,
        ("ServiceMonitor", CTRL),
        ("PodMonitor", "tandem-executors"),
    },
    "tpu-values.yaml": {
        *_CORE,
        *_pool(TPU),
        ("ScaledObject", TPU),
        *(GENERATED_SECRETS - {("Secret", "tandem-admin-keys")}),  # its own admin Secret
    },
    "mixed-values.yaml": {
        *DEFAULT_OBJECTS,
        ("HorizontalPodAutoscaler", GPU),
        *_pool(TPU),
        ("PodMonitor", CTRL),
        ("PodMonitor", "tandem-executors"),
    },
}
VALUES_FILES = sorted(EXPECTED_OBJECTS)


def test_ci_values_files_are_the_tested_ones():
    assert sorted(p.name for p in (CHART / "ci").glob("*.yaml")) == VALUES_FILES


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_objects_and_kubernetes_schemas(rendered, values_file):
    manifest = rendered[values_file]
    assert manifest.kinds_names() == EXPECTED_OBJECTS[values_file]
    assert len(manifest.docs) == len(EXPECTED_OBJECTS[values_file])  # no duplicates
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    for doc in manifest.docs:
        validate_k8s(doc)
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            check_crd_object(doc)
        meta = doc["metadata"]
        assert meta["namespace"] == NAMESPACE, meta
        labels = meta["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == f"tandem-{chart['version']}"


@pytest.mark.parametrize(
    "values_file,dns,static",
    [
        ("gpu-values.yaml", [GPU_DNS], []),
        ("tpu-values.yaml", [TPU_DNS], []),
        ("mixed-values.yaml", [GPU_DNS, TPU_DNS], ["gpu-box-1.lab.internal:50051"]),
    ],
)
def test_controller_discovers_each_pool_through_its_headless_service(
    rendered, values_file, dns, static
):
    m = rendered[values_file]
    ctrl = container(m.get("Deployment", CTRL), "controller")
    args = ctrl["args"]
    assert flag_values(args, "--executor-dns") == dns
    assert flag_values(args, "--executor") == static
    for address in dns:
        host, port = address.rsplit(":", 1)
        service_name, namespace, svc, _domain = host.split(".", 3)
        assert (namespace, svc) == (NAMESPACE, "svc")
        service = m.get("Service", service_name)
        # Headless and listing only ready pods: the names resolve to executors that can serve.
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"].get("publishNotReadyAddresses", False) is False
        sts = m.get("StatefulSet", service_name)
        assert sts["spec"]["serviceName"] == service_name
        assert selects(service["spec"]["selector"], pod_labels(sts))
        assert not selects(service["spec"]["selector"], pod_labels(m.get("Deployment", CTRL)))
        (svc_port,) = service["spec"]["ports"]
        ports = {p["name"]: p for p in container(sts, "executor")["ports"]}
        cport, metrics_port = ports["grpc"], ports["metrics"]
        assert int(port) == svc_port["port"] == cport["containerPort"]
        assert svc_port["targetPort"] == cport["name"] == "grpc"
        # Each executor serves its own metrics; the executors' PodMonitor scrapes that port.
        assert metrics_port["name"] == "metrics"
        assert flag_values(container(sts, "executor")["args"], "--metrics-port") == [
            str(metrics_port["containerPort"])
        ]
        if {("ServiceMonitor", CTRL), ("PodMonitor", CTRL)} & m.kinds_names():
            monitor = m.get("PodMonitor", "tandem-executors")["spec"]
            assert monitor["podMetricsEndpoints"][0]["port"] == "metrics"
            labels = pod_labels(sts)
            sel = monitor["selector"]
            assert all(labels.get(k) == v for k, v in sel["matchLabels"].items())
            assert labels["app.kubernetes.io/component"] in sel["matchExpressions"][0]["values"]
        executor_args = container(sts, "executor")["args"]
        assert flag_values(executor_args, "--port") == [port]
        assert flag_values(executor_args, "--host") == ["0.0.0.0"]
        # Controller and executors load the same model directory and serve the same name.
        for flag in ("--model", "--served-model-name"):
            assert flag_values(executor_args, flag) == flag_values(args, flag)


def test_controller_deployment(rendered):
    m = rendered["gpu-values.yaml"]
    dep = m.get("Deployment", CTRL)
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # never two controllers at once
    c = container(dep, "controller")
    assert c["image"] == "tandem/controller:0.1.0"  # the chart's appVersion
    assert flag_values(c["args"], "--model") == ["/models/Llama-3.1-8B-Instruct"]
    assert flag_values(c["args"], "--port") == ["8000"]
    assert flag_values(c["args"], "--max-model-len") == ["8192"]
    assert c["args"][-2:] == ["--max-num-seqs", "256"]  # extraArgs, last
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # Probes: alive while HTTP answers, ready only while an executor serves.
    assert c["startupProbe"]["httpGet"] == {"path": "/version", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/version", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    sec = dep["spec"]["template"]["spec"]["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["runAsUser"] == 10001
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert mount(c, "tmp")["mountPath"] == "/tmp"
    assert "nvidia.com/gpu" not in json.dumps(dep)
    svc = m.get("Service", CTRL)
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert selects(svc["spec"]["selector"], pod_labels(dep))
    monitor = m.get("ServiceMonitor", CTRL)
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert selects(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert monitor["spec"]["endpoints"][0]["port"] == "http"


def test_gpu_pool(rendered):
    sts = rendered["gpu-values.yaml"].get("StatefulSet", GPU)
    spec = sts["spec"]
    assert spec["replicas"] == 2
    assert spec["podManagementPolicy"] == "Parallel"
    pod = spec["template"]["spec"]
    c = container(sts, "executor")
    assert c["image"] == "tandem/executor-gpu:0.1.0"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["resources"]["requests"]["memory"] == "32Gi"  # values' resources kept
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert volume(sts, "shm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert mount(c, "shm")["mountPath"] == "/dev/shm"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    args = c["args"]
    assert flag_values(args, "--dtype") == ["auto"]  # the checkpoint's on a GPU
    assert flag_values(args, "--kv-cache-dtype") == ["auto"]
    assert flag_values(args, "--gpu-memory-utilization") == ["0.9"]
    # One pod, one executor over both its GPUs.
    assert flag_values(args, "--tensor-parallel-size") == ["2"]
    assert flag_values(args, "--max-model-len") == ["8192"]
    assert args[-2:] == ["--block-size", "16"]
    assert "google.com/tpu" not in json.dumps(sts)
    assert "PJRT_DEVICE" not in env_of(c)
    pdb = rendered["gpu-values.yaml"].get("PodDisruptionBudget", GPU)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert selects(spec["selector"]["matchLabels"], pod_labels(sts))


def test_tpu_pool(rendered):
    m = rendered["tpu-values.yaml"]
    sts = m.get("StatefulSet", TPU)
    pod = sts["spec"]["template"]["spec"]
    c = container(sts, "executor")
    assert c["image"] == "tandem/executor-tpu:0.1.0"
    assert c["resources"]["requests"]["google.com/tpu"] == 8
    assert c["resources"]["limits"]["google.com/tpu"] == 8
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert env_of(c)["PJRT_DEVICE"] == "TPU"
    assert volume(sts, "xla-cache")["persistentVolumeClaim"] == {"claimName": "xla-cache"}
    assert mount(c, "xla-cache")["mountPath"] == "/var/cache/tandem/xla"
    # The cache volume is the executor's cache; one executor over the pod's 8 chips.
    assert flag_values(c["args"], "--compile-cache-dir") == ["/var/cache/tandem/xla"]
    assert flag_values(c["args"], "--tensor-parallel-size") == ["8"]
    assert "runtimeClassName" not in pod
    assert "nvidia.com/gpu" not in json.dumps(sts)
    assert "--gpu-memory-utilization" not in c["args"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # KEDA owns the replica count: the StatefulSet leaves it unset.
    assert "replicas" not in sts["spec"]
    scaled = m.get("ScaledObject", TPU)
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": TPU,
    }
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 6)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"] == {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
        # values' query is a template: the release namespace is filled in.
        "query": 'sum(vllm:num_requests_waiting{namespace="llm"})',
        "threshold": "8",
    }


def test_mixed_pools_and_hpa(rendered):
    m = rendered["mixed-values.yaml"]
    gpu, tpu = m.get("StatefulSet", GPU), m.get("StatefulSet", TPU)
    assert container(gpu, "executor")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(tpu, "executor")["resources"]["limits"]["google.com/tpu"] == 1
    assert flag_values(container(gpu, "executor")["args"], "--tensor-parallel-size") == ["1"]
    assert flag_values(container(tpu, "executor")["args"], "--tensor-parallel-size") == ["1"]
    assert (
        tpu["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
        == "1x1"
    )
    assert "replicas" not in gpu["spec"] and tpu["spec"]["replicas"] == 1
    hpa = m.get("HorizontalPodAutoscaler", GPU)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": GPU,
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "tandem_num_requests_waiting"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    # The two pools never select each other's pods.
    assert not selects(gpu["spec"]["selector"]["matchLabels"], pod_labels(tpu))
    assert not selects(tpu["spec"]["selector"]["matchLabels"], pod_labels(gpu))


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_executor_probes_are_native_grpc(rendered, values_file):
    m = rendered[values_file]
    for sts in m.all("StatefulSet"):
        c = container(sts, "executor")
        # TLS is on by default and kubelet probes speak none: they use the plaintext
        # health-only port the executor serves besides its TLS port.
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        port = ports["grpc-health"]
        assert flag_values(c["args"], "--health-port") == [str(port)] and port != ports["grpc"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (sts["metadata"]["name"], probe)
            assert set(c[probe]) - {"grpc"} <= {
                "periodSeconds",
                "timeoutSeconds",
                "failureThreshold",
                "successThreshold",
                "initialDelaySeconds",
            }
        startup = c["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        # Model load for every pool; TPU pods also compile their XLA buckets.
        assert budget >= (1800 if sts["metadata"]["name"] == TPU else 600)
        assert c["livenessProbe"]["failureThreshold"] >= 3


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_network_policy_admits_only_the_controller(rendered, values_file):
    m = rendered[values_file]
    controller_labels = pod_labels(m.get("Deployment", CTRL))
    executors = m.all("StatefulSet")
    for sts in executors:
        name = sts["metadata"]["name"]
        policy = m.get("NetworkPolicy", name)["spec"]
        assert policy["policyTypes"] == ["Ingress"]
        assert policy["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
        rule, metrics_rule = policy["ingress"]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}  # same namespace, no ipBlock, no namespaceSelector
        assert selects(peer["podSelector"]["matchLabels"], controller_labels)
        for other in executors:
            assert not selects(peer["podSelector"]["matchLabels"], pod_labels(other))
        ports = {p["name"]: p["containerPort"] for p in container(sts, "executor")["ports"]}
        port, metrics_port, steps = ports["grpc"], ports["metrics"], ports["steps"]
        # The controller alone reaches the gRPC port and the step socket (--step-port).
        assert rule["ports"] == [
            {"port": port, "protocol": "TCP"},
            {"port": steps, "protocol": "TCP"},
        ]
        args = container(sts, "executor")["args"]
        assert args[args.index("--step-port") + 1] == str(steps)
        # Anyone allowed to scrape reaches the metrics port, and only that port.
        assert metrics_rule["ports"] == [{"port": metrics_port, "protocol": "TCP"}]


# --- model sources -----------------------------------------------------------------------------


def _workloads(m: Manifest) -> list[tuple[dict, str]]:
    out = [(m.get("Deployment", CTRL), "controller")]
    out += [(s, "executor") for s in m.all("StatefulSet")]
    return out


def test_model_from_pvc(rendered):
    for workload, cname in _workloads(rendered["gpu-values.yaml"]):
        assert volume(workload, "model")["persistentVolumeClaim"] == {
            "claimName": "llm-models",
            "readOnly": True,
        }
        m = mount(container(workload, cname), "model")
        assert m["mountPath"] == "/models" and m["readOnly"] is True
        assert "initContainers" not in workload["spec"]["template"]["spec"]


def test_model_from_host_path(rendered):
    for workload, cname in _workloads(rendered["tpu-values.yaml"]):
        assert volume(workload, "model")["hostPath"] == {
            "path": "/mnt/disks/models",
            "type": "Directory",
        }
        assert mount(container(workload, cname), "model")["readOnly"] is True
        args = container(workload, cname)["args"]
        assert flag_values(args, "--model") == ["/models/Llama-3.1-8B-Instruct"]


def test_model_from_init_container(rendered):
    components = []
    for workload, cname in _workloads(rendered["mixed-values.yaml"]):
        spec = workload["spec"]["template"]["spec"]
        assert volume(workload, "model")["emptyDir"] == {"sizeLimit": "10Gi"}
        (init,) = spec["initContainers"]
        assert init["image"] == "registry.example.com/tools/model-fetch:1.4.2"
        assert init["command"] == ["/bin/sh", "-c"]
        env = env_of(init)
        assert env["MODEL_DIR"] == "/models/SmolLM2-135M-Instruct"
        assert env["MODEL_NAME"] == "SmolLM2-135M-Instruct"
        components.append(env["TANDEM_COMPONENT"])
        assert mount(init, "model").get("readOnly", False) is False  # the init container fills it
        assert mount(container(workload, cname), "model")["readOnly"] is True
    assert sorted(components) == ["controller", "executor-gpu", "executor-tpu"]


# --- values that change names, images and features ---------------------------------------------


def test_release_name_namespace_and_images(renderer, tmp_path):
    m = renderer.render(
        "gpu-values.yaml",
        {
            "fullnameOverride": "chat",
            "image": {"registry": "registry.example.com/ml/", "tag": "1.2.3"},
            "controller": {"image": {"tag": "sha256:" + "ab" * 32}},
            "clusterDomain": "corp.local",
        },
        tmp_path=tmp_path,
        release="prod",
        namespace="serving",
    )
    ctrl = m.get("Deployment", "chat-controller")
    assert flag_values(container(ctrl, "controller")["args"], "--executor-dns") == [
        "chat-gpu-executor.serving.svc.corp.local:50051"
    ]
    assert container(ctrl, "controller")["image"] == (
        "registry.example.com/ml/tandem/controller@sha256:" + "ab" * 32
    )
    sts = m.get("StatefulSet", "chat-gpu-executor")
    assert container(sts, "executor")["image"] == (
        "registry.example.com/ml/tandem/executor-gpu:1.2.3"
    )
    assert {d["metadata"]["namespace"] for d in m.docs} == {"serving"}
    assert {d["metadata"]["labels"]["app.kubernetes.io/instance"] for d in m.docs} == {"prod"}


def test_chart_defaults_with_a_model_claim(renderer, tmp_path):
    """values.yaml with a model directory on a claim: a GPU pool, nothing optional."""
    claim = {"model": {"source": "pvc", "pvc": {"claimName": "models"}}}
    m = renderer.render(None, claim, tmp_path=tmp_path)
    assert m.kinds_names() == DEFAULT_OBJECTS
    for doc in m.docs:
        validate_k8s(doc)
    sts = m.get("StatefulSet", GPU)
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    assert "runtimeClassName" not in pod and "nodeSelector" not in pod
    args = container(sts, "executor")["args"]
    assert flag_values(args, "--model") == ["/models/SmolLM2-135M-Instruct"]
    assert "--max-model-len" not in args  # 0: the model's own
    ctrl = container(m.get("Deployment", CTRL), "controller")
    assert flag_values(ctrl["args"], "--executor-dns") == [GPU_DNS]
    assert "--max-model-len" not in ctrl["args"]


def test_static_executors_only(renderer, tmp_path):
    m = renderer.render(
        None,
        {
            "model": {"pvc": {"claimName": "models"}},
            "gpu": {"enabled": False},
            "controller": {"executors": ["10.1.2.3:50051", "gpu-b.lab:50052"]},
        },
        tmp_path=tmp_path,
    )
    assert (
        not m.all("StatefulSet") and not m.all("NetworkPolicy") and not m.all("PodDisruptionBudget")
    )
    args = container(m.get("Deployment", CTRL), "controller")["args"]
    assert flag_values(args, "--executor") == ["10.1.2.3:50051", "gpu-b.lab:50052"]
    assert "--executor-dns" not in args


def test_optional_features_off_and_on(renderer, tmp_path):
    m = renderer.render(
        "gpu-values.yaml",
        {
            "networkPolicy": {"enabled": False},
            "gpu": {
                "podDisruptionBudget": {"enabled": False},
                "runtimeClassName": "",
                "shm": {"enabled": False},
            },
            "controller": {"podDisruptionBudget": {"enabled": True}, "resources": None},
            "serviceAccount": {"create": False},
            "dashboards": {"enabled": False},
            "metrics": {"serviceMonitor": {"enabled": False}},
            "tests": {"enabled": False},
        },
        tmp_path=tmp_path,
    )
    kinds = {k for k, _ in m.kinds_names()}
    # The generated Secrets stay: security is not an optional feature.
    assert kinds == {"Deployment", "Service", "StatefulSet", "PodDisruptionBudget", "Secret"}
    assert m.get("PodDisruptionBudget", CTRL)["spec"]["minAvailable"] == 1
    sts = m.get("StatefulSet", GPU)
    pod = sts["spec"]["template"]["spec"]
    assert "runtimeClassName" not in pod
    assert pod["serviceAccountName"] == "default"
    assert "shm" not in {v["name"] for v in pod["volumes"]}
    # A null in user values removes the chart's default.
    assert "resources" not in container(m.get("Deployment", CTRL), "controller")
    for doc in m.docs:
        validate_k8s(doc)


def test_network_policy_extra_ingress(renderer, tmp_path):
    extra = {
        "from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        "ports": [{"port": 9400, "protocol": "TCP"}],
    }
    m = renderer.render(
        "gpu-values.yaml", {"networkPolicy": {"extraIngress": [extra]}}, tmp_path=tmp_path
    )
    policy = m.get("NetworkPolicy", GPU)
    assert policy["spec"]["ingress"][2] == extra
    validate_k8s(policy)


@pytest.mark.parametrize(
    "values_file,overrides,messages",
    [
        (None, {"model": {"source": "pvc"}}, ["model.pvc.claimName is required"]),
        (None, {"model": {"hf": {"id": ""}}}, ["model.hf.id is required"]),
        (None, {"model": {"hf": {"id": "not an id"}}}, ["model.hf.id", "/model/hf/id"]),
        (None, {"model": {"hf": {"cache": {"mountPath": "cache"}}}}, ["mountPath"]),
        (None, {"model": {"source": "hostPath"}}, ["model.hostPath.path is required"]),
        (None, {"model": {"source": "initContainer"}}, ["model.initContainer.image is required"]),
        ("gpu-values.yaml", {"gpu": {"enabled": False}}, ["no executors"]),
        (
            "tpu-values.yaml",
            {"tpu": {"chips": 4}},
            ["tpu.topology 2x4 has 8 chips but tpu.chips is 4"],
        ),
        (
            "tpu-values.yaml",
            {"tpu": {"autoscaling": {"keda": {"serverAddress": ""}}}},
            ["tpu.autoscaling.keda.serverAddress is required"],
        ),
        # values.schema.json: the offending value's path (helm prints it as a.b or /a/b).
        ("gpu-values.yaml", {"gpu": {"dtype": "int8"}}, ["gpu.dtype", "/gpu/dtype"]),
        ("gpu-values.yaml", {"gpu": {"gpuz": 2}}, ["gpuz"]),
        ("gpu-values.yaml", {"model": {"source": "s3"}}, ["model.source", "/model/source"]),
        ("tpu-values.yaml", {"tpu": {"topology": "2by4"}}, ["tpu.topology", "/tpu/topology"]),
        ("gpu-values.yaml", {"gpu": {"startupProbe": {"exec": {"command": ["true"]}}}}, ["exec"]),
        (
            "gpu-values.yaml",
            {"controller": {"executors": ["no-port"]}},
            ["controller.executors.0", "/controller/executors/0"],
        ),
    ],
)
def test_bad_values_are_refused(renderer, tmp_path, values_file, overrides, messages):
    with pytest.raises(RenderError) as err:
        renderer.render(values_file, overrides, tmp_path=tmp_path)
    assert any(m in str(err.value) for m in messages), str(err.value)


def test_values_yaml_meets_its_schema():
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


# --- dashboards and notes ----------------------------------------------------------------------


def _exported_metric_names() -> set[str]:
    """The series names the controller's /metrics and the executors' metrics ports expose
    (prometheus_client's suffixes)."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from common.host.metrics import ExecutorMetrics
    from controller.observe.fleet_collector import FleetCollector
    from controller.observe.metrics import EngineMetrics

    worker = SimpleNamespace(device_kind="cpu", device_name="cpu", memory_usage=dict)
    ExecutorMetrics(worker)
    families = [
        *EngineMetrics("m").registry.collect(),
        *FleetCollector(lambda: ([], 0), "m", True).collect(),
        *(f for f in REGISTRY.collect() if f.name.startswith("tandem:")),
    ]
    names = set()
    for family in families:
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
    return names


def test_dashboards_configmap(rendered):
    cm = rendered["gpu-values.yaml"].get("ConfigMap", "tandem-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(p.name for p in (CHART / "dashboards").rglob("*.json"))
    assert files and sorted(cm["data"]) == files
    exported = _exported_metric_names()
    for name, text in cm["data"].items():
        assert text == next((CHART / "dashboards").rglob(name)).read_text()
        dash = json.loads(text)
        assert dash["uid"] and dash["title"] and dash["panels"]
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        assert exprs
        for expr in exprs:
            used = set(re.findall(r"\b((?:vllm|tandem):[a-z0-9_:]+)", expr))
            assert used and used <= exported, (name, expr, used - exported)


def test_dashboards_hook_renders_nothing_without_files(renderer, tmp_path):
    chart = tmp_path / "tandem"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("dashboards"))
    (chart / "dashboards").mkdir()
    m = renderer.render(
        None, {"model": {"pvc": {"claimName": "models"}}}, tmp_path=tmp_path, chart=chart
    )
    assert not m.all("ConfigMap")
    assert m.all("StatefulSet")


def test_notes(renderer, tmp_path):
    if renderer.helm:
        pytest.skip("`helm template` does not print NOTES.txt; tests/deploy/helm_render does")
    notes = renderer.render("mixed-values.yaml", notes=True)
    assert "kubectl -n llm port-forward svc/tandem-controller 8000:8000" in notes
    gpu_pool = f"gpu pool: {GPU_DNS} (replicas: 1 to 3, autoscaled)"
    assert f"{gpu_pool}, each one executor over 1 GPU(s)" in notes
    assert f"tpu pool: {TPU_DNS} (replicas: 1), each one executor over 1 TPU chip(s)" in notes
    assert "static: gpu-box-1.lab.internal:50051" in notes
    assert '"model": "SmolLM2-135M-Instruct"' in notes
    assert "apiVersion" not in notes


# --- the renderer itself -----------------------------------------------------------------------

DEMO_TEMPLATE = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "demo.name" . }}
  namespace: {{ .Release.Namespace }}
data:
  chart: {{ printf "%s-%s-%s" .Chart.Name .Chart.Version .Chart.AppVersion | quote }}
  release: {{ printf "%s/%s" .Release.Name .Release.Service | quote }}
  keys: {{ keys .Values.a | sortAlpha | join "," | quote }}
  tpl: {{ tpl "{{ .Values.s }}-{{ .Release.Name }}" . | quote }}
  yaml: {{ toYaml .Values.a | quote }}
  fromYaml: {{ (fromYaml "k: v").k | quote }}
  glob: {{ .Files.Glob "files/**.txt" | len | quote }}
  conf: {{ (.Files.Glob "files/*.txt").AsConfig | quote }}
  get: {{ .Files.Get "files/sub/b.txt" | quote }}
  template: {{ .Template.Name | quote }}
  {{- if .Values.needZ }}
  z: {{ required "z is required" .Values.z }}
  {{- end }}
  list: {{ .Values.list | toJson | quote }}
"""


def test_renderer_follows_helm(renderer, tmp_path):
    """include, tpl, required, toYaml/fromYaml, .Files, .Chart, .Release, values merging."""
    chart = tmp_path / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "files" / "sub").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        "apiVersion: v2\nname: demo\nversion: 1.2.3\nappVersion: '4.5'\n"
    )
    (chart / "values.yaml").write_text("a: {b: 1, c: 2}\ns: x\nlist: [1, 2]\nneedZ: false\n")
    (chart / "templates" / "_helpers.tpl").write_text(
        '{{- define "demo.name" -}}\nname-{{ .Values.s }}\n{{- end -}}\n'
    )
    (chart / "templates" / "cm.yaml").write_text(DEMO_TEMPLATE)
    (chart / "templates" / "nothing.yaml").write_text("{{- if .Values.never }}x: 1{{ end }}\n")
    (chart / "templates" / "NOTES.txt").write_text("notes for {{ .Release.Name }}\n")
    (chart / "files" / "a.txt").write_text("A")
    (chart / "files" / "sub" / "b.txt").write_text("B")
    vals = tmp_path / "vals"
    vals.mkdir()
    m = renderer.render(
        None,
        {"a": {"c": None, "d": 3}, "s": "why", "list": [3]},
        tmp_path=vals,
        release="rel",
        namespace="ns",
        chart=chart,
    )
    (cm,) = m.docs
    assert cm["metadata"] == {"name": "name-why", "namespace": "ns"}
    assert cm["data"] == {
        "chart": "demo-1.2.3-4.5",
        "release": "rel/Helm",
        "keys": "b,d",
        "tpl": "why-rel",
        "yaml": "b: 1\nd: 3",
        "fromYaml": "v",
        "glob": "2",
        "conf": "a.txt: A",
        "get": "B",
        "template": "demo/templates/cm.yaml",
        "list": "[3]",
    }
    with pytest.raises(RenderError, match="z is required"):
        renderer.render(None, {"needZ": True}, tmp_path=vals, chart=chart)


def test_security_secrets_and_flags(renderer, tmp_path):
    """API keys, HTTPS, executor mTLS and the executor token: Secrets mounted, flags set,
    probes still able to answer (kubelet gRPC probes on the plaintext health port)."""
    m = renderer.render(
        "gpu-values.yaml",
        {
            "security": {
                "apiKeys": {"existingSecret": "api-keys"},
                "https": {"secretName": "controller-https"},
                "executorTLS": {
                    "enabled": True,
                    "secretName": "executor-tls",
                    "clientSecretName": "controller-tls",
                },
                "executorToken": {"existingSecret": "executor-token"},
            }
        },
        tmp_path=tmp_path,
    )
    dep = m.get("Deployment", CTRL)
    c = container(dep, "controller")
    args = c["args"]
    assert flag_values(args, "--api-key-file") == ["/etc/tandem/api-keys/api-keys"]
    assert flag_values(args, "--auth-exempt-path") == ["/health", "/metrics", "/version"]
    assert flag_values(args, "--ssl-certfile") == ["/etc/tandem/https/tls.crt"]
    assert flag_values(args, "--executor-tls-ca") == ["/etc/tandem/executor-tls/ca.crt"]
    assert flag_values(args, "--executor-tls-cert") == ["/etc/tandem/executor-tls/tls.crt"]
    assert flag_values(args, "--executor-tls-server-name") == ["tandem-executor"]
    assert flag_values(args, "--auth-token-file") == ["/etc/tandem/executor-token/token"]
    assert args[-2:] == ["--max-num-seqs", "256"]  # extraArgs stay last
    assert volume(dep, "executor-tls")["secret"]["secretName"] == "controller-tls"
    assert volume(dep, "api-keys")["secret"]["secretName"] == "api-keys"
    assert mount(c, "https")["readOnly"] is True
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"
    sts = m.get("StatefulSet", GPU)
    e = container(sts, "executor")
    assert flag_values(e["args"], "--tls-cert") == ["/etc/tandem/tls/tls.crt"]
    assert flag_values(e["args"], "--tls-client-ca") == ["/etc/tandem/tls/ca.crt"]
    assert flag_values(e["args"], "--health-port") == ["50052"]
    assert flag_values(e["args"], "--auth-token-file") == ["/etc/tandem/executor-token/token"]
    assert volume(sts, "tls")["secret"]["secretName"] == "executor-tls"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert e[probe]["grpc"] == {"port": 50052}
    assert {"name": "grpc-health", "containerPort": 50052, "protocol": "TCP"} in e["ports"]
    for doc in m.docs:
        validate_k8s(doc)
    off = {
        "executorTLS": {"enabled": False},
        "executorToken": {"enabled": False},
        "adminKeys": {"enabled": False},
    }
    plain = renderer.render("gpu-values.yaml", {"security": off}, tmp_path=tmp_path)
    args = container(plain.get("Deployment", CTRL), "controller")["args"]
    assert not [
        a for a in args if a.startswith(("--api-key", "--admin", "--executor-tls", "--ssl"))
    ]
    assert "--auth-token-file" not in args and not plain.all("Secret")
    executor_args = container(plain.get("StatefulSet", GPU), "executor")["args"]
    assert not {"--tls-cert", "--tls-client-ca", "--auth-token-file"} & set(executor_args)
