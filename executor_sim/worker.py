"""SimWorker: a WorkerBase with no device, timed by a latency model."""

from __future__ import annotations

import logging
import random
import time

from common.host.settings import ExecutorConfig
from common.host.worker_base import WorkerBase
from common.wire.config import MemoryProfile
from common.wire.model_config import load_model_geometry
from common.wire.step_types import StepInput, StepOutput
from executor_sim import faults
from executor_sim.metrics import install_step_size_probe, shared_metrics, take_step_bytes
from executor_sim.options import SimOptions
from executor_sim.runner import SimModelRunner
from executor_sim.sampler import FakeSampler

log = logging.getLogger(__name__)

#: KV blocks reported when neither --num-blocks nor --kv-cache-bytes is given.
DEFAULT_NUM_BLOCKS = 4096


class SimWorker(WorkerBase):
    """Serves steps without a model: fake tokens, modeled step time, metrics."""

    def __init__(self, config: ExecutorConfig, options: SimOptions | None = None):
        super().__init__(config)
        self.options = options or SimOptions()  # simulation settings
        self.metrics = shared_metrics()  # Prometheus counters
        self._jitter_rng = random.Random(config.seed)  # noise of the latency model
        self._running = 0  # this executor's share of the process's running-requests gauge
        install_step_size_probe()

    def init_device(self) -> None:
        """Read the geometry from config.json and create the runner (no device to bind)."""
        self.device_kind = self.options.device_kind
        self.device_name = self.options.device_name
        geometry = load_model_geometry(
            self.config.model, self.config.max_model_len, self.config.served_model_name
        )
        vocab = self.options.sample_vocab_size or geometry.vocab_size
        sampler = FakeSampler(
            min(vocab, geometry.vocab_size),
            geometry.eos_token_ids,
            self.config.seed,
            self.options.eos_prob,
            self.config.max_logprobs,
        )
        self.model_runner = SimModelRunner(self.config, geometry, sampler)

    def determine_available_memory(self) -> MemoryProfile:
        """The configured fake KV budget: --num-blocks blocks, else --kv-cache-bytes."""
        per_block = self.get_kv_cache_spec().bytes_per_block
        if self.options.num_blocks > 0:
            budget = self.options.num_blocks * per_block
        else:
            budget = self.config.kv_cache_bytes or DEFAULT_NUM_BLOCKS * per_block
        return MemoryProfile(
            available_kv_bytes=budget,
            weights_bytes=self.options.weights_bytes,
            peak_activation_bytes=0,
        )

    def compile_or_warm_up_model(self) -> int:
        """Nothing to compile (and no torch to seed)."""
        return 0

    def profile(self, is_start: bool = True, trace_dir: str = "/tmp/tandem-trace") -> None:
        """No profiler to run."""

    def execute_model(self, step: StepInput) -> StepOutput:
        """Run the step on the fake runner, then sleep out the modeled step time."""
        started = time.perf_counter()
        runner = self.model_runner
        assert isinstance(runner, SimModelRunner)
        opts = self.options
        poisoned = faults.triggered(step, opts.fault_token_id) if opts.fault != "none" else []
        if poisoned:
            faults.before_step(opts.fault, opts.fault_hang_seconds)
        output = runner.execute_model(step)
        if poisoned and opts.fault == "reject":
            faults.reject(output, poisoned)
            runner.forget(poisoned)
        shape = runner.last_shape
        modeled = self.options.latency.seconds(
            shape.num_tokens, shape.num_requests, shape.num_context_tokens, self._jitter_rng
        )
        remaining = modeled - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        busy = time.perf_counter() - started
        output.device_seconds = busy
        self._count(shape, busy, modeled, take_step_bytes(step))
        return output

    def _count(self, shape, busy: float, modeled: float, size: int) -> None:
        m = self.metrics
        m.steps.inc()
        m.busy_seconds.inc(busy)
        m.modeled_seconds.inc(modeled)
        m.request_bytes.inc(size)
        m.scheduled_requests.inc(shape.num_requests)
        m.scheduled_tokens.inc(shape.num_tokens)
        m.sampled_tokens.inc(shape.num_sampled)
        if shape.is_decode:
            m.decode_steps.inc()
            m.decode_bytes.inc(size)
            m.decode_requests.inc(shape.num_requests)
        assert isinstance(self.model_runner, SimModelRunner)
        running = len(self.model_runner.requests)  # the gauge sums the process's executors
        m.running.inc(running - self._running)
        self._running = running
