"""A streamed completion with `echo` and `logprobs` whose prompt is prefilled in chunks (its
prompt logprobs come over several steps, before any token) says its prompt once: the streamed
text and logprobs, joined, are the whole response's (the simulated executor is deterministic
at temperature 0)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.processes import start_server

PROMPT = list(range(100, 120))  # 20 tokens: five prefill chunks of 4


@pytest.fixture(scope="module")
def chunked_server(default_model_dir, tmp_path_factory):
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("echo")),
        controller_args=["--long-prefill-token-threshold", "4"],
        executor_kinds=("executor_sim",),
    )
    yield s
    s.stop()


def test_the_prompt_is_echoed_once(chunked_server):
    s = chunked_server
    body = {"model": s.model_name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    body.update(echo=True, logprobs=1)
    whole = httpx.post(s.base_url + "/v1/completions", json=body, timeout=60).json()
    with httpx.stream(
        "POST", s.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    assert len(choices) > 2  # the prompt logprobs came in several chunks
    want = whole["choices"][0]
    assert "".join(c["text"] for c in choices) == want["text"]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == want["logprobs"]["tokens"]
    assert len(tokens) == len(PROMPT) + 3
