"""End to end through the controller with the TPU executor on XLA:CPU.

The controller is unchanged: it reads the TPU executor's capabilities (token buckets 16/32/64,
request bucket 8, chunked prefill or not) and sizes steps to fit. Greedy outputs must be
token-identical to the GPU executor's and to transformers under chunked prefill, preemption and
prefix-cache hits; structured output (the controller's grammars, the executor's allowed-token
masks) must hold its constraints; and the executor must compile nothing after warm-up (its
Prometheus metric, fed by torch_xla's compile counter).
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from executor_tpu.sampler import VARIANTS
from tests.e2e.helpers import (
    CHATS,
    LONG_PROMPT,
    PROMPTS,
    assert_no_blocks_in_use,
    long_prompts_at_once,
    metric_sum,
)
from tests.e2e.test_structured_outputs import ASK, SCHEMAS
from tests.support.processes import free_port, start_server

#: A small budget and few KV blocks: long prompts are chunked, requests preempted.
TIGHT = [
    "--max-num-batched-tokens",
    "64",
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "20",
]

pytestmark = pytest.mark.slow


def _start_tpu(model: str, tmp_dir: str, controller_args, executor_args=()):
    port = free_port()
    server = start_server(
        model,
        tmp_dir,
        controller_args=controller_args,
        executor_args=["--metrics-port", str(port), *executor_args],
        executor_kinds=("executor_tpu",),
    )
    server.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return server


@pytest.fixture(scope="module")
def tpu_server(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tpu")
    s = _start_tpu(
        default_model_dir, str(tmp), TIGHT, ["--compile-cache-dir", str(tmp / "xla-cache")]
    )
    yield s
    s.stop()


def _workload(server) -> list[list[int]]:
    """Concurrent long prompts (chunked, preempted), then a long prompt twice (prefix hit)."""
    results = [r.choices[0].model_extra for r in long_prompts_at_once(server)]
    client = server.client()
    for _ in range(2):
        r = client.completions.create(
            model=server.model_name,
            prompt=LONG_PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        results.append(r.choices[0].model_extra)
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the second one hit the cache
    return [[*x["prompt_token_ids"], -1, *x["token_ids"]] for x in results]


def test_tpu_matches_gpu_and_transformers(tpu_server, default_model_dir, tmp_path, hf):
    got = _workload(tpu_server)
    for seq in got:
        cut = seq.index(-1)
        prompt, out = seq[:cut], seq[cut + 1 :]
        assert out == hf.greedy(prompt, len(out)), "TPU output differs from transformers"
    assert len(got[-1]) > 150  # the long prompt went through several 64-token steps
    metrics = httpx.get(tpu_server.base_url + "/metrics").text
    assert metric_sum(metrics, "vllm:num_preemptions_total") > 0
    assert metric_sum(metrics, "vllm:prefix_cache_hits_total") > 0
    assert_no_blocks_in_use(tpu_server)
    gpu = start_server(default_model_dir, str(tmp_path), controller_args=TIGHT)
    try:
        assert _workload(gpu) == got, "TPU and GPU executors disagree"
    finally:
        gpu.stop()


def test_tpu_chat_streaming_and_sampling(tpu_server):
    client = tpu_server.client()
    r = client.chat.completions.create(
        model=tpu_server.model_name, messages=CHATS[0], max_tokens=20, temperature=0
    )
    assert "Paris" in r.choices[0].message.content
    stream = client.chat.completions.create(
        model=tpu_server.model_name, messages=CHATS[0], max_tokens=20, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content
    kw = dict(
        model=tpu_server.model_name,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        n=2,
        seed=7,
        logprobs=2,
    )
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert all(len(c.logprobs.top_logprobs[0]) == 2 for c in first.choices)
    kinds = {e["kind"] for e in tpu_server.executors_state()}
    assert kinds == {"tpu"}
    assert_no_blocks_in_use(tpu_server)


def test_tpu_structured_outputs_hold(tpu_server):
    """A JSON schema greedy and sampled (seeded, twice), a regex and a choice with logprobs,
    sent at once: masked and unmasked rows share steps on the masked programs."""
    schema = SCHEMAS["enum_and_bounds"]
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    chat = dict(model=tpu_server.model_name, messages=ASK, max_tokens=100, response_format=fmt)
    pattern = r"[0-9]{3}-[0-9]{4}"

    async def run():
        async with tpu_server.async_client() as client:
            return await asyncio.gather(
                client.chat.completions.create(**chat, temperature=0),
                client.chat.completions.create(**chat, temperature=1.0, top_p=0.9, seed=3),
                client.chat.completions.create(**chat, temperature=1.0, top_p=0.9, seed=3),
                client.completions.create(
                    model=tpu_server.model_name,
                    prompt="Answer: ",
                    max_tokens=30,
                    temperature=0,
                    extra_body={"structured_outputs": {"regex": pattern}},
                ),
                client.chat.completions.create(
                    model=tpu_server.model_name,
                    messages=CHATS[0],
                    max_tokens=10,
                    temperature=0,
                    logprobs=True,
                    top_logprobs=5,
                    extra_body={"structured_outputs": {"choice": ["Paris", "London"]}},
                ),
            )

    greedy, sampled, again, regex, choice = asyncio.run(run())
    for r in (greedy, sampled):
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert sampled.choices[0].message.content == again.choices[0].message.content
    assert re.fullmatch(pattern, regex.choices[0].text), regex.choices[0].text
    assert choice.choices[0].message.content in ("Paris", "London")
    first = choice.choices[0].logprobs.content[0]
    assert all(any(c.startswith(t.token) for c in ("Paris", "London")) for t in first.top_logprobs)
    assert_no_blocks_in_use(tpu_server)


def test_tpu_compiled_nothing_after_warmup(tpu_server):
    """Runs after the serving tests above: torch_xla's compile counter, as exported."""
    text = httpx.get(tpu_server.metrics_url, timeout=10).text
    assert metric_sum(text, "tandem:xla_warmup_compilations") == 3 + 3 + len(VARIANTS)
    assert metric_sum(text, "tandem:xla_compilations_after_warmup") == 0
