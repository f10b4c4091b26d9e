"""The chart's `helm test` hook (templates/tests/test-completion.yaml): a Pod from the
controller's image that checks /health and one short completion through the controller's
Service. Rendered, validated against the Kubernetes schemas, and its script run against a
stand-in server here (no cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from tests.deploy.chart_render import NAMESPACE, env_of, flag_values, validate_k8s
from tests.deploy.test_chart import CTRL

HOOK = "tandem-test"


def _hook(m) -> dict:
    pod = m.get("Pod", HOOK)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    return pod


def test_hook_checks_the_controller_service(rendered):
    m = rendered["gpu-values.yaml"]
    pod = _hook(m)
    validate_k8s(pod)
    spec = pod["spec"]
    (c,) = spec["containers"]
    deployment = m.get("Deployment", CTRL)["spec"]["template"]["spec"]
    (ctrl,) = [x for x in deployment["containers"] if x["name"] == "controller"]
    assert c["image"] == ctrl["image"]  # nothing else to pull
    assert spec["restartPolicy"] == "Never" and spec["securityContext"]["runAsNonRoot"]
    env = env_of(c)
    port = m.get("Service", CTRL)["spec"]["ports"][0]["port"]
    assert env["TANDEM_URL"] == f"http://{CTRL}.{NAMESPACE}.svc.cluster.local:{port}"
    assert [env["TANDEM_MODEL"]] == flag_values(ctrl["args"], "--served-model-name")
    assert "TANDEM_API_KEY_FILE" not in env  # the API is open by default


def test_hook_sends_an_api_key_over_https_when_the_release_has_them(renderer, tmp_path):
    security = {"apiKeys": {"existingSecret": "keys"}, "https": {"secretName": "tls"}}
    m = renderer.render("gpu-values.yaml", {"security": security}, tmp_path=tmp_path)
    pod = _hook(m)
    validate_k8s(pod)
    (c,) = pod["spec"]["containers"]
    env = env_of(c)
    assert env["TANDEM_URL"].startswith("https://")
    assert env["TANDEM_API_KEY_FILE"] == "/etc/tandem/api-keys/api-keys"
    assert pod["spec"]["volumes"] == [{"name": "api-keys", "secret": {"secretName": "keys"}}]


def test_hook_script_passes_against_a_serving_controller(rendered, tmp_path):
    """The hook's script, run as the Pod runs it, against a stand-in controller: it waits for
    /health, sends the key, and fails on an answer without tokens."""
    (c,) = _hook(rendered["gpu-values.yaml"])["spec"]["containers"]
    seen: list[dict] = []
    tokens = [1]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
            answer = {"choices": [{"text": " world"}], "usage": {"completion_tokens": tokens[0]}}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    keys = tmp_path / "keys"
    keys.write_text("\nsecret-1\nsecret-2\n")
    env = dict(os.environ, **env_of(c))
    env.update(TANDEM_URL=f"http://127.0.0.1:{server.server_port}", TANDEM_API_KEY_FILE=str(keys))
    try:

        def run() -> subprocess.CompletedProcess:
            cmd = [sys.executable, *c["command"][1:], *c["args"]]
            return subprocess.run(cmd, env=env, capture_output=True, text=True)

        ok = run()
        assert ok.returncode == 0, ok.stderr
        assert seen[0]["path"] == "/v1/completions" and seen[0]["auth"] == "Bearer secret-1"
        assert seen[0]["temperature"] == 0 and seen[0]["max_tokens"] == 4
        tokens[0] = 0
        assert run().returncode != 0  # an empty completion fails the test
    finally:
        server.shutdown()
