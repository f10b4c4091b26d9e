"""Configuration and description types shared by the controller and the executors (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExecutorConfig:
    """How an executor process is set up (its command-line flags)."""

    model: str  # local Hugging Face model directory
    served_model_name: str = ""  # name reported to the controller; "" = directory basename
    dtype: str = "float32"  # weights/activations dtype: float32, bfloat16, float16
    device: str = "auto"  # "auto", "cuda", "cuda:N", "cpu"
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 0  # KV budget where it cannot be profiled (CPU); 0 = default
    gpu_memory_utilization: float = 0.9  # share of device memory Tandem may use (CUDA)
    max_num_batched_tokens: int = 2048  # most tokens per step (replaced by InitDevice's)
    max_num_seqs: int = 128  # most requests per step (replaced by InitDevice's)
    max_model_len: int = 0  # longest sequence; 0 = the model's own
    seed: int = 0  # global seed
    enforce_eager: bool = False  # skip graph capture / compilation during warm-up
    chunked_prefill: bool = True  # report chunked-prefill support to the controller
    max_logprobs: int = 20  # most top logprobs returned per position
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default
    load_format: str = "auto"  # "auto": the checkpoint's weights; "dummy": random weights of
    # the checkpoint's shape (config.json alone; for benchmarks)


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
