"""Description types shared by the controller and the executors (no torch); an executor's
own configuration is common.host.settings.ExecutorConfig."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelGeometry:
    """Shape facts of the served model that the controller needs."""

    model_name: str  # name the model is served under
    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int  # logits width
    num_layers: int  # transformer layers
    num_kv_heads: int  # key/value heads per layer
    head_dim: int  # size of one head
    max_model_len: int  # longest sequence accepted
    eos_token_ids: list[int] = field(default_factory=list)  # tokens that end generation
    # per layer: its sliding window in tokens (0 = the whole context); empty = none has one
    layer_windows: list[int] = field(default_factory=list)

    @property
    def uniform_window(self) -> int:
        """The window every layer shares, or 0 when some layer sees the whole context (only
        then may a block fall out of every layer's sight)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 and self.layer_windows else 0


@dataclass
class KVCacheSpec:
    """Layout facts of the KV cache the controller allocates blocks in."""

    block_size: int  # tokens per block
    bytes_per_block: int  # bytes of one block across layers, keys and values
    dtype: str  # element type of the cache


@dataclass
class Capabilities:
    """What the executor can do; the scheduler sizes steps from these, not from device names."""

    chunked_prefill: bool = True  # a prompt may span several steps
    max_tokens_per_step: int = 2048  # most tokens in one step
    token_buckets: list[int] = field(default_factory=list)  # static-shape token paddings
    request_buckets: list[int] = field(default_factory=list)  # static-shape request paddings
    max_num_seqs: int = 128  # most requests in one step
    max_logprobs: int = 20  # most top logprobs per position
    tensor_parallel_size: int = 1  # devices the model is sharded over behind this executor
    packed_steps: bool = True  # reads StepRequest's packed_* arrays (False: an older executor)
    step_socket_port: int = 0  # its steps' own TCP port (common/wire/step_frames.py); 0 = none


@dataclass
class DeviceInfo:
    """InitDevice's answer."""

    incarnation_id: str  # new on every process start
    device_kind: str  # "gpu", "tpu" or "cpu"
    device_name: str  # human-readable device name
    model: ModelGeometry  # model geometry
    kv_cache: KVCacheSpec  # KV block spec
    capabilities: Capabilities  # capabilities


@dataclass
class MemoryProfile:
    """ProfileMemory's answer."""

    available_kv_bytes: int  # bytes the KV cache may take
    weights_bytes: int  # bytes the weights take
    peak_activation_bytes: int  # peak activation bytes of the worst-case step


def kv_bytes_per_block(
    block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype_size: int
) -> int:
    """Bytes one KV block takes: keys and values of every layer."""
    return 2 * block_size * num_kv_heads * head_dim * dtype_size * num_layers
