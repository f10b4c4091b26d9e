"""A device failure is the executor's, not a request's: a fault injected below the device
boundary of a real executor process (the simulator raising a CUDA error in a step) turns the
executor's health NOT_SERVING at once and ends the process with status 70 (Kubernetes restarts
it), and the controller counts one loss and moves every request to another executor, where
each finishes with its greedy text, the request that happened to be in the step included.
Before: the torch runner caught the error as a failure of that step's requests and went on
SERVING on a dead device, failing every later request sent to it."""

from __future__ import annotations

import threading
import time

from tests.e2e.adversarial.isolation_support import (
    INNOCENT_PROMPTS,
    SIM_SPEED,
    InnocentLoad,
    complete,
    greedy,
    greedy_texts,
)
from tests.e2e.helpers import executors_lost
from tests.support.processes import (
    FAST_HEALTH,
    free_port,
    grpc_health,
    spawn_controller,
    spawn_executor,
    wait_healthy_executors,
    wait_until,
)

FAULT = 7779  # the step bringing a request with this token meets a device failure
EXIT_AFTER = 2.0  # seconds of NOT_SERVING before the process exits


def _health(port: int) -> str:
    return grpc_health(f"127.0.0.1:{port}", timeout=1)


def test_a_device_failure_ends_the_executor_and_its_requests_move(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    faulty, faulty_port = spawn_executor(
        "executor_sim",
        default_model_dir,
        tmp,
        "faulty",
        extra=[*SIM_SPEED, "--fault", "device", "--fault-token-id", str(FAULT)]
        + ["--device-failure-exit-after", str(EXIT_AFTER)],
    )
    spare_port = free_port()  # its executor starts once the faulty one has failed
    server = spawn_controller(
        default_model_dir,
        tmp,
        [*FAST_HEALTH, "--executor", f"127.0.0.1:{faulty_port}"]
        + ["--executor", f"127.0.0.1:{spare_port}"],
    )
    server.executors = [faulty]
    try:
        wait_healthy_executors(server, 1, 120)
        references = greedy_texts(server, INNOCENT_PROMPTS[:3])
        lost = executors_lost(server)
        answer: dict = {}
        poison = [1, FAULT, 3, 4]

        def send_poison() -> None:
            answer["status"], answer["body"], _ = complete(server, greedy(poison), 120)

        with InnocentLoad(server, INNOCENT_PROMPTS[:3], references) as load:
            time.sleep(0.5)
            thread = threading.Thread(target=send_poison)
            failed_at = time.perf_counter()
            thread.start()
            wait_until(lambda: _health(faulty_port) != "SERVING", 10, "NOT_SERVING", logs=tmp)
            assert _health(faulty_port) in ("NOT_SERVING", "GONE")
            faulty.wait(timeout=EXIT_AFTER + 15)
            assert faulty.returncode == 70
            assert time.perf_counter() - failed_at < EXIT_AFTER + 15
            spare, _ = spawn_executor(
                "executor_sim", default_model_dir, tmp, "spare", port=spare_port, extra=SIM_SPEED
            )
            server.executors.append(spare)
            thread.join(timeout=120)
            time.sleep(0.5)
        # The request in the failed step was not at fault: it finished on the spare.
        assert answer["status"] == 200, answer
        status, again, _ = complete(server, greedy(poison))
        assert status == 200
        assert again["choices"][0]["text"] == answer["body"]["choices"][0]["text"]
        load.check(at_least=3)
        assert executors_lost(server) - lost == 1
        state = {e["address"]: e for e in server.executors_state()}
        assert not state[f"127.0.0.1:{faulty_port}"]["healthy"]
        assert state[f"127.0.0.1:{spare_port}"]["healthy"]
    finally:
        server.stop()
