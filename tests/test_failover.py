"""An executor killed mid-generation loses no request: streams pause, then continue exactly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import ROOT, executor_command, start_server
from tests.test_e2e import PROMPTS, _metric, assert_no_blocks_in_use


@pytest.mark.slow
def test_killed_executor_is_recovered_and_streams_continue(default_model_dir, tmp_path):
    server = start_server(default_model_dir, str(tmp_path))
    try:
        client = server.client()
        expected = [
            client.completions.create(model=server.model_name, prompt=p, max_tokens=48,
                                      temperature=0, extra_body={"ignore_eos": True})
            .choices[0].text
            for p in PROMPTS
        ]
        port = server.executor_ports[0]

        async def stream(p: str, started: asyncio.Event) -> str:
            aclient = server.async_client()
            text = ""
            resp = await aclient.completions.create(
                model=server.model_name, prompt=p, max_tokens=48, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            async for chunk in resp:
                text += chunk.choices[0].text if chunk.choices else ""
                if len(text) > 20:
                    started.set()
            return text

        async def run():
            started = asyncio.Event()
            tasks = [asyncio.create_task(stream(p, started)) for p in PROMPTS]
            await asyncio.wait_for(started.wait(), timeout=120)
            victim = server.executors[0]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            log = open(os.path.join(str(tmp_path), "executor0-restarted.log"), "w")
            server.executors[0] = subprocess.Popen(
                [sys.executable, *executor_command("executor_gpu", default_model_dir, port)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)

        t0 = time.time()
        texts = asyncio.run(run())
        assert texts == expected, (texts, expected)
        assert time.time() - t0 < 300
        assert_no_blocks_in_use(server)
        metrics = httpx.get(server.base_url + "/metrics").text
        assert _metric(metrics, "tandem:executor_lost_total") >= 1
    finally:
        server.stop()
