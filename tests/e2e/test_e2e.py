"""End to end: real executor and controller processes, the official openai client.

Greedy outputs must be token-identical to transformers on the same float32 weights, whatever
the chunking, preemption or prefix-cache hits; no KV block may stay in use afterwards.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.helpers import (
    CHATS,
    PROMPTS,
    assert_exact_under_pressure,
    assert_no_blocks_in_use,
    complete_ids,
)


def test_completions_match_transformers(server, hf):
    client = server.client()
    for prompt in PROMPTS:
        prompt_ids, ids, r = complete_ids(client, server.model_name, prompt, 24)
        assert ids == hf.greedy(prompt_ids, 24)[: len(ids)]
        assert len(ids) == 24 or ids[-1] in (hf.tokenizer.eos_token_id,)
        assert r.usage.completion_tokens == len(ids)
        assert r.choices[0].text == hf.tokenizer.decode(ids, skip_special_tokens=True)
    assert_no_blocks_in_use(server)
    # No --step-port: the steps go over gRPC's ExecuteModel (tight_server's over a socket).
    assert [e["step_transport"] for e in server.executors_state()] == ["grpc"]


def test_chat_matches_transformers(server, hf):
    client = server.client()
    for messages in CHATS:
        r = client.chat.completions.create(
            model=server.model_name,
            messages=messages,
            max_tokens=32,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        choice = r.choices[0]
        assert choice.model_extra["prompt_token_ids"] == hf.chat_ids(messages)
        expected = hf.greedy(hf.chat_ids(messages), 32)
        ids = choice.model_extra["token_ids"]
        assert ids == expected[: len(ids)]
        if len(ids) < 32:  # stopped at EOS, which is not part of the text
            assert ids[-1] == hf.tokenizer.eos_token_id and choice.finish_reason == "stop"
    r = client.chat.completions.create(
        model=server.model_name, messages=CHATS[0], max_tokens=32, temperature=0
    )
    assert "Paris" in r.choices[0].message.content


def test_concurrent_batch_matches_transformers(server, hf):
    async def run():
        client = server.async_client()
        calls = [
            client.completions.create(
                model=server.model_name,
                prompt=p,
                max_tokens=16,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            for p in PROMPTS * 2
        ]
        return await asyncio.gather(*calls)

    for r in asyncio.run(run()):
        c = r.choices[0]
        assert c.model_extra["token_ids"] == hf.greedy(c.model_extra["prompt_token_ids"], 16)
    assert_no_blocks_in_use(server)


def test_streaming_equals_non_streaming(server):
    client = server.client()
    for prompt in PROMPTS[:2]:
        whole = client.completions.create(
            model=server.model_name, prompt=prompt, max_tokens=20, temperature=0
        )
        stream = client.completions.create(
            model=server.model_name,
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        assert text == whole.choices[0].text
        assert finish == whole.choices[0].finish_reason
        assert usage.completion_tokens == whole.usage.completion_tokens
    chat_whole = client.chat.completions.create(
        model=server.model_name, messages=CHATS[0], max_tokens=20, temperature=0
    )
    chat_stream = client.chat.completions.create(
        model=server.model_name, messages=CHATS[0], max_tokens=20, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert text == chat_whole.choices[0].message.content


def test_stop_strings_and_n(server):
    client = server.client()
    whole = (
        client.completions.create(
            model=server.model_name, prompt=PROMPTS[2], max_tokens=24, temperature=0
        )
        .choices[0]
        .text
    )
    words = whole.split()
    assert len(words) > 3
    stop = " " + words[2]  # a stop string spanning into a later token
    r = client.completions.create(
        model=server.model_name, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == whole[: whole.index(stop)]
    r = client.completions.create(
        model=server.model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, n=3, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = client.completions.create(
        model=server.model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, n=3, seed=7
    )
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert_no_blocks_in_use(server)


def test_echo_prompt_logprobs_match_transformers(server, hf):
    client = server.client()
    prompt = PROMPTS[2]
    r = client.completions.create(
        model=server.model_name,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    c = r.choices[0]
    prompt_ids = c.model_extra["prompt_token_ids"]
    expected = hf.prompt_logprobs(prompt_ids)
    got = c.logprobs.token_logprobs
    assert got[0] is None
    assert len(got) == len(prompt_ids) + 1
    for a, b in zip(got[1 : len(prompt_ids)], expected):
        assert abs(a - b) < 1e-3, (a, b)
    assert c.text.startswith(prompt)
    assert all(len(t) >= 1 for t in c.logprobs.top_logprobs[1:])


def test_models_health_tokenize_version_metrics(server):
    base = server.base_url
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model_name]
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/version").json()["version"]
    tok = httpx.post(base + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    detok = httpx.post(base + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert "Hello world" in detok["prompt"]
    metrics = httpx.get(base + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert name in metrics


BAD_BODIES = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": 9}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "presence_penalty": 5}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -5}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "word " * 20000}, "max_tokens"),
    ({"prompt": "hi", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_bad_completion_requests_get_4xx(server, body, param):
    body = {"model": server.model_name, **body}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]


def test_malformed_requests_get_4xx_and_server_keeps_serving(server):
    base = server.base_url
    cases = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
        ("/v1/chat/completions", b'{"messages": "hello"}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}',
        ),
    ]
    for path, raw in cases:
        r = httpx.post(base + path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (path, raw, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(base + "/v1/nothing").status_code == 404
    ok = server.client().completions.create(
        model=server.model_name, prompt="Hi", max_tokens=2, temperature=0
    )
    assert ok.choices[0].text is not None
    assert_no_blocks_in_use(server)


def test_aborted_streams_free_their_blocks(server):
    async def run():
        async with httpx.AsyncClient(timeout=60) as http:

            async def partial(i):
                body = {
                    "model": server.model_name,
                    "prompt": PROMPTS[i % 4] * 3,
                    "max_tokens": 200,
                    "temperature": 0,
                    "stream": True,
                }
                async with http.stream(
                    "POST", server.base_url + "/v1/completions", json=body
                ) as resp:
                    seen = 0
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            seen += 1
                        if seen >= 3:
                            return  # leave mid-stream: the server must abort the request

            await asyncio.gather(*(partial(i) for i in range(6)))

    asyncio.run(run())
    assert_no_blocks_in_use(
        server,
    )


@pytest.mark.slow
def test_tight_server_chunked_prefill_preemption_prefix_cache(tight_server, hf):
    """48-token steps and 19 usable KV blocks: long prompts are chunked, requests are
    preempted and resumed, shared prefixes hit the cache; output stays identical."""
    assert_exact_under_pressure(tight_server, hf)
    # Its executor's steps went over the step socket; the default server's over gRPC.
    assert [e["step_transport"] for e in tight_server.executors_state()] == ["socket"]


def test_min_tokens_holds_back_eos(server, hf):
    client = server.client()
    natural = client.chat.completions.create(
        model=server.model_name, messages=CHATS[0], max_tokens=40, temperature=0
    )
    n = natural.usage.completion_tokens
    assert natural.choices[0].finish_reason == "stop" and n < 30
    r = client.chat.completions.create(
        model=server.model_name,
        messages=CHATS[0],
        max_tokens=40,
        temperature=0,
        extra_body={"min_tokens": n + 5, "return_token_ids": True},
    )
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) >= n + 5
    assert hf.tokenizer.eos_token_id not in ids[: n + 5]


def test_non_streaming_client_timeout_aborts_request(server):
    body = {
        "model": server.model_name,
        "prompt": PROMPTS[1],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.5)
    assert_no_blocks_in_use(server)


def test_executor_serves_grpc_health_but_no_reflection_by_default(server):
    """Health for the probes; reflection (a listing of the services for anyone who can reach
    the port) only with --grpc-reflection (tests/common/host/test_reflection.py)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.executor_ports[0]}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tandem.executor.v1.Executor"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as exc:
            list(refl.ServerReflectionInfo(iter([req]), timeout=5))
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
