"""The chart is secure by default: a default install generates the executor token, the
controller-executor mTLS certificates and an admin key, wires them into both sides, keeps them
across upgrades (Helm's lookup finds the release's Secrets), gives the controller time to drain
before the kubelet kills it, and drops every capability. The generated credentials are checked
for real: an executor and a controller started with the pods' own flags and files connect."""

from __future__ import annotations

import base64
import os
import re

import httpx
import pytest

from tests.deploy.chart_render import (
    Manifest,
    RenderError,
    container,
    flag_values,
    mount,
    validate_k8s,
    volume,
)
from tests.deploy.test_chart import CTRL, GPU, TPU, VALUES_FILES
from tests.support.processes import (
    free_port,
    spawn_controller,
    spawn_executor,
    tail_logs,
    wait_until,
)

EXECUTOR_TLS, CONTROLLER_TLS = "tandem-executor-tls", "tandem-controller-tls"
TOKEN, ADMIN = "tandem-executor-token", "tandem-admin-keys"
CLAIM = {"model": {"pvc": {"claimName": "models"}}}
# Flags that carry credentials (their files are under /etc/tandem/ in the pods).
SECURITY_FLAGS = {
    "--tls-cert",
    "--tls-key",
    "--tls-client-ca",
    "--auth-token-file",
    "--executor-tls-ca",
    "--executor-tls-cert",
    "--executor-tls-key",
    "--executor-tls-server-name",
    "--admin-api-key-file",
}


def secret_data(m: Manifest, name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in m.get("Secret", name)["data"].items()}


def workloads(m: Manifest) -> list[tuple[dict, dict]]:
    """(workload, container) of every server container."""
    out = [(m.get("Deployment", CTRL), container(m.get("Deployment", CTRL), "controller"))]
    return out + [(s, container(s, "executor")) for s in m.all("StatefulSet")]


def test_every_pod_drops_every_capability(rendered):
    for values_file in VALUES_FILES:
        for workload, _ in workloads(rendered[values_file]):
            pod = workload["spec"]["template"]["spec"]
            name = workload["metadata"]["name"]
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
                assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
                if name == TPU:
                    # The one root pool (libtpu opens root-owned device nodes), documented in
                    # values.yaml: root without any capability.
                    assert sc["runAsUser"] == 0
                else:
                    assert pod["securityContext"]["runAsNonRoot"] is True, name
                    assert sc.get("runAsUser", pod["securityContext"]["runAsUser"]) != 0


def test_a_default_install_requires_mtls_and_the_token(rendered):
    """Executors require the token and a client certificate; the controller presents both
    (from the generated Secrets) and requires an admin key on /admin/*."""
    for values_file in VALUES_FILES:
        m = rendered[values_file]
        dep = m.get("Deployment", CTRL)
        ctrl = container(dep, "controller")
        args = ctrl["args"]
        assert flag_values(args, "--executor-tls-cert") == ["/etc/tandem/executor-tls/tls.crt"]
        assert flag_values(args, "--executor-tls-ca") == ["/etc/tandem/executor-tls/ca.crt"]
        assert flag_values(args, "--auth-token-file") == ["/etc/tandem/executor-token/token"]
        assert flag_values(args, "--admin-api-key-file") == ["/etc/tandem/admin-keys/admin-keys"]
        assert volume(dep, "executor-tls")["secret"]["secretName"] == CONTROLLER_TLS
        assert volume(dep, "executor-token")["secret"]["secretName"] == TOKEN
        own = "tandem-admin" if values_file == "tpu-values.yaml" else ADMIN  # ci: its own
        assert volume(dep, "admin-keys")["secret"]["secretName"] == own
        assert mount(ctrl, "admin-keys")["readOnly"] is True
        for sts in m.all("StatefulSet"):
            e = container(sts, "executor")
            assert flag_values(e["args"], "--tls-cert") == ["/etc/tandem/tls/tls.crt"]
            assert flag_values(e["args"], "--tls-client-ca") == ["/etc/tandem/tls/ca.crt"]
            assert flag_values(e["args"], "--auth-token-file") == flag_values(
                args, "--auth-token-file"
            )
            assert volume(sts, "tls")["secret"]["secretName"] == EXECUTOR_TLS
            assert volume(sts, "executor-token")["secret"]["secretName"] == TOKEN
        for doc in m.all("Secret"):
            validate_k8s(doc)


