"""X-Request-Id end to end, with real processes: the client's id comes back in the header and
the response id, and every log line about the request, on the controller and the executor,
carries it (both run at --log-level DEBUG, text format: `` [<id>]`` after the logger name)."""

from __future__ import annotations

import asyncio
import os
import re

import httpx
import pytest

from tests.support.processes import start_server, wait_until

DEBUG = ["--log-level", "DEBUG"]
HEX_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def traced(default_model_dir, tmp_path_factory):
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("request_ids")),
        controller_args=DEBUG,
        executor_args=DEBUG,
    )
    yield s
    s.stop()


def _log(server, name: str) -> list[str]:
    with open(os.path.join(server.log_dir, f"{name}.log"), errors="replace") as f:
        return f.read().splitlines()


def _about(lines: list[str], rid: str) -> list[str]:
    """Lines that name one of the request's sequences (``<id>~<serial>-<prompt>-<choice>``)."""
    sequence = re.compile(re.escape(rid) + r"(~\d+)?-\d+-\d+")
    return [line for line in lines if sequence.search(line)]


def _check_logs(server, rid: str) -> None:
    """Every line naming the request's sequences carries its id, on both sides; the executor
    logs the request's arrival (and its end, once the controller told it)."""
    tag = f" [{rid}]: "
    controller = _about(_log(server, "controller"), rid)
    assert controller and all(tag in line for line in controller), controller
    assert any(f"{tag}admitted:" in line for line in _log(server, "controller"))

    def executor_has_end() -> bool:
        lines = _about(_log(server, "executor0"), rid)
        assert lines and all(tag in line for line in lines), lines
        return any(" arrives " in line for line in lines) and any(
            " finished " in line for line in lines
        )

    server.client().completions.create(  # a later step carries the finished id
        model=server.model_name, prompt="flush", max_tokens=1
    )
    wait_until(executor_has_end, 30, "the executor's lines about the request")


def test_completion_ids_and_logs(traced):
    client = traced.client()
    rid = "e2e-completion.1"
    raw = client.completions.with_raw_response.create(
        model=traced.model_name,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Request-Id": rid},
    )
    assert raw.headers["x-request-id"] == rid
    body = raw.parse()
    assert body.id == f"cmpl-{rid}" and body.choices[0].text
    _check_logs(traced, rid)


def test_streamed_completion(traced):
    rid = "e2e-stream:2"
    with traced.client().completions.with_streaming_response.create(
        model=traced.model_name,
        prompt="Once upon a time",
        max_tokens=4,
        n=2,
        temperature=0,
        stream=True,
        extra_headers={"X-Request-Id": rid},
    ) as r:
        assert r.headers["x-request-id"] == rid
        ids = {chunk.id for chunk in r.parse()}
    assert ids == {f"cmpl-{rid}"}
    _check_logs(traced, rid)


def test_chat_whole_and_streamed(traced):
    client = traced.client()
    messages = [{"role": "user", "content": "Say hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model=traced.model_name,
        messages=messages,
        max_tokens=4,
        extra_headers={"X-Request-Id": "e2e-chat"},
    )
    assert raw.headers["x-request-id"] == "e2e-chat"
    assert raw.parse().id == "chatcmpl-e2e-chat"
    with client.chat.completions.with_streaming_response.create(
        model=traced.model_name,
        messages=messages,
        max_tokens=4,
        stream=True,
        extra_headers={"X-Request-Id": "e2e-chat-stream"},
    ) as r:
        assert r.headers["x-request-id"] == "e2e-chat-stream"
        assert {chunk.id for chunk in r.parse()} == {"chatcmpl-e2e-chat-stream"}
    _check_logs(traced, "e2e-chat")
    _check_logs(traced, "e2e-chat-stream")


def test_generated_id(traced):
    raw = traced.client().completions.with_raw_response.create(
        model=traced.model_name, prompt="Hello", max_tokens=2
    )
    rid = raw.headers["x-request-id"]
    assert HEX_ID.fullmatch(rid) and raw.parse().id == f"cmpl-{rid}"


@pytest.mark.parametrize("value", ["x" * 129, "white space", "caf\xe9", "<id>", "a,b"])
def test_invalid_id_is_a_400_under_a_fresh_id(traced, value):
    r = httpx.post(
        traced.base_url + "/v1/completions",
        json={"model": traced.model_name, "prompt": "Hi", "max_tokens": 1},
        headers=[(b"X-Request-Id", value.encode("latin-1"))],
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert HEX_ID.fullmatch(r.headers["x-request-id"])
    error = r.json()["error"]
    assert error["param"] == "X-Request-Id" and error["code"] == "invalid_request_id"


def test_4xx_carries_the_id(traced):
    url = traced.base_url + "/v1/completions"
    headers = {"X-Request-Id": "e2e-4xx"}
    for body, status in [
        ({"model": "nope", "prompt": "Hi"}, 404),
        ({"model": traced.model_name, "prompt": "Hi", "max_tokens": 10**7}, 400),
        ({"model": traced.model_name, "prompt": "Hi", "n": "many"}, 400),
    ]:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == status and r.headers["x-request-id"] == "e2e-4xx", r.text
    r = httpx.get(traced.base_url + "/nowhere", headers=headers, timeout=30)
    assert r.status_code == 404 and r.headers["x-request-id"] == "e2e-4xx"


def test_concurrent_requests_with_the_same_id(traced):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    client = traced.client()
    alone = [
        client.completions.create(model=traced.model_name, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    assert alone[0] != alone[1]

    async def both():
        aclient = traced.async_client()
        calls = [
            aclient.completions.with_raw_response.create(
                model=traced.model_name,
                prompt=p,
                max_tokens=8,
                temperature=0,
                extra_headers={"X-Request-Id": "e2e-same"},
            )
            for p in prompts
        ]
        return await asyncio.gather(*calls)

    raws = asyncio.run(both())
    assert [r.headers["x-request-id"] for r in raws] == ["e2e-same", "e2e-same"]
    bodies = [r.parse() for r in raws]
    assert [b.choices[0].text for b in bodies] == alone
    assert [b.id for b in bodies] == ["cmpl-e2e-same", "cmpl-e2e-same"]
    _check_logs(traced, "e2e-same")
    arrivals = [
        line for line in _about(_log(traced, "executor0"), "e2e-same") if " arrives " in line
    ]
    sequences = {re.search(r"request (\S+) arrives", line)[1] for line in arrivals}
    assert len(arrivals) == len(sequences) == 2, arrivals
