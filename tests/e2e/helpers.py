"""What the end-to-end tests share: prompts, waiting for an idle fleet with no KV block in use,
reading /metrics, greedy completions streamed or whole, and HTTPS clients."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Iterator

import httpx

from tests.support.processes import wait_until

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
]


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a planet."},
    ],
]


# A prompt of a few hundred tokens: longer than the tight server's 48-token step budget.
LONG_PROMPT = (
    " ".join(
        f"Item {i}: the {w} fox jumps over the lazy dog."
        for i, w in enumerate(
            ["quick", "brown", "red", "slow", "clever", "tired", "young", "old"] * 2
        )
    )
    + " Summary:"
)


def assert_no_blocks_in_use(server) -> None:
    state = server.wait_idle()
    for e in state:
        assert e["running"] == 0 and e["waiting"] == 0, state
        assert e["used_blocks"] == 0, f"KV blocks leaked: {state}"


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def https_client(server, ca: str, logs: str) -> Iterator[tuple[httpx.Client, str]]:
    """A client of an HTTPS controller (--ssl-certfile) that trusts `ca`, once its /health
    answers 200, and the controller's https:// base URL."""
    url = server.base_url.replace("http://", "https://")
    ctx = ssl.create_default_context(cafile=ca)
    with httpx.Client(verify=ctx, timeout=60) as https:
        wait_until(
            lambda: https.get(url + "/health").status_code == 200,
            120,
            "the HTTPS controller to be healthy",
            logs=logs,
        )
        yield https, url


def metrics_text(server) -> str:
    """The controller's /metrics exposition."""
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def executors_lost(server) -> float:
    """tandem:executor_lost_total, summed over the fleet."""
    return metric_sum(metrics_text(server), "tandem:executor_lost_total")


MAX_TOKENS = 40


async def stream_completion(
    server,
    prompt: str,
    chunks: list[float],
    started: asyncio.Event,
    max_tokens: int = MAX_TOKENS,
    extra: dict | None = None,
) -> str:
    """Stream one greedy completion (`extra`: more body fields); record each chunk's arrival
    time."""
    text = ""
    async with server.async_client() as client:
        resp = await client.completions.create(
            model=server.model_name,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, **(extra or {})},
        )
        async for chunk in resp:
            piece = chunk.choices[0].text if chunk.choices else ""
            if piece:
                text += piece
                chunks.append(time.perf_counter())
            if len(chunks) >= 4:
                started.set()
    return text


def expected_texts(
    server, prompts: list[str], max_tokens: int = MAX_TOKENS, extra: dict | None = None
) -> list[str]:
    async def run():
        async with server.async_client() as client:
            rs = await asyncio.gather(
                *(
                    client.completions.create(
                        model=server.model_name,
                        prompt=p,
                        max_tokens=max_tokens,
                        temperature=0,
                        extra_body={"ignore_eos": True, **(extra or {})},
                    )
                    for p in prompts
                )
            )
        return [r.choices[0].text for r in rs]

    return asyncio.run(run())


def gauge(text: str, name: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def complete_ids(client, model, prompt, max_tokens, **kw):
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
        **kw,
    )
    c = r.choices[0]
    return c.model_extra["prompt_token_ids"], c.model_extra["token_ids"], r


def long_prompts_at_once(server) -> list:
    """Six greedy completions at once (24 tokens each, token ids returned) of four long prompts
    with distinct openings, two of them twice: on a tight server they are chunked, they run the
    KV pool out (no shared blocks) and some are preempted."""
    prompts = [f"{PROMPTS[i]} {LONG_PROMPT[: 100 + 40 * i]}" for i in range(4)]

    async def run():
        client = server.async_client()
        calls = [
            client.completions.create(
                model=server.model_name,
                prompt=p,
                max_tokens=24,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            for p in prompts + prompts[:2]
        ]
        return await asyncio.gather(*calls)

    return asyncio.run(run())


def assert_exact_under_pressure(s, hf) -> None:
    """On a server of 48-token steps and ~19 usable KV blocks (tight_server's flags): long
    prompts are chunked, requests are preempted and resumed, a repeated prompt hits the prefix
    cache, and every greedy output is transformers' own; no block stays in use."""
    for r in long_prompts_at_once(s):
        c = r.choices[0]
        assert c.model_extra["token_ids"] == hf.greedy(c.model_extra["prompt_token_ids"], 24)
    # The long prompt alone (several hundred tokens over 48-token steps).
    prompt_ids, ids, _ = complete_ids(s.client(), s.model_name, LONG_PROMPT, 16)
    assert len(prompt_ids) > 150
    assert ids == hf.greedy(prompt_ids, 16)
    # The same long prompt again: a prefix-cache hit, same output.
    _, again, r = complete_ids(s.client(), s.model_name, LONG_PROMPT, 16)
    assert again == ids
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    metrics = httpx.get(s.base_url + "/metrics").text
    assert metric_sum(metrics, "vllm:num_preemptions_total") > 0
    assert metric_sum(metrics, "vllm:prefix_cache_hits_total") > 0
    assert_no_blocks_in_use(s)
