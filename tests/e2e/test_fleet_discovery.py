"""Executors found through DNS, as pods behind a Kubernetes headless Service: one name, one
address per executor, re-resolved while requests run. Executors listen on the same port on
different loopback addresses (127.0.0.1, 127.0.0.2), as pods do on their own IPs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.helpers import assert_no_blocks_in_use, expected_texts, stream_completion
from tests.support.dns_server import LocalDNSServer
from tests.support.processes import (
    FAST_HEALTH,
    free_port,
    grpc_health,
    spawn_controller,
    spawn_executor,
    wait_healthy_executors,
    wait_until,
)

NAME = "executors.tandem-fleet.test"
LONG_PROMPTS = [
    f"Write a long story about a {w} dragon."
    for w in ("red", "blue", "green", "gold", "grey", "white")
]
NEW_PROMPTS = [f"List {n} colours of the rainbow:" for n in ("three", "four", "five", "six")]


@pytest.mark.slow
def test_executors_join_and_leave_through_dns(default_model_dir, tmp_path):
    dns = LocalDNSServer()
    port = free_port()
    tmp = str(tmp_path)
    first, _ = spawn_executor(
        "executor_gpu", default_model_dir, tmp, "executor-a", port=port, host="127.0.0.1"
    )
    dns.set(NAME, ["127.0.0.1"])
    server = spawn_controller(
        default_model_dir,
        tmp,
        [
            "--executor-dns",
            f"{NAME}:{port}",
            "--dns-server",
            dns.address,
            "--discovery-interval",
            "0.5",
            *FAST_HEALTH,
        ],
    )
    server.executors.append(first)
    a, b = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
    try:
        # The second pod starts now but is not in DNS yet: the controller does not know it.
        second, _ = spawn_executor(
            "executor_gpu", default_model_dir, tmp, "executor-b", port=port, host="127.0.0.2"
        )
        server.executors.append(second)
        (state,) = wait_healthy_executors(server, 1)
        assert state["address"] == a and state["source"] == "dns"
        expected_long = expected_texts(server, LONG_PROMPTS, 96)
        expected_new = expected_texts(server, NEW_PROMPTS, 16)
        wait_until(
            lambda: grpc_health(b) == "SERVING", 300, "the second executor to load", logs=tmp
        )

        async def run():
            started = asyncio.Event()
            streams = [
                asyncio.create_task(stream_completion(server, p, [], started, 96))
                for p in LONG_PROMPTS
            ]
            await asyncio.wait_for(started.wait(), timeout=120)
            dns.set(NAME, ["127.0.0.1", "127.0.0.2"])  # the pod is ready: it joins
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
                while True:
                    fleet = {
                        e["address"]: e
                        for e in (await http.get("/admin/executors")).json()["executors"]
                    }
                    if b in fleet and fleet[b]["healthy"]:
                        break
                    assert time.monotonic() < deadline, fleet
                    await asyncio.sleep(0.2)
            running_on_a = fleet[a]["requests"]
            async with server.async_client() as client:
                new = await asyncio.gather(
                    *(
                        client.completions.create(
                            model=server.model_name,
                            prompt=p,
                            max_tokens=16,
                            temperature=0,
                            extra_body={"ignore_eos": True},
                        )
                        for p in NEW_PROMPTS
                    )
                )
            return await asyncio.gather(*streams), new, running_on_a

        deadline = time.monotonic() + 300
        texts, new, running_on_a = asyncio.run(run())
        assert running_on_a > 0  # it joined while requests were running
        assert texts == expected_long
        assert [r.choices[0].text for r in new] == expected_new
        fleet = {e["address"]: e for e in server.executors_state()}
        assert fleet[b]["source"] == "dns" and fleet[b]["requests_placed"] > 0, fleet
        assert_no_blocks_in_use(server)

        # The first pod goes away from DNS: it is drained and removed; the second serves.
        dns.set(NAME, ["127.0.0.2"])
        wait_until(
            lambda: [e["address"] for e in server.executors_state()] == [b],
            30,
            "the first executor to leave",
            logs=tmp,
        )
        assert expected_texts(server, NEW_PROMPTS, 16) == expected_new
        assert_no_blocks_in_use(server)
    finally:
        server.stop()
        dns.close()
