"""TPUWorker: binds a PJRT device (a TPU, or the host CPU for development), sizes the KV cache,
warms up every static shape, runs steps."""

from __future__ import annotations

import logging
import time

import torch

from common.host.settings import ExecutorConfig
from common.host.worker_base import WorkerBase
from common.wire.config import MemoryProfile
from common.wire.model_config import load_model_geometry
from common.wire.step_types import StepInput, StepOutput
from executor_tpu.options import TPUOptions, resolve_cache_dir, select_pjrt_device
from executor_tpu.spmd import SpmdMesh, prepare_devices, start_spmd
from executor_tpu.tp_memory import sharded_memory_profile

log = logging.getLogger(__name__)

#: KV-cache budget on XLA:CPU when the configuration gives none.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
#: Longest sequence on XLA:CPU unless --max-model-len says otherwise: the static gather
#: attention costs every step (tokens x max_model_len), which the CPU feels.
DEFAULT_CPU_MAX_MODEL_LEN = 1024


def _init_compile_cache(path: str) -> None:
    """Turn on torch_xla's persistent compilation cache (before any XLA computation)."""
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        log.warning("XLA computation cache already initialized; persistent cache %s not used", path)
        return
    xr.initialize_cache(path, readonly=False)
    log.info("persistent XLA compilation cache: %s", path)


class TPUWorker(WorkerBase):
    """The worker of a TPU executor; runs on XLA:CPU (``PJRT_DEVICE=CPU``) for development."""

    device_kind = "tpu"

    def __init__(self, config: ExecutorConfig, options: TPUOptions | None = None):
        super().__init__(config)
        self.options = options or TPUOptions()  # buckets, attention, cache
        self.pjrt_device = ""  # "TPU" or "CPU", set by init_device()
        self.mesh: SpmdMesh | None = None  # with --tensor-parallel-size > 1 (init_device)

    @property
    def decode_steps_ahead(self) -> bool:
        """Not on XLA:CPU, where the model runs on the host's cores (see WorkerBase)."""
        return self.pjrt_device != "CPU"

    def init_device(self) -> None:
        """Choose the PJRT device, turn on the compilation cache, bind the XLA device, read
        the model geometry and create the runner."""
        self.pjrt_device = select_pjrt_device(self.config.device)
        tp = self.config.tensor_parallel_size
        prepare_devices(tp, self.pjrt_device)
        cache_dir = resolve_cache_dir(self.options.compile_cache_dir, self.pjrt_device)
        if cache_dir:
            _init_compile_cache(cache_dir)
        import torch_xla
        import torch_xla.runtime as xr

        from executor_tpu.attention_choice import is_tpu
        from executor_tpu.model_runner import TPUModelRunner

        self.mesh = start_spmd(tp, self.pjrt_device == "TPU") if tp > 1 else None
        device = torch_xla.device()
        sharded = f", sharded over {tp} (SPMD)" if tp > 1 else ""
        if is_tpu(device):
            self.device_name = f"TPU ({xr.global_runtime_device_count()} chips{sharded})"
            if tp == 1 and xr.global_runtime_device_count() > 1:
                log.info("one chip used: --tensor-parallel-size N shards the model over N chips")
        else:
            self.device_name = f"XLA:CPU (PJRT_DEVICE=CPU{sharded})"
            if self.config.max_model_len == 0:
                self.config.max_model_len = DEFAULT_CPU_MAX_MODEL_LEN
                log.info(
                    "XLA:CPU: max_model_len %d (set --max-model-len to change it)",
                    DEFAULT_CPU_MAX_MODEL_LEN,
                )
        if self.config.num_threads > 0:
            torch.set_num_threads(self.config.num_threads)
        self.device = device  # the bound XLA device
        geometry = load_model_geometry(
            self.config.model, self.config.max_model_len, self.config.served_model_name
        )
        self.model_runner = TPUModelRunner(self.config, geometry, self.options, device, self.mesh)
        log.info(
            "bound %s; attention %s, KV layout %s",
            self.device_name,
            self.model_runner.attention_backend,
            self.model_runner.layout,
        )

    def determine_available_memory(self) -> MemoryProfile:
        """On a TPU: total * gpu_memory_utilization (the device share) minus the weights and
        the peak of a profile run at the largest bucket, from ``xm.get_memory_info``. On
        XLA:CPU: ``config.kv_cache_bytes`` or 2 GiB."""
        import torch_xla.core.xla_model as xm

        from executor_tpu.attention_choice import is_tpu
        from executor_tpu.model_runner import TPUModelRunner

        runner = self.model_runner
        assert isinstance(runner, TPUModelRunner) and runner.get_model() is not None
        if not is_tpu(self.device):
            budget = self.config.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            return MemoryProfile(
                available_kv_bytes=budget,
                weights_bytes=runner.weights_bytes,
                peak_activation_bytes=0,
            )
        if self.mesh is not None:
            return sharded_memory_profile(runner, self.mesh, self.config.gpu_memory_utilization)
        peak = runner.profile_run()
        limit = int(xm.get_memory_info(self.device)["bytes_limit"])
        available = int(limit * self.config.gpu_memory_utilization) - runner.weights_bytes - peak
        log.info(
            "KV budget %.2f GiB (HBM %.2f GiB, weights %.2f GiB, peak activations %.2f GiB)",
            available / 2**30,
            limit / 2**30,
            runner.weights_bytes / 2**30,
            peak / 2**30,
        )
        return MemoryProfile(
            available_kv_bytes=max(0, available),
            weights_bytes=runner.weights_bytes,
            peak_activation_bytes=peak,
        )

    def compile_or_warm_up_model(self) -> int:
        """Precompile every shape (unless enforce_eager) without autograd."""
        with torch.no_grad():
            return super().compile_or_warm_up_model()

    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step on the runner without autograd."""
        assert self.model_runner is not None
        started = time.perf_counter()
        with torch.no_grad():
            output = self.model_runner.execute_model(step)
        self.metrics.observe(step, time.perf_counter() - started)
        return output

    def memory_usage(self) -> dict[str, int]:
        """Weights and KV cache, and the device's used / limit bytes where PJRT reports them."""
        usage = super().memory_usage()
        runner = self.model_runner
        if runner is not None and self.pjrt_device == "TPU" and self.mesh is None:
            import torch_xla.core.xla_model as xm

            info = xm.get_memory_info(runner.device)
            usage.update(used=int(info.get("bytes_used", 0)), total=int(info.get("bytes_limit", 0)))
        return usage
