"""The chart's model sources: the default values install as they are (a Hub model fetched at
startup), and source hf with a revision, a token Secret, a cache claim or offline mode
renders the flags, environment and volumes the programs read."""

from __future__ import annotations

from tests.deploy.chart_render import (
    Manifest,
    container,
    env_of,
    flag_values,
    mount,
    validate_k8s,
    volume,
)
from tests.deploy.test_chart import CTRL, DEFAULT_OBJECTS, GPU, TPU
from tests.deploy.test_chart_flags import check_programs

DEFAULT_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CACHE = "/var/cache/huggingface"


def _servers(m: Manifest) -> list[tuple[dict, dict]]:
    """(workload, server container) of the controller and every executor pool."""
    out = [(m.get("Deployment", CTRL), container(m.get("Deployment", CTRL), "controller"))]
    return out + [(s, container(s, "executor")) for s in m.all("StatefulSet")]


def test_the_default_values_install(renderer, tmp_path, monkeypatch):
    """`helm install` with no values: it renders, every object passes the Kubernetes schemas,
    and each program takes the flags its pod is given."""
    m = renderer.render(None)
    assert m.kinds_names() == DEFAULT_OBJECTS
    for doc in m.docs:
        validate_k8s(doc)
    assert check_programs(m, tmp_path, monkeypatch) == 2
    for workload, c in _servers(m):
        assert flag_values(c["args"], "--model") == [DEFAULT_ID]
        assert flag_values(c["args"], "--served-model-name") == [DEFAULT_ID]
        assert flag_values(c["args"], "--download-dir") == [f"{CACHE}/hub"]
        assert "--revision" not in c["args"] and "--hf-token-file" not in c["args"]
        env = env_of(c)
        assert env["HF_HOME"] == CACHE and "HF_HUB_OFFLINE" not in env
        # The cache is the pod's own, writable under a read-only root filesystem.
        assert volume(workload, "model") == {"name": "model", "emptyDir": {}}
        assert mount(c, "model") == {"name": "model", "mountPath": CACHE, "readOnly": False}
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert "initContainers" not in workload["spec"]["template"]["spec"]


def test_hf_with_revision_token_secret_and_cache_claim(renderer, tmp_path, monkeypatch):
    hf = {
        "id": "Qwen/Qwen2.5-7B-Instruct",
        "revision": "a09a35458c702b33eeacc393d103063234e8bc28",
        "tokenSecret": {"name": "hub-token", "key": "HF_TOKEN"},
        "cache": {"claimName": "hub-cache", "mountPath": "/hf"},
    }
    m = renderer.render(
        "mixed-values.yaml", {"model": {"source": "hf", "hf": hf}}, tmp_path=tmp_path
    )
    assert check_programs(m, tmp_path / "pods", monkeypatch) == 3
    for workload, c in _servers(m):
        validate_k8s(workload)
        args = c["args"]
        assert flag_values(args, "--model") == [hf["id"]]
        assert flag_values(args, "--revision") == [hf["revision"]]
        assert flag_values(args, "--download-dir") == ["/hf/hub"]
        assert flag_values(args, "--hf-token-file") == ["/etc/tandem/hf-token/HF_TOKEN"]
        assert flag_values(args, "--served-model-name") == [hf["id"]]
        assert env_of(c)["HF_HOME"] == "/hf"
        assert "HF_TOKEN" not in env_of(c)  # a file, not the environment: no leak to children
        assert volume(workload, "model")["persistentVolumeClaim"] == {"claimName": "hub-cache"}
        assert volume(workload, "hf-token")["secret"] == {"secretName": "hub-token"}
        assert mount(c, "hf-token") == {
            "name": "hf-token",
            "mountPath": "/etc/tandem/hf-token",
            "readOnly": True,
        }
        assert mount(c, "model")["readOnly"] is False
        # The source hf replaces the values file's init container.
        assert "initContainers" not in workload["spec"]["template"]["spec"]
    assert {w["metadata"]["name"] for w, _ in _servers(m)} == {CTRL, GPU, TPU}


def test_hf_offline_reads_a_filled_claim_read_only(renderer, tmp_path):
    hf = {"offline": True, "cache": {"claimName": "filled", "sizeLimit": "1Gi"}}
    m = renderer.render(None, {"model": {"hf": hf, "servedModelName": "chat"}}, tmp_path=tmp_path)
    for workload, c in _servers(m):
        assert env_of(c)["HF_HUB_OFFLINE"] == "1"
        assert mount(c, "model")["readOnly"] is True
        assert volume(workload, "model")["persistentVolumeClaim"] == {"claimName": "filled"}
        assert flag_values(c["args"], "--served-model-name") == ["chat"]


def test_hf_cache_empty_dir_limits(renderer, tmp_path):
    hf = {"cache": {"sizeLimit": "40Gi", "medium": "Memory"}}
    m = renderer.render(None, {"model": {"hf": hf}}, tmp_path=tmp_path)
    for workload, _ in _servers(m):
        assert volume(workload, "model")["emptyDir"] == {"medium": "Memory", "sizeLimit": "40Gi"}


def test_notes_say_how_to_serve_your_own_model(renderer):
    if renderer.helm:
        return  # `helm template` prints no NOTES.txt; tests/deploy/helm_render does
    notes = renderer.render(None, notes=True)
    assert f"Model: {DEFAULT_ID} from the Hugging Face Hub" in notes
    assert "--set model.source=hf,model.hf.id=ORG/NAME" in notes
    assert "model.hf.tokenSecret.name=SECRET" in notes
    assert "--set model.source=pvc,model.pvc.claimName=CLAIM,model.name=DIR" in notes
    directory = renderer.render("gpu-values.yaml", notes=True)
    assert "Model: the directory /models/Llama-3.1-8B-Instruct (pvc)." in directory
