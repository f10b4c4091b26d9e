"""With --stream-writers and HTTPS (--ssl-certfile), streams stay in the controller: a writer
could not write into the TLS session, so `plain_socket` never hands such a connection off. The
stream is whole (its [DONE] comes), and no writer counted it."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import https_client, metric_sum
from tests.e2e.test_tls import _make_certs
from tests.support.processes import spawn_controller, spawn_executor


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _make_certs(str(tmp_path_factory.mktemp("certs")))


def test_https_streams_stay_in_process(certs, default_model_dir, tmp_path):
    executor, port = spawn_executor("executor_sim", default_model_dir, str(tmp_path), "sim")
    tls = ["--ssl-certfile", certs["executor.pem"], "--ssl-keyfile", certs["executor.key"]]
    server = spawn_controller(
        default_model_dir,
        str(tmp_path),
        ["--executor", f"127.0.0.1:{port}", "--stream-writers", "1", *tls],
    )
    try:
        with https_client(server, certs["ca.pem"], str(tmp_path)) as (https, url):
            body = {"prompt": [10, 200, 3000], "max_tokens": 20, "stream": True}
            with https.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            metrics = https.get(url + "/metrics").text
            assert "tandem:stream_writer_streams_open" in metrics  # the writers are configured
            written = metric_sum(metrics, "tandem:stream_writer_streams_total{")
            assert written == 0  # and this stream was not theirs
    finally:
        server.stop()
        executor.kill()
        executor.wait()
