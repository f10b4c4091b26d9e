"""X-Request-Id in-process: the app of create_app over a fake engine and tokenizer (the real
boundary is covered by tests/e2e/test_request_ids.py)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re

import httpx
import pytest

from common import logs
from controller.api.admission import Admission, AdmissionLimits
from controller.api.server import create_app
from controller.api.serving import OpenAIServing
from controller.core.outputs import OutputDelta
from tests.support.fake_engine import FakeEngineBase

HEX_ID = re.compile(r"[0-9a-f]{32}")


def serials(seen: list[str], rid: str) -> list[tuple[int, str]]:
    """(serial, prompt-choice) of sequence ids ``<rid>~<serial>-<p>-<c>``, asserting the shape."""
    shape = re.compile(re.escape(rid) + r"~(\d+)-(\d+-\d+)")
    matches = [shape.fullmatch(s) for s in seen]
    assert all(matches), seen
    return [(int(m[1]), m[2]) for m in matches]


engine_log = logging.getLogger("tests.fake_engine")


class FakeTokenizer:
    """A character per token."""

    vocab_size = 1000
    eos_token_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **kw) -> str:
        return "".join(m["content"] for m in messages)


class FakeEngine(FakeEngineBase):
    """Generates "ok" for every sequence, once `release` is set; fails on prompt "boom"."""

    def __init__(self, **config):
        super().__init__([0], max_model_len=512, **config)
        self.waiting: dict = {}
        self.seen: list[str] = []  # sequence ids, in order
        self.release = asyncio.Event()
        self.release.set()

    async def generate(self, gen):
        self.seen.append(gen.request_id)
        engine_log.info("generating %s", gen.request_id)
        if gen.prompt_token_ids == [ord(c) for c in "boom"]:
            raise RuntimeError("the engine broke")
        await self.release.wait()
        yield OutputDelta(
            gen.request_id,
            text="ok",
            token_ids=[ord("o"), ord("k")],
            finished=True,
            finish_reason="stop",
            num_prompt_tokens=len(gen.prompt_token_ids),
            num_output_tokens=2,
        )


def make_app(engine: FakeEngine, admission: Admission | None = None):
    serving = OpenAIServing(engine, FakeTokenizer(), "m", 5, admission)
    return create_app(engine, serving, start_engine=False)


def client(app) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def run(coro):
    return asyncio.run(coro)


COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _sse_bodies(text: str) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_client_id_comes_back_in_header_body_and_sequence_ids():
    """The client's id is the response's; sequence ids add a serial (ids may repeat)."""
    engine = FakeEngine()

    async def main():
        async with client(make_app(engine)) as http:
            headers = {"X-Request-Id": "my-id.1"}
            r = await http.post("/v1/completions", json={**COMPLETION, "n": 2}, headers=headers)
            assert r.status_code == 200 and r.headers["x-request-id"] == "my-id.1"
            assert r.json()["id"] == "cmpl-my-id.1"
            r = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.headers["x-request-id"] == "my-id.1"
            assert r.json()["id"] == "chatcmpl-my-id.1"
            r = await http.post(
                "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
            )
            assert r.headers["x-request-id"] == "my-id.1"
            assert {b["id"] for b in _sse_bodies(r.text)} == {"chatcmpl-my-id.1"}

    run(main())
    (a, p0), (b, p1), (c, p2), (d, p3) = serials(engine.seen, "my-id.1")
    assert a == b < c < d and [p0, p1, p2, p3] == ["0-0", "0-1", "0-0", "0-0"]


def test_generated_id_when_absent():
    engine = FakeEngine()

    async def main():
        async with client(make_app(engine)) as http:
            r = await http.post("/v1/completions", json={**COMPLETION, "stream": True})
            rid = r.headers["x-request-id"]
            assert HEX_ID.fullmatch(rid)
            assert {b["id"] for b in _sse_bodies(r.text)} == {f"cmpl-{rid}"}
            assert engine.seen == [f"{rid}-0-0"]
            r = await http.get("/health")
            assert HEX_ID.fullmatch(r.headers["x-request-id"]) and r.headers["x-request-id"] != rid

    run(main())


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Request-Id", "x" * 129)],
        [("X-Request-Id", "")],
        [("X-Request-Id", "has space")],
        [("X-Request-Id", "semi;colon")],
        [("X-Request-Id", "tilde~1")],
        [("X-Request-Id", "quote\"'<script>")],
        [("X-Request-Id", "caf\xe9".encode("latin-1"))],
        [("X-Request-Id", b"\xff\xfe\x00")],
        [("X-Request-Id", "a"), ("X-Request-Id", "b")],
    ],
)
def test_invalid_id_is_a_400_under_a_fresh_id(headers):
    engine = FakeEngine()

    async def main():
        async with client(make_app(engine)) as http:
            return await http.post("/v1/completions", json=COMPLETION, headers=headers)

    r = run(main())
    assert r.status_code == 400
    assert HEX_ID.fullmatch(r.headers["x-request-id"])
    err = r.json()["error"]
    assert err["param"] == "X-Request-Id" and err["code"] == "invalid_request_id"
    assert "X-Request-Id" in err["message"] and err["type"] == "invalid_request_error"
    assert engine.seen == []


def test_longest_valid_id():
    rid = "A-z0._:/+=" * 12 + "12345678"
    assert len(rid) == 128

    async def main():
        async with client(make_app(FakeEngine())) as http:
            return await http.post(
                "/v1/completions", json=COMPLETION, headers={"x-request-id": rid}
            )

    r = run(main())
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    assert r.json()["id"] == f"cmpl-{rid}"


def test_error_responses_carry_the_id():
    engine = FakeEngine(api_keys=["sk-1"], max_request_bytes=2000)
    admission = Admission(AdmissionLimits())
    app = make_app(engine, admission)
    key = {"Authorization": "Bearer sk-1"}

    async def status(method, path, headers=None, **kw) -> int:
        headers = {"X-Request-Id": f"e{len(seen)}", **(headers or {})}
        r = await http.request(method, path, headers=headers, **kw)
        assert r.headers["x-request-id"] == f"e{len(seen)}", (path, r.status_code)
        seen.append(r.status_code)
        return r.status_code

    async def main():
        assert await status("POST", "/v1/completions", json=COMPLETION) == 401
        assert await status("POST", "/v1/completions", key, content="x" * 3000) == 413
        assert await status("POST", "/v1/completions", key, json={"prompt": 1}) == 400
        assert await status("POST", "/v1/completions", key, json={**COMPLETION, "n": 0}) == 400
        assert (
            await status("POST", "/v1/completions", key, json={**COMPLETION, "model": "x"}) == 404
        )
        assert await status("GET", "/nowhere", key) == 404
        assert await status("GET", "/v1/completions", key) == 405
        assert (
            await status("POST", "/v1/completions", key, json={**COMPLETION, "prompt": "boom"})
            == 500
        )
        assert await status("GET", "/health") == 200
        admission.start_draining()
        assert await status("POST", "/v1/completions", key, json=COMPLETION) == 503

    seen: list[int] = []
    http = client(app)
    run(main())


def test_queue_full_429_carries_the_id():
    engine = FakeEngine()
    engine.release.clear()
    app = make_app(engine, Admission(AdmissionLimits(max_queued_requests=1)))

    async def main():
        async with client(app) as http:
            first = asyncio.create_task(
                http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "one"})
            )
            while not engine.seen:
                await asyncio.sleep(0.01)
            r = await http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "two"})
            assert r.status_code == 429 and r.headers["x-request-id"] == "two"
            engine.release.set()
            assert (await first).headers["x-request-id"] == "one"

    run(main())


def test_requests_with_the_same_id_get_distinct_sequence_ids():
    engine = FakeEngine()
    engine.release.clear()

    async def main():
        async with client(make_app(engine)) as http:
            headers = {"X-Request-Id": "same"}
            tasks = [
                asyncio.create_task(http.post("/v1/completions", json=COMPLETION, headers=headers)),
                asyncio.create_task(
                    http.post("/v1/chat/completions", json={**CHAT, "n": 2}, headers=headers)
                ),
            ]
            while len(engine.seen) < 3:
                await asyncio.sleep(0.01)
            engine.release.set()
            done = await asyncio.gather(*tasks)
            # Again, after both are over: sequence ids are never reused.
            await http.post("/v1/completions", json=COMPLETION, headers=headers)
            return done

    first, second = run(main())
    assert len(set(engine.seen)) == 4
    assert sorted(p for _, p in serials(engine.seen, "same")) == ["0-0", "0-0", "0-0", "0-1"]
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "same"
    assert first.json()["id"] == "cmpl-same" and second.json()["id"] == "chatcmpl-same"
    assert first.json()["choices"][0]["text"] == "ok"
    assert [c["message"]["content"] for c in second.json()["choices"]] == ["ok", "ok"]


def test_log_lines_of_the_request_carry_its_id():
    engine = FakeEngine()
    buf = io.StringIO()
    handler = logs.make_handler("json", "controller", buf)
    root = logging.getLogger()
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:

        async def main():
            async with client(make_app(engine)) as http:
                h = {"X-Request-Id": "logged"}
                await http.post("/v1/completions", json={**COMPLETION, "stream": True}, headers=h)
                await http.post("/v1/completions", json={**COMPLETION, "prompt": "boom"}, headers=h)
                engine_log.info("outside any request")

        run(main())
    finally:
        root.removeHandler(handler)
        root.setLevel(saved_level)
    records = [json.loads(line) for line in buf.getvalue().splitlines()]
    mine = [r for r in records if r["logger"].startswith(("tests.", "controller."))]
    by_message = {r["message"]: r.get("request_id") for r in mine}
    generating = [r for r in mine if r["message"].startswith("generating logged~")]
    assert len(generating) == 2 and all(r["request_id"] == "logged" for r in generating)
    assert by_message["admitted: 1 sequences, 5 prompt tokens"] == "logged"
    assert by_message["unhandled error on /v1/completions"] == "logged"  # outside middleware
    assert by_message["outside any request"] is None


def test_routes_and_middleware_order():
    app = make_app(FakeEngine())
    routes = [
        (method, route.path)
        for route in app.routes
        for method in sorted(route.methods or ())
        if route.path not in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
    ]
    assert routes == [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/peer"),
        ("GET", "/admin/health"),
        ("GET", "/admin/executors"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ]
    # Outermost first: the request id, then the admin and API keys, then the body's bounds.
    names = [m.cls.__name__ for m in app.user_middleware]
    assert names == [
        "RequestIdMiddleware",
        "AdminAuth",
        "APIKeyAuth",
        "BodyReadTimeout",
        "BodySizeLimit",
    ]
