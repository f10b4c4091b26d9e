"""The simulated executor's own settings: the step-time model, the reported device and KV
cache, and how many executors one process serves."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from common.host.settings import ExecutorSettings
from common.settings import SettingError, derived, setting
from executor_sim.faults import FaultKind
from executor_sim.latency import LatencyModel

SIMULATION = "simulation"
FAULTS = "simulated faults (tests)"


class SimOptions(BaseModel):
    """What only a simulated executor is configured with."""

    model_config = ConfigDict(extra="forbid")

    step_fixed_ms: float = setting(5.0, "milliseconds every step costs", group=SIMULATION)
    step_per_token_us: float = setting(20.0, "microseconds per scheduled token", group=SIMULATION)
    step_per_request_us: float = setting(
        0.0, "microseconds per scheduled request", group=SIMULATION
    )
    step_per_context_token_ns: float = setting(
        0.0, "nanoseconds per token attended to (sum of sequence lengths)", group=SIMULATION
    )
    step_jitter: float = setting(
        0.0, "relative uniform noise on each step's time (0.1 = +-10%)", group=SIMULATION
    )
    num_blocks: int = setting(
        0, "KV blocks to report (0: --kv-cache-bytes, else 4096 blocks)", group=SIMULATION
    )
    eos_prob: float = setting(
        0.0,
        "chance per token of sampling EOS / a stop id (after min_tokens)",
        group=SIMULATION,
    )
    sample_vocab_size: int = setting(
        0, "sample ids below this (0 = the whole vocabulary)", group=SIMULATION
    )
    device_kind: str = setting(
        "gpu", "device kind reported (the controller's --executor-limits key)", group=SIMULATION
    )
    device_name: str = setting("simulated", "device name reported", group=SIMULATION)
    fault: FaultKind = setting(
        "none",
        "what a request carrying --fault-token-id does: reject (fails alone), step (fails its "
        "step), hang (stalls its step), device (a device failure)",
        group=FAULTS,
    )
    fault_token_id: int = setting(
        -1, "prompt token id that triggers --fault (-1 = none)", group=FAULTS
    )
    fault_hang_seconds: float = setting(5.0, "how long --fault hang stalls a step", group=FAULTS)
    weights_bytes: int = derived(0, help="weights size reported by ProfileMemory")
    # The step-time model; None: the one the step_* settings describe (code may give its own).
    latency: LatencyModel | None = derived(None)

    @model_validator(mode="after")
    def _latency_from_settings(self) -> SimOptions:
        if self.latency is None:
            self.latency = LatencyModel(
                fixed_s=self.step_fixed_ms / 1e3,
                per_token_s=self.step_per_token_us / 1e6,
                per_request_s=self.step_per_request_us / 1e6,
                per_context_token_s=self.step_per_context_token_ns / 1e9,
                jitter=self.step_jitter,
            )
        return self


class SimSettings(ExecutorSettings, SimOptions):
    """A simulator process: the shared executor settings, the simulation's, and how many
    simulated executors it serves."""

    count: int = setting(
        1,
        "simulated executors in this process, each its own gRPC server on ports --port, "
        "--port + 1, ... (any free ports with --port 0)",
        group=SIMULATION,
    )
    ports_file: str = setting(
        "",
        "once every executor serves, write their ports here, one per line",
        group=SIMULATION,
        metavar="PATH",
    )

    @property
    def serves_many(self) -> bool:
        """Whether this process serves several executors (or reports its ports)."""
        return self.count > 1 or bool(self.ports_file)

    def finalize(self) -> None:
        """The shared checks, and --health-port only for a single executor."""
        super().finalize()
        if self.health_port and self.serves_many:
            raise SettingError("health_port", "--health-port serves one executor: not with --count")
