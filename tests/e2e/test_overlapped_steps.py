"""Overlapped steps end to end (executor_gpu.overlap): the real controller, pipelining two
steps, drives a GPU executor on the CPU with ``--overlap-steps on``, so every step it sends
ahead is launched before the one in flight is finished; greedy output stays transformers' own
through chunked prefill, preemption and prefix-cache hits, streams and aborts."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.e2e.helpers import (
    PROMPTS,
    assert_exact_under_pressure,
    assert_no_blocks_in_use,
)
from tests.support.processes import start_server


@pytest.fixture(scope="module")
def overlapped_server(default_model_dir, tmp_path_factory):
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("overlap")),
        controller_args=["--max-num-batched-tokens", "48", "--num-kv-blocks", "20"],
        executor_args=["--overlap-steps", "on"],
    )
    yield s
    s.stop()


def test_overlapped_steps_serve_exactly_under_pressure(overlapped_server, hf):
    s = overlapped_server
    assert_exact_under_pressure(s, hf)

    # Logprobs and a repetition penalty (over a history holding the token in flight) beside
    # greedy requests, all at once; the penalized one again alone.
    async def run():
        client = s.async_client()
        calls = [
            client.completions.create(
                model=s.model_name,
                prompt=p,
                max_tokens=12,
                temperature=0,
                logprobs=2,
                extra_body={"return_token_ids": True, **extra},
            )
            for p, extra in zip(PROMPTS[:3], ({}, {"repetition_penalty": 1.3}, {}))
        ]
        return await asyncio.gather(*calls)

    results = [r.choices[0] for r in asyncio.run(run())]
    for c in results[::2]:
        assert c.model_extra["token_ids"] == hf.greedy(c.model_extra["prompt_token_ids"], 12)
    for c in results:
        assert len(c.logprobs.token_logprobs) == len(c.model_extra["token_ids"])
    alone = s.client().completions.create(
        model=s.model_name,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "repetition_penalty": 1.3},
    )
    assert alone.choices[0].model_extra["token_ids"] == results[1].model_extra["token_ids"]
    assert_no_blocks_in_use(s)

    # The controller goes: its step stream closes, and the executor says what it overlapped.
    s.controller.terminate()
    s.controller.wait(timeout=30)
    log_path = os.path.join(s.log_dir, "executor0.log")
    deadline = time.monotonic() + 30
    lines = []
    while not lines and time.monotonic() < deadline:
        time.sleep(0.2)
        with open(log_path) as f:
            lines = [line for line in f if "launched while another was in flight" in line]
    assert lines
    words = lines[-1].split("step stream")[-1].split()
    overlapped, launched = int(words[1]), int(words[3])
    assert launched > 50 and overlapped >= 10
