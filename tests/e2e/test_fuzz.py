"""Hostile input: generated requests from the app's own OpenAPI schema (schemathesis), a
hand-written list of malformed bodies and generators of hostile ones (huge n, huge prompt
lists, long stop strings, extreme integers, odd Unicode, deep and large JSON). Never a 5xx,
never a hung request; after every batch no executor was lost, the server is healthy and its
memory has not grown past a bound; at the end it serves the same greedy completion as before,
runs nothing and holds no KV block."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.e2e.fuzz_bodies import hostile_bodies
from tests.e2e.helpers import (
    assert_no_blocks_in_use,
    gauge,
    metric_sum,
)
from tests.support.processes import rss_mib, start_server

MAX_EXAMPLES = 20  # per operation and mode; keeps the schema run near a minute on two cores
TIMEOUT = 60.0  # seconds any single request may take
MAX_BYTES = 256 * 1024  # the fuzz server's body bound
REFERENCE = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
GENERATION = {"/v1/completions", "/v1/chat/completions"}
RSS_BOUND_MIB = 200  # controller memory growth allowed over the whole module


@pytest.fixture(scope="module")
def fuzz_server(default_model_dir, tmp_path_factory):
    """A server with a short context, so no generated request can run long."""
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("fuzz")),
        controller_args=["--max-model-len", "256", "--max-request-bytes", str(MAX_BYTES)],
    )
    r = httpx.post(s.base_url + "/v1/completions", json=REFERENCE, timeout=TIMEOUT)
    assert r.status_code == 200
    s.reference_text = r.json()["choices"][0]["text"]
    s.rss_start = rss_mib(s.controller.pid)
    s.losses_start = _executors_lost(s)
    yield s
    s.stop()


def _executors_lost(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return metric_sum(text, "tandem:executor_lost_total")


def assert_sound_after_batch(server, batch: str) -> None:
    """What every batch must leave: no executor lost, a healthy server, bounded memory."""
    assert _executors_lost(server) == server.losses_start, f"executor lost during {batch}"
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200, batch
    growth = rss_mib(server.controller.pid) - server.rss_start
    assert growth < RSS_BOUND_MIB, f"controller RSS +{growth:.0f} MiB after {batch}"


def _bounded(body):
    """Cap generation lengths of a generated body (other fields stay as generated)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 4:
            body[key] = 4
    if "max_tokens" not in body:
        body["max_tokens"] = 4
    return body


@pytest.mark.slow
def test_schema_fuzz_never_5xx(fuzz_server):
    """Positive and negative cases of every operation in /openapi.json."""
    schema = schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")
    failures: list[str] = []
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                derandomize=True,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            def run(case):
                nonlocal calls
                if case.path in GENERATION:
                    case.body = _bounded(case.body)
                response = case.call(timeout=TIMEOUT)
                calls += 1
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.path} {case.body!r:.300} -> "
                        f"{response.status_code} {response.text[:300]}"
                    )

            try:
                run()
            except Unsatisfiable:  # no negative case exists for an operation without input
                pass
            assert_sound_after_batch(fuzz_server, f"{operation.label} {mode.value}")
    assert calls > 100
    assert not failures, "\n".join(failures)


