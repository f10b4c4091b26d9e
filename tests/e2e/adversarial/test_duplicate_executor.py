"""One executor, one session: the same executor process reached under two addresses
(127.0.0.1 and localhost, as a static name and its DNS address would be) is driven once. The
second address waits as a "duplicate" of the first (state and duplicate_of in
/admin/executors) instead of running a second session that resets the first's KV cache at every
handshake. Before: 567 losses and reconnects in 20 s of 4 concurrent clients, each a handshake
that reset the executor."""

from __future__ import annotations

import os
import time

from tests.e2e.adversarial.isolation_support import (
    INNOCENT_PROMPTS,
    SIM_SPEED,
    InnocentLoad,
    greedy_texts,
)
from tests.e2e.helpers import executors_lost, metric_sum, metrics_text
from tests.support.processes import (
    FAST_HEALTH,
    spawn_controller,
    spawn_executor,
    wait_until,
    write_executor_file,
)


def _states(server) -> dict[str, dict]:
    return {e["address"]: e for e in server.executors_state()}


def _one_driver(server) -> tuple[str, str] | None:
    """(driving address, duplicate address) once one is healthy and the other its duplicate."""
    states = _states(server)
    healthy = [a for a, e in states.items() if e["healthy"]]
    duplicates = [a for a, e in states.items() if e["state"] == "duplicate"]
    if len(healthy) == 1 and len(duplicates) == 1:
        return healthy[0], duplicates[0]
    return None


def test_one_executor_under_two_addresses_is_driven_once(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    executor, port = spawn_executor("executor_sim", default_model_dir, tmp, "sim", extra=SIM_SPEED)
    listing = os.path.join(tmp, "executors.txt")
    addresses = [f"127.0.0.1:{port}", f"localhost:{port}"]
    write_executor_file(listing, addresses)
    server = spawn_controller(
        default_model_dir,
        tmp,
        [*FAST_HEALTH, "--executor-file", listing, "--discovery-interval", "0.5"],
    )
    server.executors = [executor]
    try:
        driver, duplicate = wait_until(lambda: _one_driver(server), 120, "one driver", logs=tmp)
        state = _states(server)[duplicate]
        assert state["duplicate_of"] == driver and "same executor" in state["connect_error"]
        metrics = metrics_text(server)
        assert metric_sum(metrics, 'tandem:executors{accelerator="gpu",model_name') >= 1
        assert 'state="duplicate"} 1.0' in metrics
        references = greedy_texts(server, INNOCENT_PROMPTS[:4])
        lost = executors_lost(server)
        with InnocentLoad(server, INNOCENT_PROMPTS[:4], references) as load:
            time.sleep(4)
        load.check(at_least=20)
        assert executors_lost(server) == lost
        assert _one_driver(server) == (driver, duplicate)  # still one session, the same
        assert _states(server)[driver]["reconnects"] == 0

        # The driving address leaves: the duplicate takes the executor over.
        write_executor_file(listing, [duplicate])
        wait_until(
            lambda: list(_states(server)) == [duplicate] and _states(server)[duplicate]["healthy"],
            60,
            "the duplicate to take over",
            logs=tmp,
        )
        assert _states(server)[duplicate]["duplicate_of"] == ""
        assert greedy_texts(server, INNOCENT_PROMPTS[:4]) == references
        assert executors_lost(server) == lost
    finally:
        server.stop()
