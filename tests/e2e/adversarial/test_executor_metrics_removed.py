"""Per-executor metric series leave /metrics with their executor: an executor that leaves
discovery (a scaled-down pod) is removed from the fleet, and every series labelled
executor="host:port" goes with it, instead of reporting its last values forever (and growing
the exposition with every pod that ever lived)."""

from __future__ import annotations

import os

from tests.e2e.adversarial.isolation_support import INNOCENT_PROMPTS, SIM_SPEED, complete, greedy
from tests.e2e.helpers import metrics_text
from tests.support.processes import (
    FAST_HEALTH,
    spawn_controller,
    spawn_executor,
    wait_healthy_executors,
    wait_until,
    write_executor_file,
)


def test_a_removed_executors_series_leave_metrics(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    sims = [
        spawn_executor("executor_sim", default_model_dir, tmp, f"sim{i}", extra=SIM_SPEED)
        for i in range(2)
    ]
    addresses = [f"127.0.0.1:{port}" for _, port in sims]
    listing = os.path.join(tmp, "executors.txt")
    write_executor_file(listing, addresses)
    server = spawn_controller(
        default_model_dir,
        tmp,
        [*FAST_HEALTH, "--executor-file", listing, "--discovery-interval", "0.5"],
    )
    server.executors = [proc for proc, _ in sims]
    try:
        wait_healthy_executors(server, 2, 120)
        for prompt in INNOCENT_PROMPTS:
            status, _, _ = complete(server, greedy(prompt))
            assert status == 200

        def series(text: str, executor: str) -> set[str]:
            """The metric names with a series labelled with this executor."""
            mark = f'executor="{executor}"'
            return {line.split("{")[0] for line in text.splitlines() if mark in line}

        before = metrics_text(server)
        # The executor that served the requests leaves (its counters are there to go).
        served = [a for a in addresses if "vllm:generation_tokens_total" in series(before, a)]
        gone = served[0]
        kept = next(a for a in addresses if a != gone)
        assert {"vllm:request_success_total", "tandem:executor_healthy"} <= series(before, gone)
        assert "tandem:executor_healthy" in series(before, kept)

        write_executor_file(listing, [kept])
        wait_until(
            lambda: [e["address"] for e in server.executors_state()] == [kept],
            60,
            "the executor's removal",
            logs=tmp,
        )
        after = metrics_text(server)
        assert series(after, gone) == set()
        assert series(after, kept) == series(before, kept)
        status, _, _ = complete(server, greedy(INNOCENT_PROMPTS[0]))
        assert status == 200 and series(metrics_text(server), gone) == set()
    finally:
        server.stop()