def _raw_cases() -> list[tuple[str, bytes | str, str]]:
    """(path, body, content type) of malformed requests."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    js = "application/json"
    msg = [{"role": "user", "content": "hi"}]

    def j(obj) -> bytes:
        return json.dumps(obj).encode()

    nested: object = "x"
    for _ in range(200):
        nested = {"a": [nested]}
    return [
        (c, b"", js),
        (chat, b"", js),
        ("/tokenize", b"", js),
        ("/detokenize", b"", js),
        (c, b"{not json", js),
        (c, b'{"prompt": ', js),
        (c, b"\xff\xfe\x00garbage", js),
        (c, b"null", js),
        (c, b"[]", js),
        (c, b"42", js),
        (c, b'"string"', js),
        (c, j({"prompt": "hi"}), "text/plain"),
        (c, b"prompt=hi", "application/x-www-form-urlencoded"),
        (c, j({"prompt": 5}), js),
        (c, j({"prompt": None}), js),
        (c, j({"prompt": True}), js),
        (c, j({"prompt": [[1, 2], "x"]}), js),
        (c, j({"prompt": [1.5, 2]}), js),
        (c, j({"prompt": "hi", "max_tokens": "ten"}), js),
        (c, j({"prompt": "hi", "max_tokens": 10**30}), js),
        (c, b'{"prompt": "hi", "max_tokens": 1e400}', js),
        (c, b'{"prompt": "hi", "temperature": NaN}', js),
        (c, b'{"prompt": "hi", "top_p": -Infinity}', js),
        (c, j({"prompt": "hi", "max_tokens": -1}), js),
        (c, j({"prompt": "hi", "n": -5}), js),
        (c, j({"prompt": "hi", "n": 2**63}), js),
        (c, j({"prompt": "hi", "logprobs": -1}), js),
        (c, j({"prompt": "hi", "logprobs": 10**9}), js),
        (c, j({"prompt": "hi", "seed": 2**64}), js),
        (c, j({"prompt": "hi", "top_k": 2**40}), js),
        (c, j({"prompt": "hi", "min_tokens": 2**40, "max_tokens": 2}), js),
        (c, j({"prompt": "hi", "priority": -(2**70), "max_tokens": 2}), js),
        (c, j({"prompt": "hi", "stop": "x" * 100000, "max_tokens": 2}), js),
        (c, j({"prompt": "hi", "stop": ["a"] * 10000}), js),
        (c, j({"prompt": "hi", "stop_token_ids": list(range(10000)), "max_tokens": 2}), js),
        (c, j({"prompt": list(range(10000))}), js),
        (c, j({"prompt": ["a"] * 10000, "max_tokens": 1}), js),
        (c, j({"prompt": [[1]] * 10000, "max_tokens": 1}), js),
        (c, j({"prompt": "hi", "stream_options": {"include_usage": "yes"}}), js),
        (c, j({"prompt": "hi", "logit_bias": {"x": "y"}}), js),
        (c, b'{"prompt": "\\ud800\\udfff\\ud800", "max_tokens": 2}', js),
        (c, j({"prompt": "\u0000\u202e\U0010ffff\ufffe", "max_tokens": 2}), js),
        (c, j({"prompt": "hi", "nested": nested, "max_tokens": 2}), js),
        (c, j({"prompt": "hi", "extra": {"deep": [[[[[[{"x": None}]]]]]]}, "max_tokens": 2}), js),
        (c, j({"prompt": "x" * (MAX_BYTES + 1)}), js),
        (chat, j({"messages": None}), js),
        (chat, j({"messages": [None]}), js),
        (chat, j({"messages": [{}]}), js),
        (chat, j({"messages": [{"role": 5}]}), js),
        (chat, j({"messages": [{"role": "user", "content": {"x": 1}}]}), js),
        (chat, j({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), js),
        (chat, j({"messages": [{"role": "user", "content": [5]}]}), js),
        (chat, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', js),
        (chat, j({"messages": msg * 10000, "max_tokens": 2}), js),
        (chat, j({"messages": msg, "chat_template_kwargs": {"messages": 1}}), js),
        (chat, j({"messages": msg, "chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}}), js),
        (chat, j({"messages": msg, "chat_template_kwargs": [1]}), js),
        (
            chat,
            j({"messages": msg, "tools": [{"type": "function", "function": 7}], "max_tokens": 2}),
            js,
        ),
        (chat, j({"messages": msg, "top_logprobs": 5, "logprobs": "maybe"}), js),
        (chat, j({"messages": msg, "max_completion_tokens": 0}), js),
        ("/tokenize", j({"prompt": "a", "messages": msg}), js),
        ("/tokenize", j({}), js),
        ("/tokenize", b'{"prompt": "\\ud800"}', js),
        ("/detokenize", j({"tokens": [-1]}), js),
        ("/detokenize", j({"tokens": ["a"]}), js),
        ("/detokenize", j({"tokens": [2**70]}), js),
    ]


def test_malformed_bodies_get_4xx(fuzz_server):
    base = fuzz_server.base_url
    with httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        for path, body, ctype in _raw_cases():
            r = http.post(path, content=body, headers={"content-type": ctype})
            assert r.status_code < 500, (path, body[:200], r.status_code, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
        for method, path in (
            ("GET", "/v1/completions"),
            ("PUT", "/v1/models"),
            ("DELETE", "/health"),
            ("POST", "/v1/nothing"),
        ):
            r = http.request(method, path)
            assert r.status_code in (404, 405), (method, path, r.status_code)
            assert r.json()["error"]["message"]
    assert_sound_after_batch(fuzz_server, "malformed bodies")


@pytest.mark.parametrize("batch", range(4))
def test_hostile_generated_bodies(fuzz_server, batch):
    """Batches of generated hostile bodies: each answered below 500 within the time bound,
    and after each batch the server is sound."""
    failures = []
    with httpx.Client(base_url=fuzz_server.base_url, timeout=TIMEOUT) as http:
        for path, body in hostile_bodies(seed=batch, count=40):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            if r.status_code >= 500:
                failures.append(f"{path} {body[:300]!r} -> {r.status_code} {r.text[:300]}")
            elif r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert not failures, "\n".join(failures)
    assert_sound_after_batch(fuzz_server, f"hostile batch {batch}")


def test_server_is_sound_after_fuzzing(fuzz_server):
    """Runs last in this module: healthy, same output as before, nothing held."""
    s = fuzz_server
    assert httpx.get(s.base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(s.base_url + "/v1/completions", json=REFERENCE, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == s.reference_text
    assert_no_blocks_in_use(s)
    admission = httpx.get(s.base_url + "/admin/executors", timeout=10).json()["admission"]
    assert admission["active_responses"] == 0 and admission["queued_requests"] == 0
    metrics = httpx.get(s.base_url + "/metrics", timeout=10).text
    assert gauge(metrics, "vllm:num_requests_running") == 0
    assert gauge(metrics, "vllm:kv_cache_usage_perc") == 0
