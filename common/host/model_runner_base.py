"""ModelRunnerBase: the part of an executor that owns the model, the KV cache and the batch.

Device backends subclass it, through common.torch.runner.TorchModelRunner for the torch-based
ones (executor_gpu.GPUModelRunner, executor_tpu.TPUModelRunner). The base keeps what every
backend shares: the configuration, the loaded model, and the KV-cache spec derived from the
model geometry. Everything that touches a device is virtual.
"""

from __future__ import annotations

import abc
from typing import Any

from common.host.dtypes import Precision, checkpoint_dtype, resolve_precision
from common.host.settings import ExecutorConfig
from common.host.step_check import StepLimits
from common.wire.config import Capabilities, KVCacheSpec, ModelGeometry, kv_bytes_per_block
from common.wire.step_types import StepInput, StepOutput


class ModelRunnerBase(abc.ABC):
    """Owns the model, its KV cache and the persistent batch of one executor."""

    def __init__(
        self,
        config: ExecutorConfig,
        geometry: ModelGeometry,
        device_kind: str = "cpu",
        capability: tuple[int, int] | None = None,
    ):
        self.config = config  # executor configuration
        self.geometry = geometry  # model geometry read from the checkpoint
        # --dtype / --kv-cache-dtype resolved for this device (cpu, cuda or tpu; capability:
        # CUDA's compute capability); a dtype the device cannot run is refused here, at startup.
        checkpoint = checkpoint_dtype(config.model) if config.dtype == "auto" else "float32"
        self.precision: Precision = resolve_precision(
            config.dtype, config.kv_cache_dtype, checkpoint, device_kind, capability
        )
        self.model: Any = None  # set by load_model()
        self.num_blocks = 0  # set by initialize_kv_cache()

    def get_model(self) -> Any:
        """The loaded model (None before load_model)."""
        return self.model

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """Block layout of the KV cache, from the model geometry and the resolved KV dtype (a
        bf16 cache's block takes half a float32 one's bytes: twice the blocks per budget)."""
        g = self.geometry
        block_size = self.config.block_size
        per_block = kv_bytes_per_block(
            block_size, self.stored_kv_heads(), g.head_dim, g.num_layers, self.precision.kv_bytes
        )
        return KVCacheSpec(
            block_size=block_size,
            bytes_per_block=per_block,
            dtype=self.precision.kv_cache_dtype,
        )

    def stored_kv_heads(self) -> int:
        """Key/value heads one block stores per layer over all the executor's devices: the
        model's, unless a sharded runner replicates some."""
        return self.geometry.num_kv_heads

    def get_capabilities(self) -> Capabilities:
        """What this runner supports; static-shape backends add their buckets."""
        return Capabilities(
            chunked_prefill=self.config.chunked_prefill,
            max_tokens_per_step=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            max_logprobs=self.config.max_logprobs,
            tensor_parallel_size=self.config.tensor_parallel_size,
        )

    def step_limits(self) -> StepLimits:
        """What a step may ask of this runner (common.host.step_check): the capabilities it
        reports, the model's geometry and the blocks ``initialize_kv_cache`` allocated."""
        caps = self.get_capabilities()
        return StepLimits(
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
            vocab_size=self.geometry.vocab_size,
            max_model_len=self.geometry.max_model_len,
            max_tokens_per_step=caps.max_tokens_per_step,
            max_num_seqs=caps.max_num_seqs,
            max_logprobs=caps.max_logprobs,
        )

    def reset(self) -> None:
        """Forget every request (a new controller session starts)."""

    def forget(self, request_ids: list[str]) -> None:
        """Forget these requests (a step failed as a whole: their state is not trusted). The
        default forgets every request; runners that keep per-request state override it."""
        self.reset()

    def set_seed(self, seed: int) -> None:
        """Reset the global random state of the device's framework (after warm-up)."""

    def start_profile(self) -> None:
        """Start the framework's profiler (no-op where there is none)."""

    def stop_profile(self, trace_path: str) -> None:
        """Stop the profiler started by ``start_profile`` and write its trace to trace_path."""

    @abc.abstractmethod
    def load_model(self) -> None:
        """Load the weights onto the device and set self.model."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks on the device."""

    @abc.abstractmethod
    def execute_model(self, step: StepInput) -> StepOutput:
        """Apply the step's diff to the persistent batch, run the forward pass, sample."""

    @abc.abstractmethod
    def dummy_run(self, num_tokens: int, num_reqs: int) -> None:
        """Run a forward pass on fabricated inputs of the given size (no KV writes kept)."""

    @abc.abstractmethod
    def profile_run(self) -> int:
        """Run the worst-case step; return the peak activation bytes it used."""

    @abc.abstractmethod
    def capture_model(self) -> int:
        """Capture graphs / precompile shapes for serving; return how many were made."""