def test_the_generated_certificates_chain_to_one_ca(rendered):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    m = rendered["gpu-values.yaml"]
    server, client = secret_data(m, EXECUTOR_TLS), secret_data(m, CONTROLLER_TLS)
    assert server["ca.crt"] == client["ca.crt"]
    ca = x509.load_pem_x509_certificate(server["ca.crt"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for data, usage in ((server, ExtendedKeyUsageOID.SERVER_AUTH), (client, None)):
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        cert.verify_directly_issued_by(ca)
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert (usage or ExtendedKeyUsageOID.CLIENT_AUTH) in eku
    names = x509.load_pem_x509_certificate(server["tls.crt"]).extensions
    sans = names.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "tandem-executor" in sans.get_values_for_type(x509.DNSName)  # serverName
    assert len(secret_data(m, TOKEN)["token"]) >= 32
    assert len(secret_data(m, ADMIN)["admin-keys"]) >= 32


def test_upgrades_keep_the_generated_secrets(renderer, tmp_path):
    install = renderer.render(None, CLAIM, tmp_path=tmp_path)
    secrets = install.all("Secret")
    assert {s["metadata"]["name"] for s in secrets} == {EXECUTOR_TLS, CONTROLLER_TLS, TOKEN, ADMIN}
    upgrade = renderer.render(None, CLAIM, tmp_path=tmp_path, lookup=secrets)
    for s in secrets:
        assert upgrade.get("Secret", s["metadata"]["name"])["data"] == s["data"]
    # A fresh install (nothing found) gets new ones.
    again = renderer.render(None, CLAIM, tmp_path=tmp_path)
    for name in (EXECUTOR_TLS, TOKEN, ADMIN):
        assert again.get("Secret", name)["data"] != install.get("Secret", name)["data"]
    # One TLS Secret lost: both are made anew, on one new CA (they must agree).
    partial = [s for s in secrets if s["metadata"]["name"] != CONTROLLER_TLS]
    healed = renderer.render(None, CLAIM, tmp_path=tmp_path, lookup=partial)
    server, client = secret_data(healed, EXECUTOR_TLS), secret_data(healed, CONTROLLER_TLS)
    assert server["ca.crt"] == client["ca.crt"] != secret_data(install, EXECUTOR_TLS)["ca.crt"]
    assert healed.get("Secret", TOKEN)["data"] == install.get("Secret", TOKEN)["data"]


def test_provided_secrets_are_used_and_none_generated(renderer, tmp_path):
    security = {
        "executorTLS": {"secretName": "cm-executor", "clientSecretName": "cm-controller"},
        "executorToken": {"existingSecret": "my-token"},
        "adminKeys": {"existingSecret": "my-admin", "key": "keys"},
    }
    m = renderer.render(None, {**CLAIM, "security": security}, tmp_path=tmp_path)
    assert not m.all("Secret")
    dep, sts = m.get("Deployment", CTRL), m.get("StatefulSet", GPU)
    assert volume(dep, "executor-tls")["secret"]["secretName"] == "cm-controller"
    assert volume(sts, "tls")["secret"]["secretName"] == "cm-executor"
    assert volume(dep, "executor-token")["secret"]["secretName"] == "my-token"
    assert volume(dep, "admin-keys")["secret"]["secretName"] == "my-admin"
    args = container(dep, "controller")["args"]
    assert flag_values(args, "--admin-api-key-file") == ["/etc/tandem/admin-keys/keys"]


@pytest.mark.parametrize(
    "controller,kill,grace",
    [
        ({}, 50, "30"),  # the defaults: 30 s grace + 20
        ({"shutdownGrace": 100}, 120, "100"),
        ({"shutdownGrace": 7.5}, 28, "7.5"),
        ({"terminationGracePeriodSeconds": 60}, 60, "30"),
    ],
)
def test_the_kubelet_waits_for_the_drain(renderer, tmp_path, controller, kill, grace):
    m = renderer.render(None, {**CLAIM, "controller": controller}, tmp_path=tmp_path)
    dep = m.get("Deployment", CTRL)
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == kill
    assert flag_values(container(dep, "controller")["args"], "--shutdown-grace") == [grace]
    assert kill > float(grace) + 15  # the flush (5 s) and the server's close (10 s)


def test_the_mixed_example_drains_for_two_minutes(rendered):
    dep = rendered["mixed-values.yaml"].get("Deployment", CTRL)
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 140
    assert flag_values(container(dep, "controller")["args"], "--shutdown-grace") == ["120"]


@pytest.mark.parametrize(
    "controller,message",
    [
        ({"terminationGracePeriodSeconds": 45}, "must exceed controller.shutdownGrace + 15"),
        ({"extraArgs": ["--shutdown-grace", "90"]}, "set controller.shutdownGrace instead"),
    ],
)
def test_a_kill_before_the_drain_is_refused(renderer, tmp_path, controller, message):
    with pytest.raises(RenderError, match=re.escape(message)):
        renderer.render(None, {**CLAIM, "controller": controller}, tmp_path=tmp_path)


# --- the generated credentials, for real --------------------------------------------------------


def materialize(m: Manifest, workload: dict, c: dict, root: str) -> list[str]:
    """Write the Secrets a container mounts under /etc/tandem/ below `root`, as the kubelet
    would; its credential flags, with paths moved below `root`."""
    for vm in c["volumeMounts"]:
        if not vm["mountPath"].startswith("/etc/tandem/"):
            continue
        data = secret_data(m, volume(workload, vm["name"])["secret"]["secretName"])
        folder = root + vm["mountPath"]
        os.makedirs(folder, exist_ok=True)
        for key, value in data.items():
            with open(os.path.join(folder, key), "wb") as f:
                f.write(value)
    args, out = c["args"], []
    for flag, value in zip(args, args[1:]):
        if flag in SECURITY_FLAGS:
            out += [flag, root + value if value.startswith("/etc/tandem/") else value]
    return out


def test_the_generated_credentials_connect_a_real_fleet(rendered, default_model_dir, tmp_path):
    """An executor with the executor pod's credential flags and files, a controller with the
    controller pod's: the controller connects (mTLS, token), and the generated admin key opens
    /admin/* while no key does not."""
    m = rendered["gpu-values.yaml"]
    dep, sts = m.get("Deployment", CTRL), m.get("StatefulSet", GPU)
    root = str(tmp_path)
    executor_flags = materialize(m, sts, container(sts, "executor"), root + "/executor")
    controller_flags = materialize(m, dep, container(dep, "controller"), root + "/controller")
    assert {"--tls-client-ca", "--auth-token-file"} <= set(executor_flags)
    proc, port = spawn_executor(
        "executor_sim", default_model_dir, root, "executor", extra=executor_flags
    )
    server = spawn_controller(
        default_model_dir, root, [*controller_flags, "--executor", f"127.0.0.1:{port}"]
    )
    server.executors.append(proc)
    server.admin_key = secret_data(m, ADMIN)["admin-keys"].decode().strip()
    try:
        wait_until(
            lambda: server.executors_state()[0]["healthy"], 120, "a healthy executor", logs=root
        )
        assert httpx.get(server.base_url + "/health", timeout=10).json() == {"status": "ok"}
        anonymous = httpx.get(server.base_url + "/admin/executors", timeout=10)
        assert anonymous.status_code == 401, tail_logs(root)
    finally:
        server.stop()
    assert free_port()  # the ports are released
