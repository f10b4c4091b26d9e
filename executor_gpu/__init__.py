"""The GPU executor: a worker and model runner for CUDA devices, with a CPU fallback."""

from executor_gpu.model_runner import GPUModelRunner, resolve_device
from executor_gpu.worker import GPUWorker

__all__ = ["GPUModelRunner", "GPUWorker", "resolve_device"]
