"""Admission control: bounded queues answer 429 with Retry-After, oversized bodies 413,
oversized requests 400; the server keeps serving and holds nothing afterwards."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from controller.api.admission import Admission, AdmissionLimits, AdmissionRejected
from tests.e2e.helpers import LONG_PROMPT, assert_no_blocks_in_use
from tests.support.processes import start_server

MAX_QUEUED = 4
MAX_BYTES = 64 * 1024


# --- the bookkeeping, without a server -------------------------------------------------------


def test_queue_bounds_and_release():
    adm = Admission(AdmissionLimits(max_queued_requests=3, max_queued_tokens=100))
    a = adm.admit([40, 40])
    assert (adm.queued_requests, adm.queued_tokens, adm.active) == (2, 80, 1)
    with pytest.raises(AdmissionRejected) as exc:
        adm.admit([30])  # 110 tokens > 100
    assert exc.value.status == 429 and exc.value.retry_after == 1
    with pytest.raises(AdmissionRejected):
        adm.admit([1, 1])  # 4 sequences > 3
    b = adm.admit([10])
    a.started(0)
    a.started(0)  # idempotent
    assert (adm.queued_requests, adm.queued_tokens) == (2, 50)
    a.close()
    b.close()
    b.close()
    assert (adm.queued_requests, adm.queued_tokens, adm.active) == (0, 0, 0)
    assert adm.rejected == 2


def test_one_request_larger_than_the_bounds():
    adm = Admission(AdmissionLimits(max_queued_requests=3, max_queued_tokens=100))
    with pytest.raises(AdmissionRejected) as exc:
        adm.admit([1] * 4)
    assert exc.value.status == 400
    big = adm.admit([500])  # alone it runs: a long prompt is never refused for ever
    with pytest.raises(AdmissionRejected):
        adm.admit([1])
    big.close()


def test_draining_and_abort_all():
    adm = Admission(AdmissionLimits())
    ticket = adm.admit([5])
    queue: asyncio.Queue = asyncio.Queue()
    ticket.attach(queue)
    adm.start_draining()
    with pytest.raises(AdmissionRejected) as exc:
        adm.admit([5])
    assert exc.value.status == 503
    assert adm.abort_all() == 1
    assert queue.qsize() == 1 and ticket.aborted
    late = Admission(AdmissionLimits())
    t2 = late.admit([1])
    t2.abort()
    q2: asyncio.Queue = asyncio.Queue()
    t2.attach(q2)  # aborted before it ran: the abort is delivered on attach
    assert q2.qsize() == 1


# --- a live server with small bounds ------------------------------------------------------


@pytest.fixture(scope="module")
def limited(default_model_dir, tmp_path_factory):
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("admission")),
        controller_args=[
            "--max-queued-requests",
            str(MAX_QUEUED),
            "--max-request-bytes",
            str(MAX_BYTES),
            "--retry-after",
            "2",
            # Small steps: long prompts take many steps to their first token.
            "--max-num-batched-tokens",
            "32",
        ],
    )
    yield s
    s.stop()


def _admission(server) -> dict:
    return httpx.get(server.base_url + "/admin/executors", timeout=10).json()["admission"]


def test_queue_full_gets_429_with_retry_after(limited):
    s = limited
    body = {"model": s.model_name, "max_tokens": 4, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            calls = [
                http.post(
                    s.base_url + "/v1/completions", json={**body, "prompt": f"{i} {LONG_PROMPT}"}
                )
                for i in range(3 * MAX_QUEUED)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
    assert set(codes) <= {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "2"
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
            assert set(err) == {"message", "type", "param", "code"}
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
    state = _admission(s)
    assert state["queued_requests"] == 0 and state["queued_tokens"] == 0
    assert state["active_responses"] == 0 and state["rejected"] >= 1
    assert_no_blocks_in_use(s)
    # Serving again once the queue is empty.
    r = httpx.post(s.base_url + "/v1/completions", json={**body, "prompt": "Hello"}, timeout=60)
    assert r.status_code == 200


def test_streams_release_their_queue_share(limited):
    s = limited

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:

            async def one(i: int) -> int:
                body = {
                    "model": s.model_name,
                    "prompt": f"Story {i}:",
                    "max_tokens": 6,
                    "temperature": 0,
                    "stream": True,
                }
                async with http.stream("POST", s.base_url + "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass
                    return resp.status_code

            codes = []
            for _ in range(3):  # sequential rounds never exceed the bound
                codes += await asyncio.gather(*(one(i) for i in range(MAX_QUEUED)))
            return codes

    assert asyncio.run(run()) == [200] * (3 * MAX_QUEUED)
    state = _admission(s)
    assert state["queued_requests"] == 0 and state["active_responses"] == 0


def test_too_many_sequences_in_one_request_get_400(limited):
    s = limited
    r = httpx.post(
        s.base_url + "/v1/completions",
        json={"model": s.model_name, "prompt": "hi", "max_tokens": 2, "n": MAX_QUEUED + 1},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
    r = httpx.post(
        s.base_url + "/v1/completions",
        json={"model": s.model_name, "prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2},
        timeout=60,
    )
    assert r.status_code == 400


def test_oversized_body_gets_413(limited):
    s = limited
    big = {"model": s.model_name, "prompt": "x" * (MAX_BYTES + 10), "max_tokens": 2}
    r = httpx.post(s.base_url + "/v1/completions", json=big, timeout=60)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["message"]

    def chunks():  # no content-length: the bound holds on the bytes actually sent
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 1024 + 2):
            yield b"y" * 1024
        yield b'", "max_tokens": 2}'

    r = httpx.post(
        s.base_url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413
    ok = httpx.post(
        s.base_url + "/v1/completions",
        json={"model": s.model_name, "prompt": "x " * 1000, "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ],
)
def test_per_request_bounds(limited, body, param):
    r = httpx.post(
        limited.base_url + "/v1/completions", json={"model": limited.model_name, **body}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param
